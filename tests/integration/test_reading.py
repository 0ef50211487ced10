"""The gap-free read, against real Postgres and NATS JetStream.

Each test drives real writer transactions into the interleavings that make
`position > checkpoint` readers skip or reorder events, and checks on the
stream what a consumer would see.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from pathlib import Path

import asyncpg
import pytest

from relay.config import NOTIFY_CHANNEL_MAX
from relay.core.lane_state import OutboxState
from relay.runtime.runner import Relay
from tests.support.db import append, connect
from tests.support.jetstream import Received, create_stream, delete_stream, fetch_all, unique_name
from tests.support.scenario import (
    config_dict,
    eventually,
    load_and_migrate,
    migrate,
    running,
    status,
)

LENT = "BookLent"


def _state(relay: Relay) -> OutboxState:
    """The outbox's in-process state; a blank one until the relay has started it."""
    return relay.states.get("loans") or OutboxState("loans")


def lent(loan: str) -> dict[str, str]:
    return {"loanId": loan, "memberId": "m-1"}


def ids(messages: list[Received]) -> list[str]:
    return [m.headers["Nats-Msg-Id"] for m in messages]


async def stream_for(nats_url: str) -> str:
    name = unique_name("reading")
    await create_stream(nats_url, name, [f"{name}.>"])
    return name


async def test_late_commit_with_lower_position_is_published(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Writer A takes a lower position and commits after writer B: A's event still goes out."""
    subject = await stream_for(nats_url)
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with (
            connect(events_table) as a,
            connect(events_table) as b,
            running(config) as relay,
        ):
            tx_a = a.transaction()
            await tx_a.start()
            pos_a = await append(a, "book", "book-a", 1, LENT, lent("A"))
            pos_b = await append(b, "book", "book-b", 1, LENT, lent("B"))
            assert pos_a < pos_b
            # B is committed and visible; a naive reader would now move past pos_a.
            pid_a = await a.fetchval("SELECT pg_backend_pid()")
            await eventually(lambda: f"pid {pid_a} " in (_state(relay).blocked_by or ""))
            assert await fetch_all(nats_url, subject) == []  # held back behind A
            await tx_a.commit()
            received = await fetch_all(nats_url, subject, expected=2)
        assert ids(received) == ["book/book-a@1", "book/book-b@1"]
    finally:
        await delete_stream(nats_url, subject)


async def test_xid_inversion_keeps_aggregate_order(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """T1 takes its xid first (another table), T2 appends S@1 and commits, T1 appends S@2.

    Ordering by (xid8, position) would publish S@2 first; the barrier reads in
    position order, so S@1 comes first.
    """
    subject = await stream_for(nats_url)
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as t1, connect(events_table) as t2:
            await t1.execute("CREATE TABLE read_model (id int)")
            async with running(config):
                tx1 = t1.transaction()
                await tx1.start()
                await t1.execute("INSERT INTO read_model VALUES (1)")
                xid1 = await t1.fetchval("SELECT pg_current_xact_id()::text::bigint")
                async with t2.transaction():
                    await append(t2, "book", "S", 1, LENT, lent("first"))
                    xid2 = await t2.fetchval("SELECT pg_current_xact_id()::text::bigint")
                await append(t1, "book", "S", 2, LENT, lent("second"))
                await tx1.commit()
                assert xid1 < xid2  # the inversion really happened
                received = await fetch_all(nats_url, subject, expected=2)
        assert ids(received) == ["book/S@1", "book/S@2"]
        assert [m.json()["loanId"] for m in received] == ["first", "second"]
    finally:
        await delete_stream(nats_url, subject)


async def _writer(dsn: str, seed: int, aggregates: list[str], per_writer: int) -> None:
    """Append to shared aggregates, taking the next version under a row lock as apps do."""
    rng = random.Random(seed)
    async with connect(dsn) as conn:
        done = 0
        while done < per_writer:
            agg = rng.choice(aggregates)
            batch = min(rng.randint(1, 4), per_writer - done)
            try:
                async with conn.transaction():
                    version = await conn.fetchval(
                        "SELECT coalesce(max(version), 0) FROM events"
                        " WHERE aggregate_type = 'book' AND aggregate_id = $1",
                        agg,
                    )
                    for i in range(1, batch + 1):
                        await append(conn, "book", agg, version + i, LENT, lent(f"{seed}-{done}"))
                        if rng.random() < 0.2:
                            await asyncio.sleep(rng.random() / 100)
            except asyncpg.UniqueViolationError:
                continue  # another writer took that version: retry, as an app would
            done += batch


async def test_concurrent_writers_every_event_once_in_order(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = await stream_for(nats_url)
    data = config_dict(events_table, nats_url, subject, batch={"max_messages": 200})
    config = await load_and_migrate(tmp_path, data)
    aggregates = [f"book-{i}" for i in range(12)]
    writers, per_writer = 8, 260
    try:
        async with running(config):
            await asyncio.gather(
                *(_writer(events_table, seed, aggregates, per_writer) for seed in range(writers))
            )
            total = writers * per_writer
            received = await fetch_all(nats_url, subject, expected=total, timeout=60)
        async with connect(events_table) as conn:
            stored = await conn.fetch("SELECT aggregate_id, version FROM events ORDER BY position")
        assert len(stored) == total
        got = ids(received)
        assert len(got) == len(set(got)) == total, "every event exactly once"
        assert set(got) == {f"book/{r['aggregate_id']}@{r['version']}" for r in stored}
        versions: dict[str, list[int]] = defaultdict(list)
        for message in received:
            body = message.json()
            versions[body["bookId"]].append(body["version"])
        for agg, seen in versions.items():
            assert seen == sorted(seen) and len(seen) == len(set(seen)), f"{agg} out of order"
    finally:
        await delete_stream(nats_url, subject)


async def test_idle_in_transaction_session_holds_relay_back_and_is_named(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = await stream_for(nats_url)
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        dsn = events_table
        blocker = await asyncpg.connect(dsn, server_settings={"application_name": "billing-job"})
        try:
            async with connect(dsn) as other, running(config) as relay:
                tx = blocker.transaction()
                await tx.start()
                await append(blocker, "book", "held", 1, LENT, lent("held"))
                await append(other, "book", "free", 1, LENT, lent("free"))
                pid = await blocker.fetchval("SELECT pg_backend_pid()")

                async def named_in_status() -> bool:
                    rows = await status(config)
                    blocking = rows[0]["blocking_transaction"]
                    return bool(blocking) and blocking["pid"] == pid

                await eventually(named_in_status, timeout=10)
                row = (await status(config))[0]
                assert row["state"] == "waiting on a transaction"
                assert row["blocking_transaction"]["application_name"] == "billing-job"
                assert row["blocking_transaction"]["age_seconds"] >= 0
                assert relay.states["loans"].blocked_by is not None
                assert f"pid {pid} ('billing-job'" in relay.states["loans"].blocked_by
                # Nothing after the open transaction's position is published meanwhile.
                assert await fetch_all(nats_url, subject) == []
                await tx.commit()
                received = await fetch_all(nats_url, subject, expected=2)
                assert ids(received) == ["book/held@1", "book/free@1"]

                async def cleared() -> bool:
                    return (await status(config))[0]["blocking_transaction"] is None

                await eventually(cleared, timeout=10)
        finally:
            await blocker.close()
    finally:
        await delete_stream(nats_url, subject)


async def test_unmapped_types_and_filtered_aggregates_are_skipped(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = await stream_for(nats_url)
    data = config_dict(events_table, nats_url, subject, aggregates=["book"])
    config = await load_and_migrate(tmp_path, data)
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "BookAdded", {"title": "Dune"})
            await append(conn, "member", "m1", 1, LENT, lent("member-agg"))
            await append(conn, "book", "b1", 2, LENT, lent("L1"))
            last = await append(conn, "book", "b1", 3, "BookRepaired", {})
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)

            async def checkpoint_past_skipped() -> bool:
                return bool((await status(config))[0]["checkpoint"] == last)

            await eventually(checkpoint_past_skipped)
        assert ids(received) == ["book/b1@2"]
        assert received[0].subject == f"{subject}.book"
        assert received[0].headers["ce-type"] == "library.book-lent.v1"
        assert received[0].json() == {
            "bookId": "b1",
            "loanId": "L1",
            "memberId": "m-1",
            "version": 2,
        }
    finally:
        await delete_stream(nats_url, subject)


async def test_start_end_skips_the_existing_log(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = await stream_for(nats_url)
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, subject, start="end")
    )
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "old", 1, LENT, lent("old"))
            async with running(config):

                async def claimed() -> bool:
                    return (await status(config))[0]["checkpoint"] is not None

                await eventually(claimed)
                await append(conn, "book", "new", 1, LENT, lent("new"))
                received = await fetch_all(nats_url, subject, expected=1)
        assert ids(received) == ["book/new@1"]
    finally:
        await delete_stream(nats_url, subject)


@pytest.mark.parametrize(
    "channel",
    [
        "relay_events",
        "relay$$$$events$$relay$$",  # relay$$events$relay$ (the file writes $ as $$)
        "c" * NOTIFY_CHANNEL_MAX,  # the longest whose trigger name Postgres does not cut
    ],
)
async def test_notify_trigger_wakes_the_relay_without_polling(
    events_table: str, nats_url: str, tmp_path: Path, channel: str
) -> None:
    subject = await stream_for(nats_url)
    data = config_dict(events_table, nats_url, subject)
    data["source"] = {"poll_interval": "60s", "notify_trigger": True, "notify_channel": channel}
    config = await load_and_migrate(tmp_path, data)
    try:
        async with connect(events_table) as conn:
            triggers = await conn.fetchval(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'events'::regclass"
                " AND NOT tgisinternal"
            )
            assert triggers == 1
            await migrate(config)  # a second migrate finds it unchanged, not a second trigger
            assert triggers == await conn.fetchval(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'events'::regclass"
                " AND NOT tgisinternal"
            )
            async with running(config) as relay:
                await eventually(lambda: _state(relay).activity == "idle")
                await append(conn, "book", "b1", 1, LENT, lent("x"))
                # With a 60 s poll interval, only the NOTIFY can deliver this in time.
                received = await fetch_all(nats_url, subject, expected=1, timeout=5)
        assert ids(received) == ["book/b1@1"]
    finally:
        await delete_stream(nats_url, subject)


async def test_events_without_metadata_or_created_at_columns(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    subject = await stream_for(nats_url)
    async with connect(database) as conn:
        await conn.execute(
            "CREATE TABLE log (seq bigserial PRIMARY KEY, stream_type text, stream_id text,"
            " rev int, kind text, body json)"
        )
        await conn.execute(
            "INSERT INTO log (stream_type, stream_id, rev, kind, body) VALUES"
            " ('book', 'b9', 1, 'BookLent', $1)",
            json.dumps(lent("L9")),
        )
    data = config_dict(database, nats_url, subject)
    data["source"] = {
        "table": "log",
        "columns": {
            "position": "seq",
            "aggregate_type": "stream_type",
            "aggregate_id": "stream_id",
            "version": "rev",
            "type": "kind",
            "payload": "body",
            "metadata": None,
            "created_at": None,
        },
    }
    config = await load_and_migrate(tmp_path, data)
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)
        assert ids(received) == ["book/b9@1"]
        assert "ce-time" not in received[0].headers
    finally:
        await delete_stream(nats_url, subject)


async def test_a_timestamp_without_time_zone_is_read_in_the_sessions_zone_and_sent_in_rfc3339(
    private_database: str, nats_url: str, tmp_path: Path
) -> None:
    """CloudEvents' `time` is RFC 3339, which requires an offset: a `timestamp` column's value
    went out as `2026-03-01T12:30:00` (no offset), which consumers' parsers refuse. The docs
    say such a value is read in the session's time zone; the database's is New York's, where
    the last second of 9999 is in the year 10000 in UTC: that row is parked, not published."""
    dsn = private_database
    subject = await stream_for(nats_url)
    async with connect(dsn) as conn:
        database_name = await conn.fetchval("SELECT current_database()")
        await conn.execute(f"ALTER DATABASE {database_name} SET timezone = 'America/New_York'")
        await conn.execute(
            "CREATE TABLE events (position bigserial PRIMARY KEY, aggregate_type text NOT NULL,"
            " aggregate_id text NOT NULL, version bigint NOT NULL, type text NOT NULL,"
            " payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',"
            " created_at timestamp NOT NULL)"
        )
        await conn.execute(
            "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
            " created_at) VALUES ('book', 'b2', 1, 'BookLent', $1, '9999-12-31 23:59:59'),"
            " ('book', 'b1', 1, 'BookLent', $1, '2026-03-01 12:30:00.25')",
            json.dumps(lent("L1")),
        )
    config = await load_and_migrate(tmp_path, config_dict(dsn, nats_url, subject))
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)
        assert ids(received) == ["book/b1@1"]
        assert received[0].headers["ce-time"] == "2026-03-01T17:30:00.250000+00:00"
    finally:
        await delete_stream(nats_url, subject)
