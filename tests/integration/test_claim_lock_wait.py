"""A claim that waits for a row another session holds locked must not stall the replica.

A claim runs on the lease connection, which the replica's proofs, checkpoint writes and
standby checks share; its first statement locks the outbox's row of `relay.outboxes`.
A replica frozen (or cut off) half way through its own claim keeps that row locked, and
another replica's claim then waited for it with the lease connection in hand: its other
lanes stopped publishing, and its standby checks, which would end the frozen session,
could not run. Here a test session holds the row, as the frozen replica would.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.db import connect
from tests.support.delivery import Writer
from tests.support.lanes import LEASE, MESSAGES, delivered_all, held_by, shape, status, until
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, migrate_cli, save

pytestmark = pytest.mark.timeout(120)

Start = Callable[..., RelayProcess]
REFUSED = "lane not claimed: the outbox's row is locked by another session"


def logged(replica: RelayProcess, prefix: str) -> list[dict[str, Any]]:
    return [r for r in replica.logs() if str(r.get("event", "")).startswith(prefix)]


async def test_a_claim_blocked_on_the_outboxes_row_leaves_the_other_lanes_relaying(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start, copies: str
) -> None:
    """a relays one lane of two; b stops while a test session holds the outbox's row: a's
    claim of b's lane gives up after its bound (again and again), a's own lane relays on,
    and once the row is free a takes the lane and everything is delivered in order."""
    data = config_dict(events_table, nats_url, copies, messages=MESSAGES, partitions=2)
    data["lease"] = LEASE  # check_timeout 500 ms: a claim waits for a row 125 ms at most
    config = save(tmp_path, data, "k2.yaml")
    migrate_cli(config)
    async with Writer(events_table, rate=40, aggregates=12) as writer:
        a = relay_process(["run", "--config", str(config)])
        b = relay_process(["run", "--config", str(config)])
        await until(config, lambda rows: shape(rows) == [1, 1])
        (mine,) = held_by(await status(config), a)
        async with connect(events_table) as frozen:
            frozen_pid = frozen.get_server_pid()
            held = frozen.transaction()
            await held.start()
            try:
                await frozen.execute(
                    "SELECT 1 FROM relay.outboxes WHERE outbox = 'loans' FOR UPDATE"
                )
                b.terminate()  # its lane is free: a tries to claim it, and meets the row
                assert await b.wait_async() == 0
                start = len(writer.appended)  # a second's events: a tried the lane meanwhile
                await eventually(lambda: len(writer.appended) >= start + 40, timeout=30)
                mark = max(writer.appended)

                def mine_passed_the_mark(rows: list[dict[str, Any]]) -> bool:
                    row = next(r for r in rows if r["name"] == mine)
                    return bool(row["holder"]) and (row["checkpoint"] or 0) >= mark

                await until(config, mine_passed_the_mark, timeout=20)
                await eventually(lambda: len(logged(a, REFUSED)) >= 2, timeout=10)
                refused = len(logged(a, REFUSED))
            finally:
                await held.rollback()
        print(f"a's claim of b's lane gave up {refused} times while {mine} relayed on")
        await until(config, lambda rows: shape(rows) == [2])
        start = len(writer.appended)
        await eventually(lambda: len(writer.appended) >= start + 20, timeout=30)
        mark = max(writer.appended)
        await until(config, lambda rows: all((r["checkpoint"] or 0) >= mark for r in rows))
    await delivered_all(nats_url, copies, writer)
    assert logged(a, "lease lost") == [], "a lost a lane while its claim waited"
    warning = logged(a, REFUSED)[0]
    assert warning["level"] == "warning" and warning["outbox"] != mine, warning
    assert warning["held_by"].endswith(f"(pid {frozen_pid})"), "the locking session is named"
