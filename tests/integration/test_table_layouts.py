"""Odd table layouts and odd writers: nothing committed may be lost.

Writers that insert into a partition or an inheritance child directly, transactions
prepared for two-phase commit, a sequence reset under the relay's feet, and a writer
in flight when the relay first starts at the end of the log. Each test drives real
writer transactions against real Postgres and checks the stream as a consumer would.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from relay.cli.operator import Operator, ReplayFrom
from relay.postgres.command_queue import CommandKind
from relay.runtime.runner import Relay
from tests.support import postgres
from tests.support.db import append, connect
from tests.support.jetstream import Received, create_stream, delete_stream, fetch_all, unique_name
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, status

LENT = "BookLent"

_COLUMNS = """
  aggregate_type text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL,
  type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
  created_at timestamptz NOT NULL DEFAULT now()
"""

LAYOUTS = {
    # Partitioned by time, not by position: the writers insert into the partition itself.
    "partition": f"""
        CREATE TABLE events (position bigserial, {_COLUMNS}) PARTITION BY RANGE (created_at);
        CREATE TABLE events_old PARTITION OF events FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
        CREATE TABLE events_new PARTITION OF events FOR VALUES FROM ('2000-01-01') TO (MAXVALUE);
    """,
    "inheritance": f"""
        CREATE TABLE events (position bigserial PRIMARY KEY, {_COLUMNS});
        CREATE TABLE events_new () INHERITS (events);
    """,
    # The partition the writers use is created while the relay is already running.
    "partition attached later": f"""
        CREATE TABLE events (position bigserial, {_COLUMNS}) PARTITION BY RANGE (created_at);
        CREATE TABLE events_old PARTITION OF events FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
    """,
}
LATE_PARTITION = (
    "CREATE TABLE events_new PARTITION OF events FOR VALUES FROM ('2000-01-01') TO (MAXVALUE)"
)


def lent(loan: str) -> dict[str, str]:
    return {"loanId": loan, "memberId": "m-1"}


def ids(messages: list[Received]) -> list[str]:
    return [m.headers["Nats-Msg-Id"] for m in messages]


def inversions(messages: list[Received]) -> list[str]:
    """`id after id` wherever an aggregate's version did not increase."""
    last: dict[str, int] = {}
    out = []
    for message_id in ids(messages):
        aggregate, _, version = message_id.rpartition("@")
        if int(version) <= last.get(aggregate, 0):
            out.append(f"{message_id} after {aggregate}@{last[aggregate]}")
        last[aggregate] = int(version)
    return out


async def stream_for(nats_url: str) -> str:
    name = unique_name("layouts")
    await create_stream(nats_url, name, [f"{name}.>"])
    return name


async def _direct_writer(dsn: str, writer: int, until: float, committed: list[str]) -> None:
    """BEGIN; INSERT INTO events_new ...; sleep 0-80 ms; COMMIT; until `until`."""
    rng = random.Random(writer)
    version = 0
    async with connect(dsn) as conn:
        while time.monotonic() < until:
            version += 1
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO events_new (aggregate_type, aggregate_id, version, type, payload)"
                    " VALUES ('book', $1, $2, 'BookLent', $3::jsonb)",
                    f"w{writer}",
                    version,
                    '{"loanId": "L", "memberId": "m"}',
                )
                await asyncio.sleep(rng.uniform(0, 0.08))
            committed.append(f"book/w{writer}@{version}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_writers_inserting_into_a_child_table_lose_nothing(
    layout: str, database: str, nats_url: str, tmp_path: Path
) -> None:
    """Six writers insert into a partition (or inheritance child) itself, never the parent."""
    subject = await stream_for(nats_url)
    async with connect(database) as conn:
        await conn.execute(LAYOUTS[layout])
    config = await load_and_migrate(tmp_path, config_dict(database, nats_url, subject))
    committed: list[str] = []
    try:
        async with running(config):
            if layout == "partition attached later":
                async with connect(database) as conn:
                    await conn.execute(LATE_PARTITION)
            until = time.monotonic() + 4.0
            await asyncio.gather(*(_direct_writer(database, w, until, committed) for w in range(6)))
            received = await fetch_all(nats_url, subject, expected=len(committed), timeout=30)
        assert len(committed) > 100
        missing = sorted(set(committed) - set(ids(received)))
        assert missing == [], f"{len(missing)} of {len(committed)} committed events lost"
        assert inversions(received) == []
    finally:
        await delete_stream(nats_url, subject)


async def _prepared(dsn: str, gid: str, aggregate_id: str) -> int:
    """Append one event in a transaction prepared for two-phase commit; return its position."""
    async with connect(dsn) as conn:
        await conn.execute("BEGIN")
        position = await append(conn, "book", aggregate_id, 1, LENT, lent(gid))
        await conn.execute(f"PREPARE TRANSACTION '{gid}'")
    return position


async def _finish_prepared(dsn: str, gid: str, verb: str = "COMMIT") -> None:
    async with connect(dsn) as conn:
        if await conn.fetchval("SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1", gid):
            await conn.execute(f"{verb} PREPARED '{gid}'")


@pytest.mark.parametrize("prepared_first", [False, True], ids=["relay-first", "prepared-first"])
async def test_prepared_transaction_is_waited_for_and_published(
    prepared_first: bool, private_database: str, nats_url: str, tmp_path: Path
) -> None:
    """b2 is prepared (2PC) with position 2; b3 commits; COMMIT PREPARED: b2 still goes out."""
    dsn = private_database
    postgres.run_sql_file(dsn)
    subject = await stream_for(nats_url)
    data = config_dict(dsn, nats_url, subject)
    data["source"]["poll_interval"] = "200ms"
    config = await load_and_migrate(tmp_path, data)
    try:
        async with connect(dsn) as conn:
            await append(conn, "book", "b1", 1, LENT, lent("b1"))
            if prepared_first:
                b2 = await _prepared(dsn, "tx2", "b2")
            async with running(config) as relay:
                if not prepared_first:
                    await fetch_all(nats_url, subject, expected=1)
                    b2 = await _prepared(dsn, "tx2", "b2")
                b3 = await append(conn, "book", "b3", 1, LENT, lent("b3"))
                assert b2 < b3

                async def named() -> bool:
                    blocking = (await status(config))[0]["blocking_transaction"]
                    return bool(blocking) and blocking.get("gid") == "tx2"

                await eventually(named, timeout=10)
                blocking = (await status(config))[0]["blocking_transaction"]
                assert blocking["owner"] == "postgres"
                assert blocking["age_seconds"] >= 0
                assert "prepared transaction 'tx2'" in (relay.states["loans"].blocked_by or "")
                # b3 is held back behind the prepared transaction (and so is b1 when the
                # transaction was prepared first: the barrier waits before reading up to L).
                held = ["book/b1@1"] if not prepared_first else []
                assert ids(await fetch_all(nats_url, subject)) == held
                assert (await status(config))[0]["checkpoint"] < b2
                await _finish_prepared(dsn, "tx2")
                received = await fetch_all(nats_url, subject, expected=3)
        assert ids(received) == ["book/b1@1", "book/b2@1", "book/b3@1"]
    finally:
        await _finish_prepared(dsn, "tx2", "ROLLBACK")
        await delete_stream(nats_url, subject)


async def test_rolled_back_prepared_transaction_releases_the_barrier(
    private_database: str, nats_url: str, tmp_path: Path
) -> None:
    dsn = private_database
    postgres.run_sql_file(dsn)
    subject = await stream_for(nats_url)
    config = await load_and_migrate(tmp_path, config_dict(dsn, nats_url, subject))
    try:
        async with connect(dsn) as conn, running(config):
            await _prepared(dsn, "tx-abort", "gone")
            await append(conn, "book", "kept", 1, LENT, lent("kept"))
            await asyncio.sleep(0.5)  # a duration: the relay must hold b-kept back meanwhile
            assert await fetch_all(nats_url, subject) == []
            await _finish_prepared(dsn, "tx-abort", "ROLLBACK")
            received = await fetch_all(nats_url, subject, expected=1)
        assert ids(received) == ["book/kept@1"]
    finally:
        await _finish_prepared(dsn, "tx-abort", "ROLLBACK")
        await delete_stream(nats_url, subject)


def _halted_gauge(relay: Relay) -> float | None:
    return relay.metrics.registry.get_sample_value("relay_outbox_halted", {"outbox": "loans"})


async def test_reset_sequence_halts_the_outbox_loudly_until_replayed(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """TRUNCATE ... RESTART IDENTITY puts the head below the checkpoint: stop, say so, wait."""
    subject = await stream_for(nats_url)
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as conn:
            for version in range(1, 11):
                await append(conn, "book", "before", version, LENT, lent(f"v{version}"))
            async with running(config) as relay:
                await fetch_all(nats_url, subject, expected=10)
                await conn.execute("TRUNCATE events RESTART IDENTITY")
                for version in range(1, 6):
                    await append(conn, "book", "after", version, LENT, lent(f"a{version}"))

                async def halted() -> bool:
                    return bool((await status(config))[0]["state"] == "halted")

                await eventually(halted, timeout=10)
                row = (await status(config))[0]
                assert row["checkpoint"] == 10 and row["head"] == 5
                assert "relay replay loans --from-start" in row["last_error"]
                assert _halted_gauge(relay) == 1
                assert relay.states["loans"].activity == "halted"
            # Still halted after a restart, although nothing changed in the table.
            async with running(config) as relay:
                await eventually(halted, timeout=10)
                await asyncio.sleep(0.5)  # a duration: nothing may be published meanwhile
                assert len(await fetch_all(nats_url, subject)) == 10
                controller = Operator(config, "loans", "test-operator")
                target, _ = await controller.replay_target(ReplayFrom(start=True))
                outcome = await controller.run(CommandKind.REPLAY, {"to": target}, 10)
                assert outcome.ok, outcome.detail
                received = await fetch_all(nats_url, subject, expected=15)

                async def relaying() -> bool:
                    return bool((await status(config))[0]["state"] == "relaying")

                await eventually(relaying, timeout=10)
                assert _halted_gauge(relay) == 0
        assert ids(received)[10:] == [f"book/after@{v}" for v in range(1, 6)]
    finally:
        await delete_stream(nats_url, subject)


@pytest.mark.parametrize("savepoint", [False, True], ids=["plain", "in-a-savepoint"])
async def test_start_end_publishes_a_transaction_open_at_the_start(
    savepoint: bool, events_table: str, pg_admin_dsn: str, nats_url: str, tmp_path: Path
) -> None:
    """`start: end` skips what was committed before the first start, never what commits after.

    An old transaction in another database of the cluster must not make it publish the
    events committed before the start either.
    """
    subject = await stream_for(nats_url)
    data = config_dict(events_table, nats_url, subject, start="end")
    config = await load_and_migrate(tmp_path, data)
    try:
        async with (
            connect(events_table) as conn,
            connect(events_table) as writer,
            connect(pg_admin_dsn) as elsewhere,
        ):
            old_tx = elsewhere.transaction()
            await old_tx.start()
            await elsewhere.fetchval("SELECT pg_current_xact_id()")  # an old xid, elsewhere
            await append(conn, "book", "old-1", 1, LENT, lent("old-1"))
            await append(conn, "book", "old-2", 1, LENT, lent("old-2"))
            tx = writer.transaction()
            await tx.start()
            if savepoint:  # the row's xmin is a subtransaction's xid, not the top-level one
                await writer.execute("SAVEPOINT s")
            await append(writer, "book", "in-flight", 1, LENT, lent("in-flight"))
            if savepoint:
                await writer.execute("RELEASE SAVEPOINT s")
            pid = await writer.fetchval("SELECT pg_backend_pid()")
            async with running(config):

                async def waiting_for_it() -> bool:
                    blocking = (await status(config))[0]["blocking_transaction"]
                    return bool(blocking) and blocking.get("pid") == pid

                await eventually(waiting_for_it, timeout=10)
                await tx.commit()  # commits after the relay said it started
                await append(conn, "book", "new", 1, LENT, lent("new"))
                received = await fetch_all(nats_url, subject, expected=2)
            await old_tx.rollback()
        got = ids(received)
        assert "book/in-flight@1" in got and "book/new@1" in got
        assert "book/old-1@1" not in got and "book/old-2@1" not in got
        assert got.index("book/in-flight@1") < got.index("book/new@1")
    finally:
        await delete_stream(nats_url, subject)


async def test_start_end_survives_a_crash_before_the_open_transaction_ends(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """The starting point is settled in the checkpoint row, not in memory."""
    subject = await stream_for(nats_url)
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, subject, start="end")
    )
    try:
        async with connect(events_table) as conn, connect(events_table) as writer:
            await append(conn, "book", "old", 1, LENT, lent("old"))
            tx = writer.transaction()
            await tx.start()
            await append(writer, "book", "in-flight", 1, LENT, lent("in-flight"))
            async with running(config):

                async def claimed() -> bool:
                    return (await status(config))[0]["checkpoint"] is not None

                await eventually(claimed)
            await tx.commit()  # while no relay runs
            async with running(config):
                received = await fetch_all(nats_url, subject, expected=1)
        assert ids(received) == ["book/in-flight@1"]
    finally:
        await delete_stream(nats_url, subject)


# Column types an application may choose for its names: an enum of event types, a uuid
# aggregate id, a varchar aggregate type and a domain over text. The relay reads them as text.
ODD_TYPES = """
    CREATE TYPE event_kind AS ENUM ('BookLent', 'BookReturned');
    CREATE DOMAIN aggregate_name AS varchar(40) CHECK (VALUE <> '');
    CREATE TABLE events (
      position bigserial PRIMARY KEY, aggregate_type aggregate_name NOT NULL,
      aggregate_id uuid NOT NULL, version bigint NOT NULL, type event_kind NOT NULL,
      payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
      created_at timestamptz NOT NULL DEFAULT now()
    );
"""


@pytest.mark.parametrize("partitions", [1, 2], ids=["one lane", "split"])
async def test_names_held_in_enum_uuid_and_domain_columns_are_relayed_and_checked(
    partitions: int, private_database: str, nats_url: str, tmp_path: Path
) -> None:
    """`relay check --history` passed such a table while `relay run` failed every read (an
    enum compared with text) and exited, again on every restart."""
    dsn = private_database
    async with connect(dsn) as conn:
        await conn.execute(ODD_TYPES)
    subject = await stream_for(nats_url)
    data = config_dict(dsn, nats_url, subject, partitions=partitions)
    config = await load_and_migrate(tmp_path, data)
    books = [f"00000000-0000-0000-0000-00000000000{n}" for n in range(1, 6)]
    try:
        async with connect(dsn) as conn:
            for book in books:
                await append(conn, "book", book, 1, LENT, lent(book))
        file = str(tmp_path / "relay.yaml")
        checked = run_cli(["check", "--history", "--config", file, "--json"])
        assert checked.returncode == 0, checked.stdout + checked.stderr
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=len(books), timeout=30)
            assert sorted(ids(received)) == sorted(f"book/{b}@1" for b in books)
        audited = run_cli(["audit", "loans", "--from-start", "--config", file, "--json"])
        assert audited.returncode == 0, audited.stdout + audited.stderr
        assert json.loads(audited.stdout)["found"] == len(books)
    finally:
        await delete_stream(nats_url, subject)
