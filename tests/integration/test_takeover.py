"""Heartbeat takeover among replicas that share an outbox's lanes, each a real `relay run`.

Three replicas hold one lane each; one replica's path to Postgres is black-holed (a
proxy that stops forwarding and keeps its sockets open). The other two end its lease
session after `takeover_after` and one of them takes its lane. Until that replica's
claim stamps the lane, the lane's checkpoint row still carries the silent replica's old
heartbeat: judged by it, the third replica ended the healthy one that had just taken
the lock, and every lane on its session with it. Here the claim is held back (its start
point waits for the event sequence, which the test keeps locked), so that the window is
open for as long as the third replica needs to look at it, on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from relay.config import LeaseConfig
from relay.postgres.lease import lock_key
from relay.postgres.queries import LeaseQueries
from tests.support import postgres
from tests.support.db import connect
from tests.support.lanes import MESSAGES, held_by, shape, status, until
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, migrate_cli, save

pytestmark = pytest.mark.timeout(120)

Start = Callable[..., RelayProcess]
# Quick leases within the relay's rules: a standby looks every 300 ms.
LEASE = {
    "retry_interval": "300ms",
    "check_interval": "500ms",
    "check_timeout": "500ms",
    "takeover_after": "2s",
}
ENDED = "silent holder's session terminated"


def ended(replica: RelayProcess) -> list[dict[str, Any]]:
    """The lease sessions this replica ended, as it logged them."""
    return [r for r in replica.logs() if r.get("event") == ENDED]


def lost(replica: RelayProcess) -> list[dict[str, Any]]:
    return [r for r in replica.logs() if str(r.get("event", "")).startswith("lease lost")]


def identity_of(replica: RelayProcess) -> str:
    return f":{replica.pid}"


async def lock_holder(conn: asyncpg.Connection, key: int) -> tuple[int, str] | None:
    """The backend pid and identity of the session holding lock `key`, as a standby sees it."""
    row = await conn.fetchrow(LeaseQueries.holder_of, key)
    if row is None:
        return None
    return int(row["pid"]), str(row["application_name"]).removesuffix(":lease")


async def test_a_standby_never_ends_the_healthy_replica_that_took_a_silent_holders_lane(
    *,
    events_table: str,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    relay_process: Start,
    tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    # start: end, so that a claim reads the event sequence's head (its start point).
    data = config_dict(events_table, nats_url, stream, messages=MESSAGES, partitions=3, start="end")
    data["lease"] = LEASE
    direct = save(tmp_path, data, "direct.yaml")
    proxy = tcp_proxy(*postgres.address(events_table))
    data["database"]["url"] = postgres.with_address(events_table, proxy.host, proxy.port)
    proxied = save(tmp_path, data, "proxied.yaml")
    migrate_cli(direct)

    a = relay_process(["run", "--config", str(direct)])
    b = relay_process(["run", "--config", str(proxied)])
    c = relay_process(["run", "--config", str(direct)])
    await until(direct, lambda rows: shape(rows) == [1, 1, 1])
    (lane,) = held_by(await status(direct), b)
    key = lock_key(LeaseConfig().namespace, lane)
    healthy = {a.pid: a, c.pid: c}

    async with connect(events_table) as watcher, connect(events_table) as blocker:
        sequence = await watcher.fetchval("SELECT pg_get_serial_sequence('events', 'position')")
        proxy.pause()  # b's path: a black hole from now on
        # Every claim from now on waits in its start point (pg_sequence_last_value waits
        # for ALTER SEQUENCE's lock), holding its lane's lock but not having stamped it.
        held_back = blocker.transaction()
        await held_back.start()
        try:
            await blocker.execute(f"ALTER SEQUENCE {sequence} CACHE 1")
            taker: list[tuple[int, str]] = []

            async def a_healthy_replica_took_the_lock() -> bool:
                holder = await lock_holder(watcher, key)
                if holder is not None and not holder[1].endswith(identity_of(b)):
                    taker.append(holder)
                return bool(taker)

            await eventually(a_healthy_replica_took_the_lock, timeout=30)
            (backend, identity), seen = taker[0], await watcher.fetchval("SELECT now()")
            winner = healthy[int(identity.rsplit(":", 1)[1])]
            other = next(r for r in healthy.values() if r is not winner)
            row_holder = await watcher.fetchval(
                "SELECT holder FROM relay.checkpoints WHERE outbox = $1", lane
            )
            print(f"{lane}: lock taken by {identity} (backend {backend}); row says {row_holder}")
            assert row_holder.endswith(identity_of(b)), "the claim was not held back"

            async def the_other_looked_three_times_or_the_lock_moved() -> bool:
                looked = await watcher.fetchval(
                    "SELECT seen_at > $1::timestamptz + interval '900 milliseconds'"
                    " FROM relay.replicas WHERE identity LIKE '%' || $2",
                    seen,
                    identity_of(other),
                )
                return bool(looked) or await lock_holder(watcher, key) != (backend, identity)

            await eventually(the_other_looked_three_times_or_the_lock_moved, timeout=30)
            still = await lock_holder(watcher, key)
        finally:
            await held_back.rollback()

    wrongly = [
        r for p in healthy.values() for r in ended(p) if not r["holder"].endswith(f":{b.pid}")
    ]
    every = [(r["holder"], r["holder_pid"]) for p in healthy.values() for r in ended(p)]
    print(f"sessions ended (b is {b.pid}): {every}")
    assert wrongly == [], f"a healthy replica's lease session was ended: {wrongly}"
    assert still == (backend, identity), f"the lock moved away from {identity}: now {still}"

    def lane_with_the_winner(rows: list[dict[str, Any]]) -> bool:
        return any(r["name"] == lane and r["holder"] == identity for r in rows)

    await until(direct, lane_with_the_winner)
    assert ended(winner) + ended(other), "b's session was never ended"
    assert lost(a) == [] and lost(c) == [], (lost(a), lost(c))
