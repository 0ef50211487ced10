"""One replica proves the leases of many lanes on its one lease connection, under load.

With `partitions: 64` a replica claims 64 lanes at start-up on its lease connection and
then writes their checkpoints there, beside the proofs of the leases. A proof that had
to wait for all of that timed out (`check_timeout`, 1 s by default), the session was
dropped, and the replica lost every lane at once, again and again. The replica test
checks what an operator sees: every lane held by `relay status`, no 'lease lost' line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from relay.config import DatabaseConfig, LeaseConfig
from relay.postgres.database import Database
from relay.postgres.lease import Lease, LeaseConnection, LeaseLost
from relay.postgres.store import Store
from tests.support.db import connect
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.lanes import MESSAGES, status
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, load_and_migrate, migrate_cli, save

Start = Callable[..., RelayProcess]
LANES = 64
# Two writers flooding the table: enough for a replica without the fix to lose every lane
# within seconds of the start (3 runs in 3), and little enough that the machine's two cores
# still leave the replica's event loop the time to read its proofs' answers (6 in 6).
WRITERS = 2
IDENTITY = "relay:test:proofs"
# Whether any session holds advisory lock $1 (a bigint key shows as classid, objid).
LOCK_HELD = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND ((classid::bigint << 32) | objid::bigint) = $1::bigint)"
)


@contextlib.asynccontextmanager
async def flood(dsn: str, writers: int) -> AsyncIterator[list[int]]:
    """Writers appending 20 events per statement as fast as Postgres takes them: the load.

    Yields how many events they appended so far (one counter, in a list).
    """
    stop, appended = asyncio.Event(), [0]

    async def write(writer: int) -> None:
        async with connect(dsn) as conn:
            n = 0
            while not stop.is_set():
                rows = [(f"w{writer}-{n}-{i}", json.dumps({"loanId": f"L{i}"})) for i in range(20)]
                await conn.executemany(
                    "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
                    " VALUES ('book', $1, 1, 'BookLent', $2::jsonb)",
                    rows,
                )
                appended[0] += len(rows)
                n += 1

    tasks = [asyncio.create_task(write(w)) for w in range(writers)]
    try:
        yield appended
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def lost(replica: RelayProcess) -> list[dict[str, Any]]:
    """The replica's 'lease lost' log lines."""
    return [r for r in replica.logs() if str(r.get("event", "")).startswith("lease lost")]


async def head(dsn: str) -> int:
    async with connect(dsn) as conn:
        return int(await conn.fetchval("SELECT coalesce(max(position), 0) FROM events"))


async def test_a_replica_keeps_all_64_lanes_through_start_up_under_load(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    """Default lease and source settings. Writers flood the table from before the start
    until every lane has caught up with what was written while the lanes were claimed."""
    stream = unique_name("k64")
    data = config_dict(events_table, nats_url, stream, messages=MESSAGES, partitions=LANES)
    data["source"] = {}  # the defaults: poll_interval 1 s
    data["logging"] = {"level": "info", "format": "json"}
    config = save(tmp_path, data, "k64.yaml")
    migrate_cli(config)
    await create_stream(nats_url, stream, [f"{stream}.>"])
    try:
        async with flood(events_table, WRITERS) as appended:
            await eventually(lambda: appended[0] >= 20_000, timeout=60)
            replica = relay_process(["run", "--config", str(config)])

            async def all_held() -> bool:
                rows = await status(config)
                return len(rows) == LANES and all(row["holder"] for row in rows)

            await eventually(all_held, timeout=60, interval=0.5)
            mark = await head(events_table)

            async def caught_up_or_lost() -> bool:
                rows = await status(config)
                return bool(lost(replica)) or all((r["checkpoint"] or 0) >= mark for r in rows)

            await eventually(caught_up_or_lost, timeout=120, interval=0.5)
        rows = await status(config)
    finally:
        await delete_stream(nats_url, stream)
    assert lost(replica) == [], f"{len(lost(replica))} 'lease lost' lines: {lost(replica)[:1]}"
    holders = {row["holder"] for row in rows}
    assert len(rows) == LANES and len(holders) == 1 and None not in holders


@dataclass
class Claimed:
    """A lease session holding and claiming some lanes, as a replica's would."""

    session: LeaseConnection
    leases: list[Lease]
    epochs: dict[str, int]

    def watch(self) -> list[asyncio.Task[str]]:
        return [asyncio.create_task(x.watch(self.epochs[x.outbox])) for x in self.leases]


@contextlib.asynccontextmanager
async def claimed(
    dsn: str, tmp_path: Path, nats_url: str, lanes: list[str], **lease: float
) -> AsyncIterator[Claimed]:
    await load_and_migrate(tmp_path, config_dict(dsn, nats_url, unique_name("p")))
    db = Database(DatabaseConfig(url=dsn), IDENTITY)
    session = LeaseConnection(db, LeaseConfig(**lease), "relay", IDENTITY)
    held = [Lease(session, lane) for lane in lanes]
    try:
        epochs = {}
        for lane in held:
            assert await lane.try_acquire()
            async with lane.statement() as conn:
                claim = await Store("relay").claim(conn, lane.outbox, IDENTITY, 0, lane.key)
            epochs[lane.outbox] = claim.epoch
        yield Claimed(session, held, epochs)
    finally:
        await session.close()


async def heartbeat(dsn: str, lane: str) -> datetime:
    async with connect(dsn) as conn:
        sql = "SELECT heartbeat FROM relay.checkpoints WHERE outbox = $1"
        value: datetime = await conn.fetchval(sql, lane)
        return value


async def stopped(tasks: list[asyncio.Task[str]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_proof_does_not_wait_for_the_statements_queued_on_the_lease_connection(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """Ten statements of 0.3 s each queue for the connection (3 s, three check_timeouts):
    the lease is proven in time all the same, between two of them."""
    async with claimed(database, tmp_path, nats_url, ["loans"]) as held:
        watching = held.watch()

        async def slow_write() -> None:
            async with held.leases[0].statement() as conn:
                await conn.execute("SELECT pg_sleep(0.3)")

        before = await heartbeat(database, "loans")
        await asyncio.gather(*(slow_write() for _ in range(10)))
        assert not watching[0].done(), watching[0].result()
        assert await heartbeat(database, "loans") > before
        assert not held.session.connection_lost()
        await stopped(watching)


async def test_a_lane_claimed_by_another_replica_since_is_lost_alone(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """Its epoch moved on: that lane stops; the session, and the other lane, go on."""
    lanes = ["loans/0", "loans/1"]
    async with claimed(database, tmp_path, nats_url, lanes, check_interval=0.2) as held:
        watching = held.watch()
        async with connect(database) as conn:
            await conn.execute(
                "UPDATE relay.checkpoints SET epoch = epoch + 1 WHERE outbox = $1", lanes[0]
            )
        reason = await asyncio.wait_for(watching[0], 10)
        assert reason == "lease check: this connection no longer holds the lock or the epoch"
        before = await heartbeat(database, lanes[1])

        async def proven_again() -> bool:
            return await heartbeat(database, lanes[1]) > before

        await eventually(proven_again)
        assert not watching[1].done()
        assert held.leases[1].held and not held.session.connection_lost()
        await stopped(watching)


async def test_a_lost_lease_session_loses_every_lane_on_it(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """The proof fails on the ended session, or finds a new one holding nothing (if the
    client saw the close first and reconnected): every lane stops either way."""
    lanes = ["loans/0", "loans/1", "loans/2"]
    async with claimed(database, tmp_path, nats_url, lanes, check_interval=0.2) as held:
        watching = held.watch()
        async with held.leases[0].statement() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
        async with connect(database) as conn:
            await conn.execute("SELECT pg_terminate_backend($1)", pid)
        reasons = await asyncio.wait_for(asyncio.gather(*watching), 10)
        assert all(r.startswith("lease check") for r in reasons), reasons
        assert len(set(reasons)) == 1, "one proof for all three"
        assert not any(lease.held for lease in held.leases)


# Holds the lane's checkpoint row for `hold` seconds from another process, so that a proof
# sent meanwhile waits for it at the server, then is answered at once.
ROW_HOLDER = """
import asyncio, sys, asyncpg
async def main() -> None:
    conn = await asyncpg.connect(sys.argv[1])
    async with conn.transaction():
        sql = "SELECT 1 FROM relay.checkpoints WHERE outbox = $1 FOR UPDATE"
        await conn.execute(sql, sys.argv[2])
        print("held", flush=True)
        await asyncio.sleep(float(sys.argv[3]))
    await conn.close()
asyncio.run(main())
"""


async def test_an_answer_in_time_counts_though_the_event_loop_was_busy_at_the_deadline(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """The server answers the proof 0.2 s after it was sent, within check_timeout (1 s),
    but the replica's event loop is busy (a long batch on a loaded machine) until 1.5 s:
    the answer is in the socket when the deadline's timer runs. It proves the lease; it
    used to be taken for a timeout, which dropped the session and every lane on it."""
    async with claimed(database, tmp_path, nats_url, ["loans"]) as held:
        watching = held.watch()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            ROW_HOLDER,
            database,
            "loans",
            "0.2",
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        assert (await process.stdout.readline()).strip() == b"held"
        before = await heartbeat(database, "loans")
        proving = asyncio.create_task(held.session.prove())
        async with connect(database) as watch:

            async def waiting_for_the_row() -> bool:
                waiting = await watch.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND application_name LIKE $1",
                    f"{IDENTITY}%",
                )
                return int(waiting) == 1

            await eventually(waiting_for_the_row)
            time.sleep(1.5)  # noqa: ASYNC251 - the point: the event loop is blocked
        await proving  # raised LeaseLost here before
        assert await process.wait() == 0
        assert await heartbeat(database, "loans") > before
        assert held.leases[0].held and not held.session.connection_lost()
        assert not watching[0].done()
        await stopped(watching)


async def test_a_proof_that_times_out_drops_its_connection_before_a_queued_statement_meets_it(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """The proof waits at the server (its lane's row is held) past check_timeout and is
    cancelled; a checkpoint write queued behind it must get a new connection, never the
    old one half way through the cancelled proof ("another operation is in progress")."""
    async with claimed(database, tmp_path, nats_url, ["loans"]) as held:
        watching = held.watch()
        async with held.leases[0].statement() as conn:
            old_pid = await conn.fetchval("SELECT pg_backend_pid()")
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", ROW_HOLDER, database, "loans", "3"),
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        assert (await process.stdout.readline()).strip() == b"held"
        proving = asyncio.create_task(held.session.prove())
        await asyncio.sleep(0.2)  # the proof holds the connection, waiting at the server

        async def queued() -> int:
            async with held.leases[0].statement() as conn:
                return int(await conn.fetchval("SELECT pg_backend_pid()"))

        pid = await queued()
        with pytest.raises(LeaseLost, match="TimeoutError"):
            await proving
        assert pid != old_pid, "the queued statement ran on a new session"
        assert not held.leases[0].held, "the new session holds nothing"
        assert await process.wait() == 0
        await stopped(watching)


async def test_a_release_cut_off_part_way_leaves_no_lock_behind_on_the_live_session(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """A lane's release waits for the lease connection while another lane's statement runs
    on it, and is cancelled meanwhile (a replica stopping past its grace period, say). The
    lane's lock stayed held on the live session with no lane watching it: the replica's own
    look at the lanes counted it as its own, no standby judged it (the session was alive),
    and the lane went unrelayed for as long as the session lived. Cut off part way, a
    release drops the session, and every lock on it goes with it."""
    async with claimed(database, tmp_path, nats_url, ["loans/0", "loans/1"]) as held:
        watching = held.watch()
        key = held.leases[0].key

        async def busy() -> None:
            async with held.leases[1].statement() as conn:
                await conn.execute("SELECT pg_sleep(1)")

        other = asyncio.create_task(busy())
        await eventually(held.session.lock.locked)
        releasing = asyncio.create_task(held.leases[0].release())
        for _ in range(3):  # it runs up to its wait for the connection
            await asyncio.sleep(0)
        assert not releasing.done()
        releasing.cancel()
        await asyncio.gather(releasing, other, return_exceptions=True)

        async def lock_gone() -> bool:
            async with connect(database) as conn:
                return not await conn.fetchval(LOCK_HELD, key)

        await eventually(lock_gone, timeout=10)
        await stopped(watching)
