"""The change lock of an outbox's partition count, held by a session that went silent.

Whoever changes an outbox's count (`relay repartition`, or a replica changing the outbox
over) takes its change lock first. A black-box attack cut `relay repartition` off just after
it had taken it, behind a proxy that kept its session open: replicas configured with the new
count waited for the lock for good ("standby only", nobody named), and `relay repartition`
run again refused, naming the dead command's session. No one judged the change lock's
holder, as a standby judges a lane's. Now a replica waiting to change the outbox over, and
`relay repartition`, end a holder of any lock the change needs that has been silent for
`takeover_after`, as a standby ends a lane's silent holder.

The silent holder here is a session of the test's that takes the lock and says nothing
more, as the cut-off command's session did.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import pytest

from relay.config import LeaseConfig
from relay.postgres.lease import lock_key
from tests.support.db import connect
from tests.support.delivery import append_backlog
from tests.support.lanes import delivered, shape, until
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, eventually, migrate_cli, save

pytestmark = pytest.mark.timeout(120)

Start = Callable[..., RelayProcess]
LEASE = {"check_interval": "500ms", "check_timeout": "500ms", "takeover_after": "2s"}
CHANGE_LOCK = lock_key(LeaseConfig().namespace, "loans#partitions")


def configs(tmp_path: Path, dsn: str, nats_url: str, stream: str) -> tuple[Path, Path]:
    """The outbox with 1 partition, and with 2."""
    paths = []
    for count in (1, 2):
        data = config_dict(dsn, nats_url, stream, partitions=count)
        data["lease"] = LEASE
        paths.append(save(tmp_path, data, f"k{count}.yaml"))
    return paths[0], paths[1]


async def recorded_with_one(config: Path, relay_process: Start) -> None:
    """The outbox runs with 1 partition: a replica claims it, then stops."""
    replica = relay_process(["run", "--config", str(config)])
    await until(config, lambda rows: shape(rows) == [1])
    replica.terminate()
    assert await replica.wait_async() == 0


@contextlib.asynccontextmanager
async def _holding(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A session named as a cut-off `relay repartition`'s that holds the change lock."""
    conn = await asyncpg.connect(dsn, server_settings={"application_name": "relay:gone:1:lease"})
    try:
        assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", CHANGE_LOCK)
        yield conn
    finally:
        conn.terminate()


async def ended(conn: asyncpg.Connection) -> bool:
    try:
        await conn.fetchval("SELECT 1")
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        return True
    return False


@pytest.fixture
async def two(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> Path:
    """The config with 2 partitions, of an outbox recorded with 1."""
    one, two = configs(tmp_path, events_table, nats_url, stream)
    migrate_cli(one)
    await recorded_with_one(one, relay_process)
    return two


async def test_replicas_changing_the_count_end_a_silent_holder_of_the_change_lock(
    events_table: str, nats_url: str, stream: str, two: Path, relay_process: Start
) -> None:
    async with _holding(events_table) as holder:
        replica = relay_process(["run", "--config", str(two)])
        first = await append_backlog(events_table, 40, aggregates=8)
        await delivered(nats_url, stream, set(first.values()))
        assert await ended(holder)
    said = [r for r in replica.logs() if r.get("event") == "silent holder's session terminated"]
    assert [r["holder"] for r in said] == ["relay:gone:1"]
    await until(two, lambda rows: len(rows) == 2 and shape(rows) == [2])


async def test_repartition_ends_a_silent_holder_of_the_change_lock_and_goes_on(
    events_table: str, nats_url: str, stream: str, two: Path, relay_process: Start
) -> None:
    async with _holding(events_table) as holder:
        fresh = run_cli(["repartition", "loans", "--partitions", "2", "--config", str(two)])
        assert "held by relay:gone:1" in fresh.stderr  # not silent for takeover_after yet
        assert fresh.returncode != 0

        async def silent_long_enough() -> bool:
            async with connect(events_table) as conn:
                age = await conn.fetchval(
                    "SELECT extract(epoch FROM now() - state_change) FROM pg_stat_activity"
                    " WHERE application_name = 'relay:gone:1:lease'"
                )
            return age is not None and age > 2.0

        await eventually(silent_long_enough, timeout=10)
        done = run_cli(["repartition", "loans", "--partitions", "2", "--config", str(two)])
        assert done.returncode == 0, done.stderr
        assert await ended(holder)
    relay_process(["run", "--config", str(two)])
    first = await append_backlog(events_table, 40, aggregates=8)
    await delivered(nats_url, stream, set(first.values()))


async def test_a_change_at_work_is_never_judged_silent_however_long_it_waits(
    events_table: str, nats_url: str, stream: str, two: Path, relay_process: Start
) -> None:
    """A `relay repartition` blocked on a lock inside its transaction (here the parked
    messages' table, as moving many of them would take long) is at work: judged by the start
    of its statement, it was ended as silent 2 s in, and then the replicas ended each other
    as each took the change lock and waited in turn (a black-box attack)."""
    async with connect(events_table) as blocker:
        held = blocker.transaction()
        await held.start()
        await blocker.execute("LOCK TABLE relay.parked IN ACCESS EXCLUSIVE MODE")
        cli = relay_process(["repartition", "loans", "--partitions", "2", "--config", str(two)])
        try:
            since = await _waiting_on_a_lock(events_table, cli.pid)
            replica = relay_process(["run", "--config", str(two)])

            async def the_replica_looked_past_takeover_after() -> bool:
                if cli.returncode is not None:
                    return True  # ended (judged silent), or done: judged below
                async with connect(events_table) as conn:
                    return bool(
                        await conn.fetchval(
                            "SELECT seen_at > $1::timestamptz + interval '3 seconds'"
                            " FROM relay.replicas WHERE identity LIKE '%:' || $2",
                            since,
                            str(replica.pid),
                        )
                    )

            await eventually(the_replica_looked_past_takeover_after, timeout=30)
        finally:
            await held.rollback()
        assert await cli.wait_async() == 0, "the repartition went on to the end"
    said = [r for r in replica.logs() if r.get("event") == "silent holder's session terminated"]
    assert said == [], said
    first = await append_backlog(events_table, 40, aggregates=8)
    await delivered(nats_url, stream, set(first.values()))


async def _waiting_on_a_lock(dsn: str, pid: int) -> object:
    """When the process `pid`'s lease session began waiting on a lock (database clock)."""
    found: list[object] = []

    async def waiting() -> bool:
        async with connect(dsn) as conn:
            found[:] = [
                await conn.fetchval(
                    "SELECT state_change FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND application_name LIKE '%:' || $1 || ':lease'",
                    str(pid),
                )
            ]
        return found[0] is not None

    await eventually(waiting, timeout=30)
    return found[0]
