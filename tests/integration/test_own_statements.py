"""Every statement of own_tables.sql is prepared by the real server, against a migrated schema.

A statement that names a column the migrations never made, or that Postgres cannot type,
fails here, not on the one path that runs it. The schema's name has capitals, so a statement
that forgot to quote it would name another schema.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg

from relay.postgres.queries import HOLDER_OF, NOTIFY, lock_wait, move_parked, statements
from tests.support.db import connect
from tests.support.jetstream import unique_name
from tests.support.scenario import config_dict, load_and_migrate

GROUPS = ("store", "partitions", "commands", "membership", "lease")


async def test_postgres_prepares_every_statement_of_the_relay_tables(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    schema = "Relay_Own"
    data = config_dict(events_table, nats_url, unique_name("s"), schema=schema)
    await load_and_migrate(tmp_path, data)
    texts = {
        f"{group}.{name}": text
        for group in GROUPS
        for name, text in statements(group, schema).items()
    }
    texts |= {
        "move_parked(1)": move_parked(schema, 1),
        "move_parked(4)": move_parked(schema, 4),
        "HOLDER_OF": HOLDER_OF,
        "NOTIFY": NOTIFY,
    }
    async with connect(events_table) as conn:
        for name, text in texts.items():
            async with conn.transaction():
                await conn.execute(lock_wait(0.5))  # SET LOCAL: only in a transaction
                try:
                    await conn.prepare(text)
                except asyncpg.PostgresError as exc:
                    raise AssertionError(f"{name}: {exc}\n{text}") from exc
