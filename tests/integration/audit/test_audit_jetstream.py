"""`relay audit` against a real JetStream: losses the relay cannot see, found and repaired.

Each test relays loans with a real `relay run`, then loses messages behind the relay's back
(deleted from the stream, discarded by a limit, a subject the stream stopped capturing, a
checkpoint moved forward by hand), and runs `relay audit` as an operator would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nats.js.api import RetentionPolicy, StreamConfig

from tests.integration.audit.kit import audit
from tests.support.db import append_many, connect
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.operator_cli import (
    cli,
    holds,
    park_huge_loans,
    relay_then_stop,
    relayed_up_to,
    setup_outbox,
)
from tests.support.relay_process import run_cli
from tests.support.scenario import eventually, loans, migrate_cli, write_config


async def outbox_on_stream(
    events_table: str, nats_url: str, tmp_path: Path, **stream: Any
) -> tuple[Path, str]:
    """A stream of its own made with these settings (`duplicate_window`, `max_msgs`), and a
    config relaying to it, migrated."""
    name = unique_name("audit")
    async with nats_connect(nats_url) as nc:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=[f"{name}.>"], **stream))
    config = write_config(tmp_path, events_table, nats_url, name)
    migrate_cli(config)
    return config, name


async def delete_messages(nats_url: str, stream: str, seqs: list[int]) -> None:
    async with nats_connect(nats_url) as nc:
        for seq in seqs:
            await nc.jetstream().delete_msg(stream, seq)


def ids_in(stored: list[Any]) -> list[str]:
    return [m.headers["Nats-Msg-Id"] for m in stored]


async def test_a_message_deleted_from_the_stream_is_found_missing_and_repaired(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(30))
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=30)
        lost = {stored[i].headers["Nats-Msg-Id"]: stored[i].seq for i in (3, 17, 29)}
        async with nats_connect(nats_url) as nc:
            for seq in lost.values():
                await nc.jetstream().delete_msg(stream, seq)

        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["expected"] == 30 and report["found"] == 27
        assert {m["id"] for m in report["missing"]} == set(lost)
        assert {m["position"] for m in report["missing"]} == {positions[i] for i in (3, 17, 29)}
        assert report["duplicates"] == 0 and report["unexplained"] == 0
    finally:
        await delete_stream(nats_url, stream)


async def test_two_subjects_of_one_stream_are_read_in_one_pass(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, [*loans(10), *loans(10, "dvd")])
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=20)
        gone = next(m for m in stored if m.subject.endswith(".dvd"))
        async with nats_connect(nats_url) as nc:
            await nc.jetstream().delete_msg(stream, gone.seq)

        code, report = audit(config, "--from-start")
        assert code == 1
        assert [m["id"] for m in report["missing"]] == [gone.headers["Nats-Msg-Id"]]
        assert report["destinations"][f"{stream}.book"]["found"] == 10
        assert report["destinations"][f"{stream}.dvd"]["missing"] == 1
    finally:
        await delete_stream(nats_url, stream)


async def test_repair_through_the_holder_puts_back_exactly_the_missing_ones(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path, duplicate_window=0.1)
    try:
        holder = relay_process(["run", "--config", str(config)])
        await eventually(lambda: holds(holder), timeout=20)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(30))
        await relayed_up_to(config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=30)
        lost = [stored[i] for i in (0, 14, 29)]
        await delete_messages(nats_url, stream, [m.seq for m in lost])

        code, report = audit(config, "--from-start", "--repair", "--timeout", "20")
        assert code == 0, report
        assert {m["id"] for m in report["missing"]} == set(ids_in(lost))
        repair = report["repair"]
        assert repair["ok"] and repair["direct"] is False
        assert repair["executed_by"].endswith(f":{holder.pid}")
        assert len(repair["published"]) == 3 and not repair["still_parked"]
        after = report["after_repair"]
        assert after["missing_count"] == 0 and after["found"] == 30 and after["duplicates"] == 0
        now = await fetch_all(nats_url, stream, expected=30)
        assert sorted(ids_in(now)) == sorted(ids_in(stored))  # each once: nothing else sent
        assert cli(config, "parked", "list", "loans") == []
    finally:
        await delete_stream(nats_url, stream)


async def test_a_repair_the_duplicate_window_drops_is_reported_not_landed(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """JetStream still remembers a deleted message's id for its duplicate window: the re-send
    is acknowledged as a duplicate and not stored. The command must not call that repaired."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)  # window 2 minutes
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=10)
        await delete_messages(nats_url, stream, [stored[4].seq])

        code, report = audit(config, "--from-start", "--repair", "--timeout", "2")
        assert code == 1
        assert report["repair"]["duplicate_window"] == 120
        assert "duplicate window" in report["repair"]["note"]
        assert [m["id"] for m in report["after_repair"]["missing"]] == ids_in([stored[4]])
        text = run_cli(["audit", "loans", "--from-start", "--config", str(config)])
        assert text.returncode == 1 and "1 message(s) missing" in text.stdout
    finally:
        await delete_stream(nats_url, stream)


async def test_a_repair_waits_out_a_short_duplicate_window(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path, duplicate_window=3)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=10)
        await delete_messages(nats_url, stream, [stored[2].seq, stored[7].seq])

        code, report = audit(config, "--from-start", "--repair", "--timeout", "30")
        assert code == 0, report
        assert report["repair"]["direct"] is True  # no replica runs: under the lease itself
        assert report["after_repair"]["missing_count"] == 0
        assert sorted(ids_in(await fetch_all(nats_url, stream, expected=10))) == sorted(
            ids_in(stored)
        )
    finally:
        await delete_stream(nats_url, stream)


async def test_parked_messages_are_counted_as_parked_never_missing(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        await park_huge_loans(events_table, relay_process, config, 2)
        code, report = audit(config, "--from-start")
        assert code == 0, report
        assert report["parked"] == 2 and report["expected"] == 0 and report["missing"] == []
    finally:
        await delete_stream(nats_url, stream)


async def test_a_replay_shows_as_messages_stored_twice_never_missing(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path, duplicate_window=0.1)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])
        assert cli(config, "replay", "loans", "--from", str(positions[4]))["ok"]
        await relay_then_stop(relay_process, config, positions[-1])
        assert len(await fetch_all(nats_url, stream, expected=20)) == 20

        code, report = audit(config, "--from-start")
        assert code == 0, report
        assert report["duplicates"] == 8 and report["missing_count"] == 0
        assert report["found"] == 12
    finally:
        await delete_stream(nats_url, stream)


async def test_events_a_hand_moved_checkpoint_skipped_are_missing_and_repaired(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
        await relay_then_stop(relay_process, config, positions[-1])
        async with connect(events_table) as conn:
            later = await append_many(conn, loans(5, "dvd"))
            await conn.execute(
                "UPDATE relay.checkpoints SET position = $1 WHERE outbox = 'loans'", later[-1]
            )

        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert sorted(m["position"] for m in report["missing"]) == later
        assert all(m["reason"] == "not found" for m in report["missing"])
        assert report["after_repair"]["found"] == 15
        assert len(await fetch_all(nats_url, stream, expected=15)) == 15
    finally:
        await delete_stream(nats_url, stream)


async def test_a_stream_limit_that_discarded_is_named_and_repaired_once_raised(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await outbox_on_stream(
        events_table, nats_url, tmp_path, max_msgs=20, duplicate_window=0.1
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(30))
        await relay_then_stop(relay_process, config, positions[-1])

        code, report = audit(config, "--from-start")
        assert code == 1
        assert sorted(m["position"] for m in report["missing"]) == positions[:10]
        assert all("max_msgs 20" in m["reason"] for m in report["missing"])
        assert report["expired_count"] == 0

        async with nats_connect(nats_url) as nc:  # the operator raises the limit first
            info = await nc.jetstream().stream_info(stream)
            info.config.max_msgs = 1000
            await nc.jetstream().update_stream(info.config)
        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert report["after_repair"]["found"] == 30
    finally:
        await delete_stream(nats_url, stream)


async def test_a_subject_the_stream_stopped_capturing_is_missing_there(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """The operator's stream (brokers.nats.stream) is what its consumers read: messages that
    another stream captured instead are missing from it, whatever else holds them."""
    name, other = unique_name("audit"), unique_name("thief")
    await create_stream(nats_url, name, [f"{name}.>"], duplicate_window=0.1)
    stream_config = {"name": name, "subjects": [f"{name}.>"], "create": False}
    config = write_config(tmp_path, events_table, nats_url, name, broker={"stream": stream_config})
    migrate_cli(config)
    try:
        async with connect(events_table) as conn:
            first = await append_many(conn, loans(6))
        await relay_then_stop(relay_process, config, first[-1])
        async with nats_connect(nats_url) as nc:
            js = nc.jetstream()
            info = await js.stream_info(name)
            info.config.subjects = [f"{name}.bike"]
            await js.update_stream(info.config)
            await js.add_stream(StreamConfig(name=other, subjects=[f"{name}.book"]))
        async with connect(events_table) as conn:
            later = await append_many(conn, loans(4, "bike"))
            later += await append_many(conn, [("book", "late", 1, "BookLent", {"loanId": "x"})])
        await relay_then_stop(relay_process, config, later[-1])

        code, report = audit(config, "--from-start")
        assert code == 1
        assert [m["position"] for m in report["missing"]] == [later[4]]
        assert "does not capture subject" in report["missing"][0]["reason"]
        assert report["destinations"][f"{name}.book"]["found"] == 6
        assert report["destinations"][f"{name}.bike"]["found"] == 4

        async with nats_connect(nats_url) as nc:  # the operator mends the streams
            js = nc.jetstream()
            await js.delete_stream(other)
            info = await js.stream_info(name)
            info.config.subjects = [f"{name}.>"]
            await js.update_stream(info.config)
        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert report["after_repair"]["found"] == 11
    finally:
        await delete_stream(nats_url, name)
        await delete_stream(nats_url, other)


async def test_bad_input_exits_2_naming_what_is_wrong(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        never = run_cli(["audit", "loans", "--config", str(config)])
        assert never.returncode == 2 and "has never relayed" in never.stderr
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(5))
        await relay_then_stop(relay_process, config, positions[-1])
        cases = {
            ("nosuch",): "unknown outbox 'nosuch'",
            ("loans", "--from", str(positions[-1] + 10)): "after its end",
            ("loans", "--from", "3", "--last", "2"): "at most one of",
            ("loans", "--from", "4", "--to", "2"): "after its end",
        }
        for args, says in cases.items():
            done = run_cli(["audit", *args, "--config", str(config)])
            assert done.returncode == 2, (args, done.stdout, done.stderr)
            assert says in done.stderr, (args, done.stderr)
        code, report = audit(config, "--last", "2")
        assert code == 0 and report["events"] == 2 and report["from"] == positions[3]
    finally:
        await delete_stream(nats_url, stream)


async def test_messages_a_when_condition_rejects_are_skipped_and_a_second_rule_audited(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """`when` and several rules per event type count as the relay counts them: a rejected
    message is skipped, never expected; each rule's message is audited on its own."""
    returned = {
        "type": "library.book-returned.v1",
        "destination": "{subject}.returns",
        "payload": "{bookId: aggregate_id}",
        "when": "data.late",
    }
    late_fee = {**returned, "type": "library.late-fee.v1", "destination": "{subject}.fees"}
    messages = {"BookReturned": [returned, late_fee]}
    config, stream = await setup_outbox(events_table, nats_url, tmp_path, messages=messages)
    try:
        events = [
            ("book", f"b{i}", 1, "BookReturned", {"loanId": f"L{i}", "late": i % 3 == 0})
            for i in range(9)
        ]
        async with connect(events_table) as conn:
            positions = await append_many(conn, events)
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await fetch_all(nats_url, stream, expected=6)
        fee = next(m for m in stored if m.subject.endswith(".fees"))
        await delete_messages(nats_url, stream, [fee.seq])

        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["events"] == 9 and report["skipped"] == 12  # 6 events x 2 rules
        assert report["expected"] == 6 and report["found"] == 5
        assert [m["id"] for m in report["missing"]] == [fee.headers["Nats-Msg-Id"]]
        assert report["missing"][0]["rule"] == "library.late-fee.v1"
    finally:
        await delete_stream(nats_url, stream)


async def test_a_repair_that_cannot_land_stays_missing_and_exits_1(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: a failed repair left the messages parked, and the audit counted
    parked messages as parked, not missing: `after_repair` and every later audit passed."""
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path, duplicate_window=0.1)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(6))
        await relay_then_stop(relay_process, config, positions[-1])
        async with nats_connect(nats_url) as nc:  # the messages gone, and no stream for them
            js = nc.jetstream()
            await js.purge_stream(stream)
            info = await js.stream_info(stream)
            info.config.subjects = [f"{stream}.elsewhere"]
            await js.update_stream(info.config)

        code, report = audit(config, "--from-start", "--repair", "--timeout", "5")
        assert code == 1, report
        assert report["repair"]["published"] == [] and len(report["repair"]["still_parked"]) == 6
        after = report["after_repair"]
        assert after["missing_count"] == 6 and after["parked"] == 0
        assert all(m["parked_for_repair"] for m in after["missing"])
        assert "parked for its repair" in after["missing"][0]["reason"]
        code, later = audit(config, "--from-start")
        assert code == 1 and later["missing_count"] == 6
        reasons = {p["reason"] for p in cli(config, "parked", "list", "loans")}
        assert reasons == {"missing"}
    finally:
        await delete_stream(nats_url, stream)


async def test_a_stream_that_forgets_what_consumers_acknowledged_is_refused_with_exit_2(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: an interest stream drops what its consumers acknowledged; the
    audit called those missing, and a repair delivered them to the consumers again."""
    config, stream = await outbox_on_stream(
        events_table, nats_url, tmp_path, retention=RetentionPolicy.INTEREST
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(3))
        await relay_then_stop(relay_process, config, positions[-1])
        done = run_cli(["audit", "loans", "--from-start", "--config", str(config)])
        assert done.returncode == 2 and "retention: interest" in done.stderr
    finally:
        await delete_stream(nats_url, stream)


async def test_created_at_at_the_ends_of_time_or_ahead_of_the_clock(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: year 1 or 9999 (`DateTime.MinValue`) overflowed the audit; a time
    ahead of the clock made it read the stream from after the message, a false alarm."""
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(3))
            for at, when in zip(
                positions,
                ["0001-01-01 00:00:00+00", "9999-12-31 23:59:59+00", "now() + interval '9 h'"],
                strict=True,
            ):
                value = when if when.startswith("now") else f"'{when}'::timestamptz"
                await conn.execute(
                    f"UPDATE events SET created_at = {value} WHERE position = $1", at
                )
        await relay_then_stop(relay_process, config, positions[-1])
        code, report = audit(config, "--from-start")
        assert code == 0, report
        assert report["found"] == 3 and report["missing_count"] == 0
    finally:
        await delete_stream(nats_url, stream)


async def test_a_dropped_message_the_broker_refuses_is_refused_not_missing(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: a message parked because NATS refuses its subject, then dropped by
    the operator, was called missing, and `--repair` parked it again."""
    lent = {
        "type": "library.book-lent.v1",
        "destination": "{subject}.{aggregate_id}",
        "payload": {"bookId": "aggregate_id"},
    }
    config, stream = await setup_outbox(
        events_table, nats_url, tmp_path, messages={"BookLent": lent}
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, [*loans(3), ("book", "a..b", 1, "BookLent", {})])
        await relay_then_stop(relay_process, config, positions[-1])
        assert len(cli(config, "parked", "list", "loans")) == 1
        cli(config, "parked", "drop", "--all", "--outbox", "loans", "--yes")
        code, report = audit(config, "--from-start")
        assert code == 0, report
        assert report["refused"] == 1 and report["found"] == 3 and report["missing_count"] == 0
    finally:
        await delete_stream(nats_url, stream)


async def test_messages_purged_from_a_stream_with_an_age_limit_are_missing_not_expired(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Found by an attack: expiry was judged by the event's created_at, so events written
    long before they were published (a backlog) passed for expired when purged."""
    config, stream = await outbox_on_stream(events_table, nats_url, tmp_path, max_age=600)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(5))
            await conn.execute("UPDATE events SET created_at = now() - interval '1 hour'")
        await relay_then_stop(relay_process, config, positions[-1])
        async with nats_connect(nats_url) as nc:
            await nc.jetstream().purge_stream(stream)
        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["missing_count"] == 5 and report["expired_count"] == 0
    finally:
        await delete_stream(nats_url, stream)
