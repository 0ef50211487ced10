"""JSON numbers a 64-bit float cannot hold go out as the event wrote them.

PostgreSQL's jsonb keeps any number exactly (numeric). The relay read them as floats, and
published `1.123456789012345678` (a token amount with 18 decimals) as 1.1234567890123457,
`12345678901234567890.5` as 1.2345678901234567e+19, and `1.5e-400` as 0.0: a consumer got
another amount than the one the application decided on. Each such number is now written
out as PostgreSQL gave it; a number a float holds is published as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

from tests.support.db import connect
from tests.support.jetstream import Received, fetch_all
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, migrate_cli, save

Start = Callable[..., RelayProcess]
NUMBERS = ["1.123456789012345678", "12345678901234567890.5", "-0.12345678901234567891", "1.5e-400"]


async def test_numbers_a_float_cannot_hold_are_published_as_postgres_holds_them(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    messages = {
        "BookLent": {
            "type": "library.book-lent.v1",
            "destination": "{subject}.lent.{data.amount}",
            "payload": "data",
        }
    }
    config = save(tmp_path, config_dict(events_table, nats_url, stream, messages=messages))
    migrate_cli(config)
    async with connect(events_table) as conn:
        for i, number in enumerate(NUMBERS):
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
                " VALUES ('book', $1, 1, 'BookLent', $2::jsonb)",
                f"book-{i}",
                f'{{"amount": {number}, "rate": 0.1, "count": 3}}',
            )
        # What a consumer should get: each number as jsonb holds it (1.5e-400 written out).
        held = [await conn.fetchval("SELECT ($1::jsonb ->> 'a')", f'{{"a": {n}}}') for n in NUMBERS]
    relay_process(["run", "--config", str(config)])
    got: list[Received] = []

    async def all_published() -> bool:
        got[:] = await fetch_all(nats_url, stream)
        return len(got) == len(NUMBERS)

    await eventually(all_published, timeout=30)
    for number, text, message in zip(NUMBERS, held, got, strict=True):
        body = message.data.decode()
        assert f'"amount":{text}' in body, number  # jsonb orders the keys its own way
        exact = json.loads(body, parse_float=Decimal)
        assert exact == {"amount": Decimal(number), "rate": Decimal("0.1"), "count": 3}
        assert message.subject == f"{stream}.lent.{text}"
