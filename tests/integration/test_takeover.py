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

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from relay.config import DatabaseConfig, LeaseConfig
from relay.postgres.database import Database
from relay.postgres.lease import Holder, Lease, LeaseConnection, lock_key
from relay.postgres.membership import Membership
from relay.postgres.queries import HOLDER_OF
from relay.postgres.sql import lane_key
from relay.postgres.store import Store
from tests.support import postgres
from tests.support.db import connect
from tests.support.jetstream import unique_name
from tests.support.lanes import MESSAGES, held_by, shape, status, until
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, load_and_migrate, migrate_cli, save

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
    """How the replica's identity (`relay:<host>:<pid>`) ends."""
    return f":{replica.pid}"


async def lock_holder(conn: asyncpg.Connection, key: int) -> tuple[int, str] | None:
    """The backend pid and identity of the session holding lock `key`, as a standby sees it."""
    row = await conn.fetchrow(HOLDER_OF, key)
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
    """b goes silent; its lane moves to a or c, and neither ends the other's session."""
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


# -- what a standby judges, on lease sessions in this process ----------------------------------


def session(dsn: str, identity: str, **lease: float) -> LeaseConnection:
    return LeaseConnection(
        Database(DatabaseConfig(url=dsn), identity), LeaseConfig(**lease), "relay", identity
    )


async def claim(lease: Lease) -> None:
    assert await lease.try_acquire()
    async with lease.statement() as conn:
        await Store("relay").claim(conn, lease.outbox, lease.identity, 0, lease.key)


@contextlib.asynccontextmanager
async def login_role(database: str, pg_admin_dsn: str, prefix: str) -> AsyncIterator[str]:
    """A DSN of the test's database for a new role of its own (no superuser), dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    async with connect(pg_admin_dsn) as admin:
        await admin.execute(f"CREATE ROLE {name} LOGIN")
    try:
        yield postgres.as_role(database, name)
    finally:
        async with connect(database) as conn:
            await conn.execute(f"DROP OWNED BY {name}")
        async with connect(pg_admin_dsn) as admin:
            await admin.execute(f"DROP ROLE {name}")


@pytest.fixture
async def unseeing(database: str, pg_admin_dsn: str) -> AsyncIterator[str]:
    """A DSN of the test's database for a role that may read the checkpoints, but not see
    other roles' sessions (no pg_read_all_stats): their last statement is hidden from it."""
    async with login_role(database, pg_admin_dsn, "standby") as dsn:
        yield dsn


async def test_the_lock_key_computed_in_sql_is_the_relays(database: str) -> None:
    names = [("relay", "loans/0"), ("blue", "loans"), ("relay", "prêts/17"), ("n", "x" * 200)]
    async with connect(database) as conn:
        for namespace, lane in names:
            sql = f"SELECT {lane_key('$1::text', '$2::text')}"
            assert await conn.fetchval(sql, namespace, lane) == lock_key(namespace, lane), lane


async def test_a_holder_is_judged_by_its_own_heartbeats_not_by_the_previous_holders(
    database: str, nats_url: str, tmp_path: Path, unseeing: str
) -> None:
    """A replica holds loans/0 (claimed, stamped now) and has just taken loans/1, whose row
    still bears the heartbeat its previous holder stamped an hour ago. A standby that cannot
    see the replica's session (another role, no pg_read_all_stats) judges it by its stamps."""
    await load_and_migrate(tmp_path, config_dict(database, nats_url, unique_name("t")))
    gone = session(database, "relay:test:gone")
    await claim(Lease(gone, "loans/1"))
    await gone.close()
    async with connect(database) as conn:
        await conn.execute(
            "UPDATE relay.checkpoints SET heartbeat = now() - interval '1 hour'"
            " WHERE outbox = 'loans/1'"
        )
        role = urlsplit(unseeing).username
        await conn.execute(f"GRANT USAGE ON SCHEMA relay TO {role}")
        await conn.execute(f"GRANT SELECT ON relay.checkpoints, relay.replicas TO {role}")
    holder = session(database, "relay:test:holder")
    standby = session(unseeing, "relay:test:standby")
    try:
        await claim(Lease(holder, "loans/0"))
        assert await Lease(holder, "loans/1").try_acquire()  # not claimed: the row says 'gone'
        keys = [lock_key("relay", lane) for lane in ("loans/0", "loans/1")]
        seen = await standby.holders(keys, ["loans/0", "loans/1"])
        async with standby.statement() as conn:
            hidden = await conn.fetchval(
                "SELECT state_change IS NULL FROM pg_stat_activity WHERE pid = $1",
                seen[keys[1]].pid,
            )
        print(f"as the standby sees them: {seen}")
        assert hidden, "the standby sees the holder's session: the stamps are not what it judged"
        assert {h.identity for h in seen.values()} == {"relay:test:holder"}
        age = seen[keys[1]].heartbeat_age
        assert age is not None and age < 60, f"judged by the previous holder's heartbeat: {age}"
    finally:
        await standby.close()
        await holder.close()


async def test_a_holder_silent_before_its_claim_is_taken_over_all_the_same(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """It took the lock, then said nothing (no claim, so no stamp of its own): its silence
    counts from its last statement, and the standby ends it once `takeover_after` passed."""
    await load_and_migrate(tmp_path, config_dict(database, nats_url, unique_name("t")))
    before = session(database, "relay:test:before")
    await claim(Lease(before, "loans/0"))
    await before.close()  # its heartbeat is fresh: the silence is the new holder's own
    silent = session(database, "relay:test:silent")
    standby = session(
        database, "relay:test:standby", takeover_after=1.0, check_interval=0.3, check_timeout=0.3
    )
    lease = Lease(standby, "loans/0")
    try:
        assert await Lease(silent, "loans/0").try_acquire()
        await ended_as_silent(lease, "relay:test:silent", after=1.0)
    finally:
        await standby.close()
        await silent.close()


async def test_a_holder_silent_before_the_first_claim_of_a_new_outbox_is_ended_all_the_same(
    database: str, nats_url: str, tmp_path: Path, pg_admin_dsn: str, unseeing: str
) -> None:
    """A new outbox: no checkpoint row, so no heartbeat to judge; the holder (a role of its
    own) took the lock after its membership beat and said nothing since; the standby cannot
    see its session (no pg_read_all_stats), so not its last statement either. Its silence
    counts from its last beat, and the standby (pg_signal_backend) ends it."""
    await load_and_migrate(tmp_path, config_dict(database, nats_url, unique_name("t")))
    async with login_role(database, pg_admin_dsn, "holder") as holding, connect(database) as conn:
        holder_role, standby_role = urlsplit(holding).username, urlsplit(unseeing).username
        await conn.execute(f"GRANT USAGE ON SCHEMA relay TO {holder_role}, {standby_role}")
        await conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON relay.replicas TO {holder_role}"
        )
        await conn.execute(f"GRANT SELECT ON relay.checkpoints, relay.replicas TO {standby_role}")
        await conn.execute(f"GRANT pg_signal_backend TO {standby_role}")
        assert await conn.fetchval("SELECT count(*) FROM relay.checkpoints") == 0
        silent = session(holding, "relay:test:silent")
        standby = session(
            unseeing,
            "relay:test:standby",
            takeover_after=1.0,
            check_interval=0.3,
            check_timeout=0.3,
        )
        lease = Lease(standby, "loans/0")
        try:
            async with silent.statement() as beating:  # as a replica's pass: beat, then take
                await Membership("relay", "relay", "relay:test:silent", {"loans": 1}).beat(
                    beating, 5.0
                )
            assert await Lease(silent, "loans/0").try_acquire()
            async with standby.statement() as looking:
                hidden = await looking.fetchval(
                    "SELECT state_change IS NULL FROM pg_stat_activity WHERE pid = $1",
                    silent.conn and silent.conn.get_server_pid(),
                )
            assert hidden, "the standby sees the holder's session: its membership is not judged"
            await ended_as_silent(lease, "relay:test:silent", after=1.0)
        finally:
            await standby.close()
            await silent.close()


async def ended_as_silent(lease: Lease, identity: str, after: float) -> Holder:
    """Look at the lane's holder as a standby does until it ends it as silent; check it was
    `identity`, silent for `after` seconds at least, and that its lock is then free."""
    taken: list[Holder] = []

    async def taken_over() -> bool:
        holder = await lease.holder()
        assert holder is not None and holder.identity == identity, holder
        ended = await lease.take_over_if_silent(holder)
        taken.extend([ended] if ended else [])
        return bool(taken)

    await eventually(taken_over, timeout=10)
    print(f"ended after {taken[0].heartbeat_age:.2f}s of silence")
    assert taken[0].heartbeat_age is not None and taken[0].heartbeat_age >= after

    async def freed() -> bool:
        return await lease.holder() is None

    await eventually(freed, timeout=10)
    return taken[0]
