"""`relay check --history` against a real Postgres (and NATS for the brokers' limits): old
events that a new config would park, found with their counts and first examples before the
config is deployed; a range fixed when the walk begins; memory that does not grow with it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import StreamConfig

from tests.support.db import append, append_many, connect
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, loans, save

AMOUNT_SCHEMA = {
    "type": "object",
    "required": ["bookId", "amount"],
    "properties": {"bookId": {"type": "string"}, "amount": {"type": "number"}},
}


def history(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = run_cli(["check", "--history", *args, "--config", str(config), "--json"])
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.returncode, json.loads(result.stdout)


async def test_old_events_a_new_config_would_park_are_found_with_counts_and_examples(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    stream = unique_name("history")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    messages = {
        "BookLent": {
            "type": "library.book-lent.v1",
            "destination": "{subject}.{aggregate_type}",
            "payload": {"bookId": "aggregate_id", "loanId": "data.loanId"},
        },
        # A new expression: an old fine's amount was text.
        "FineCharged": {
            "type": "library.fine-charged.v1",
            "destination": "{subject}.fines",
            "payload": {"bookId": "aggregate_id", "amount": "abs(data.amount)"},
        },
        # A new schema: an old fee had no amount.
        "FeePaid": {
            "type": "library.fee-paid.v1",
            "destination": "{subject}.fees",
            "payload": {"bookId": "aggregate_id", "amount": "data.amount"},
            "schema": AMOUNT_SCHEMA,
        },
        # Ids that omit the version: two renewals of one book share one.
        "BookRenewed": {
            "type": "library.book-renewed.v1",
            "destination": "{subject}.renewals",
            "payload": {"bookId": "aggregate_id"},
            "id": "{aggregate_type}/{aggregate_id}",
        },
    }
    config = save(tmp_path, config_dict(events_table, nats_url, stream, messages=messages))
    try:
        async with connect(events_table) as conn:
            await append_many(conn, loans(5))
            fines = [
                await append(conn, "book", f"f{i}", 1, "FineCharged", {"amount": "three"})
                for i in range(3)
            ]
            await append(conn, "book", "ok", 1, "FineCharged", {"amount": -2})
            fees = [await append(conn, "book", f"p{i}", 1, "FeePaid", {}) for i in range(2)]
            huge = await append(conn, "book", "huge", 1, "BookLent", {"loanId": "x" * 2_000_000})
            renewals = [await append(conn, "book", "r1", v, "BookRenewed", {}) for v in (1, 2, 3)]

        code, result = history(config)
        assert code == 1 and result["ok"] is False
        (loans_,) = result["outboxes"]
        assert loans_["events"] == 15 and loans_["published"] == 9  # renewals go out, shared
        assert loans_["would_park"] == {"mapping": 3, "schema": 2, "rejected": 1}
        assert [e["position"] for e in loans_["examples"]["mapping"]] == fines
        assert "abs()" in loans_["examples"]["mapping"][0]["error"]
        assert [e["position"] for e in loans_["examples"]["schema"]] == fees
        assert "amount" in loans_["examples"]["schema"][0]["error"]
        assert loans_["examples"]["rejected"][0]["position"] == huge
        assert "max_payload" in loans_["examples"]["rejected"][0]["error"]
        assert loans_["shared_ids"] == 1
        assert loans_["shared"] == [{"id": "book/r1", "events": 3, "positions": renewals}]

        # The same range, text and --offline (the broker's limit is not known then).
        text = run_cli(["check", "--history", "--offline", "--config", str(config)])
        assert text.returncode == 1, text.stderr
        assert "would park 5 (mapping 3, schema 2)" in text.stdout
        assert f"#{fines[0]} book/f0@1 FineCharged" in text.stdout
        code, before = history(config, "--to", str(fines[0] - 1))
        assert code == 0 and before["outboxes"][0]["published"] == 5
    finally:
        await delete_stream(nats_url, stream)


async def test_the_range_ends_where_the_table_ended_when_the_walk_began(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    config = save(tmp_path, config_dict(events_table, nats_url, "nowhere"))
    async with connect(events_table) as conn:
        await append_many(conn, loans(2000))
        last = await conn.fetchval("SELECT max(position) FROM events")
    stop = asyncio.Event()

    async def write() -> int:
        written = 0
        async with connect(events_table) as conn:
            while not stop.is_set():
                batch: list[tuple[Any, ...]] = [
                    ("dvd", f"w{written + i}", 1, "BookLent", {}) for i in range(50)
                ]
                await append_many(conn, batch)
                written += 50
        return written

    writer = asyncio.create_task(write())
    try:
        code, result = await asyncio.to_thread(history, config, "--offline")
    finally:
        stop.set()
        written = await writer
    assert code == 0, result
    assert written > 0 and result["to"] >= last
    assert result["outboxes"][0]["events"] == result["to"]  # every event up to its end, once


def peak_rss_kib(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`relay check --history ARGS` in a process of its own: its peak RSS and result."""
    probe = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(done.stdout)\n"
    )
    command = [sys.executable, "-m", "relay", "check", "--history", "--offline", "--json"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *command, *args, "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    peak, _, output = done.stdout.partition("\n")
    return int(peak), json.loads(output)


async def test_a_million_events_in_flat_memory(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    config = save(tmp_path, config_dict(events_table, nats_url, "nowhere"))
    async with connect(events_table) as conn:
        await conn.execute(
            "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
            " SELECT 'book', 'b' || (i % 1000), i / 1000 + 1, 'BookLent',"
            " jsonb_build_object('loanId', 'L' || i, 'memberId', 'm' || (i % 97))"
            " FROM generate_series(0, 999999) AS i"
        )
    small_rss, small = await asyncio.to_thread(peak_rss_kib, config, "--to", "100000")
    large_rss, large = await asyncio.to_thread(peak_rss_kib, config)
    assert small["outboxes"][0]["published"] == 100_000
    assert large["outboxes"][0]["published"] == 1_000_000 and large["ok"]
    # Ten times the events, the same memory: pages and a fixed-size filter, nothing per event.
    assert large_rss - small_rss < 16 * 1024, (small_rss, large_rss)
    print(f"1M events: {large['events_per_second']:,} events/s, peak RSS {large_rss} KiB")


async def test_an_empty_range_passes_and_options_this_table_cannot_serve_exit_2(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Found by an attack: a new service's empty table failed the documented CI gate."""
    config = save(tmp_path, config_dict(events_table, nats_url, "nowhere"))
    code, result = history(config, "--from-start", "--offline")
    assert code == 0 and result["outboxes"][0]["events"] == 0
    code, result = history(config, "--from-time", "2999-01-01T00:00:00", "--offline")
    assert code == 0 and result["outboxes"][0]["events"] == 0
    data = config_dict(events_table, nats_url, "nowhere")
    data["source"]["columns"] = {"created_at": None}
    no_times = save(tmp_path, data, "no-times.yaml")
    done = run_cli(["check", "--history", "--from-time", "2026-01-01", "--config", str(no_times)])
    assert done.returncode == 2 and "created_at" in done.stderr
    done = run_cli(["check", "--history", "--from", "9", "--to", "3", "--config", str(config)])
    assert done.returncode == 2 and "after its end" in done.stderr
    # Found by an attack: `--last` beside `--history` was ignored without a word.
    done = run_cli(["check", "--history", "--last", "3", "--offline", "--config", str(config)])
    assert done.returncode == 2 and "--last" in done.stderr
    # An empty range passes, and says it is empty (a mistyped --from in CI shows).
    done = run_cli(["check", "--history", "--from", "99", "--offline", "--config", str(config)])
    assert done.returncode == 0 and "the range holds no event" in done.stdout, done.stdout


async def test_a_destination_an_event_makes_that_no_stream_captures_fails_the_check(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Found by an attack: only fixed destinations were asked of the broker; a subject made
    from the event that no stream captures would hold the outbox back for ever."""
    stream = unique_name("history")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    lent = {
        "type": "library.book-lent.v1",
        "destination": "{data.subject}",
        "payload": {"bookId": "aggregate_id"},
    }
    config = save(
        tmp_path, config_dict(events_table, nats_url, stream, messages={"BookLent": lent})
    )
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "BookLent", {"subject": f"{stream}.ok"})
            await append(conn, "book", "b2", 1, "BookLent", {"subject": "nowhere.at.all"})
        code, result = history(config)
        assert code == 1
        (found,) = result["outboxes"]
        assert found["published"] == 2 and len(found["destinations"]) == 1
        assert "nowhere.at.all" in found["destinations"][0]
        code, _ = history(config, "--offline")
        assert code == 0  # the broker is not asked: as documented
    finally:
        await delete_stream(nats_url, stream)


async def test_events_before_a_start_end_outbox_started_are_not_checked(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: events `relay run` never reads (before `start: end`) were
    reported as parked."""
    stream = unique_name("history")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    data = config_dict(events_table, nats_url, stream, start="end")
    config = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "old", 1, "FineCharged", {})  # not mapped: not read
            old = await append(conn, "book", "old", 2, "BookLent", {"loanId": None})
        relay = relay_process(["run", "--config", str(config)])
        await relay.wait_for_log("lease acquired: relaying")
        async with connect(events_table) as conn:
            await append_many(conn, loans(3))
        relay.terminate()
        assert await relay.wait_async(15) == 0
        code, result = history(config, "--offline")
        assert code == 0, result
        assert result["outboxes"][0]["before_start"] >= 1
        assert result["outboxes"][0]["published"] == 3 and old < result["to"]
    finally:
        await delete_stream(nats_url, stream)


@pytest.mark.parametrize("destination", ["{subject}.loans", "{subject}.{aggregate_id}"])
async def test_a_message_over_its_streams_max_msg_size_would_park(
    destination: str, events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Found by an attack: the stream's own limit was not looked at; `relay run` parks such a
    message (10054), the check passed it. Then again for a subject made from the event, whose
    stream was found only after the walk."""
    stream = unique_name("history")
    async with nats_connect(nats_url) as nc:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[f"{stream}.>"], max_msg_size=2_000)
        )
    lent = {
        "type": "library.book-lent.v1",
        "destination": destination,
        "payload": {"bookId": "aggregate_id", "loanId": "data.loanId"},
    }
    config = save(
        tmp_path, config_dict(events_table, nats_url, stream, messages={"BookLent": lent})
    )
    try:
        async with connect(events_table) as conn:
            await append_many(conn, loans(2))
            big = await append(conn, "book", "big", 1, "BookLent", {"loanId": "x" * 3_000})
        code, result = history(config)
        assert code == 1
        (found,) = result["outboxes"]
        assert found["would_park"] == {"rejected": 1} and found["published"] == 2
        assert found["examples"]["rejected"][0]["position"] == big
        assert "max_msg_size (2,000)" in found["examples"]["rejected"][0]["error"]
    finally:
        await delete_stream(nats_url, stream)


async def test_an_id_two_outboxes_publish_into_one_stream_is_found_and_one_per_stream_passes(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Found by an attack: two outboxes on one broker that map the same events with the
    default id publish each id twice into one JetStream stream, which keeps the first and
    drops the other as a duplicate (one consumer never gets its message); each outbox's own
    ids were unique, so the check passed. The same two outboxes on two streams pass."""
    shared, other = unique_name("history"), unique_name("history")
    await create_stream(nats_url, shared, [f"{shared}.>"])
    await create_stream(nats_url, other, [f"{other}.>"])
    lent = {"type": "library.book-lent.v1", "payload": {"bookId": "aggregate_id"}}

    def two_outboxes(second: str) -> Path:
        data = config_dict(
            events_table,
            nats_url,
            shared,
            messages={"BookLent": {**lent, "destination": "{subject}.loans"}},
        )
        data["outboxes"]["reports"] = {
            "broker": "nats",
            "messages": {"BookLent": {**lent, "destination": f"{second}.reports"}},
        }
        return save(tmp_path, data, f"{second}.yaml")

    try:
        async with connect(events_table) as conn:
            await append_many(conn, [("book", f"b{n}", 1, "BookLent", {}) for n in range(4)])
        code, result = history(two_outboxes(shared))
        assert code == 1
        for found in result["outboxes"]:
            assert found["shared_ids"] == 0  # unique within each outbox
            assert found["shared_across_outboxes"] == 4
            first = found["shared_across"][0]
            assert first["id"] == "book/b0@1" and shared in first["scope"]
            assert first["with"] == [{"loans": "reports", "reports": "loans"}[found["outbox"]]]
        code, result = history(two_outboxes(other))
        assert code == 0, result
        assert [o["shared_across_outboxes"] for o in result["outboxes"]] == [0, 0]
    finally:
        await delete_stream(nats_url, shared)
        await delete_stream(nats_url, other)
