"""A lane whose holding ends while the replica's coordinator is between two statements.

Each pass of the coordinator first collects the lane tasks that have ended, then looks at
the fleet and the locks, a statement at a time. A lane that ends in between (its reader
killed, say) has let its lock go, so the lock is free when the coordinator looks: it used
to take it and start the lane again over the old task, which was then never collected.
Its error was never read ("Task exception was never retrieved") and its place in
`lease.max_per_replica` was never given back, so the replica could hold one lane fewer
for good, and a lane nobody else might take stayed unrelayed.

The window is opened on every run: the test kills lane 0's reader just before the
coordinator's look at the locks, and waits until the lane has let its lock go.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from relay.postgres.lease import LeaseConnection, lock_key
from tests.support.db import connect
from tests.support.delivery import append_backlog
from tests.support.lanes import delivered
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, status

pytestmark = pytest.mark.timeout(120)

LEASE = {"max_per_replica": 4, "takeover_after": "60s", "retry_interval": "200ms"}
LANE_0, *OTHERS = (lock_key("relay", f"loans/{n}") for n in range(4))
HELD = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND ((classid::bigint << 32) | objid::bigint) = $1::bigint"
)


async def held(dsn: str, key: int) -> bool:
    async with connect(dsn) as conn:
        return bool(await conn.fetchval(HELD, key))


async def kill_reader(dsn: str) -> None:
    """End the relay's reader sessions (only lane 0 is held, so only its reader)."""
    async with connect(dsn) as conn:
        killed = await conn.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE '%:reader'"
        )
    assert killed, "lane 0's reader was running"


async def test_a_lane_ended_between_two_statements_is_collected_before_it_is_taken_again(
    events_table: str,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = config_dict(events_table, nats_url, stream, partitions=4)
    data["lease"] = LEASE
    config = await load_and_migrate(tmp_path, data)
    # Lanes 1 to 3 are held by a session of the test's, as by a replica that is not a
    # member: the relay may hold lane 0 only, and is below its share (2 of 4).
    other = await asyncpg.connect(
        events_table, server_settings={"application_name": "relay:other:1:lease"}
    )
    for key in OTHERS:
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", key)

    real = LeaseConnection.holders
    window: dict[str, Any] = {"armed": False, "opened": 0}

    async def holders_after_lane_0_ended(
        self: LeaseConnection, keys: Sequence[int], lanes: Sequence[str]
    ) -> Any:
        if window["armed"] and LANE_0 in keys and await held(events_table, LANE_0):
            window["armed"] = False
            await kill_reader(events_table)
            await eventually(lambda: _not(held(events_table, LANE_0)), timeout=15)
            window["opened"] += 1
        return await real(self, keys, lanes)

    monkeypatch.setattr(LeaseConnection, "holders", holders_after_lane_0_ended)
    first = await append_backlog(events_table, 40, aggregates=8)
    try:
        async with running(config):
            await eventually(lambda: held(events_table, LANE_0))
            window["armed"] = True
            await eventually(lambda: window["opened"] == 1)
            await eventually(lambda: held(events_table, LANE_0))  # lane 0 goes on
            await other.close()  # the other holder leaves: every lane is this replica's now
            await delivered(nats_url, stream, set(first.values()))
            holders = {row["name"]: row["holder"] for row in await status(config)}
            assert set(holders) == {f"loans/{n}" for n in range(4)}
            assert len(set(holders.values())) == 1, holders  # every lane, by this replica
            assert "relay:other:1" not in holders.values()
    finally:
        if not other.is_closed():
            other.terminate()


async def _not(value: Any) -> bool:
    return not await value
