"""Poison messages are parked after `park_after` attempts; transient failures never are."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relay.cli.operator import Operator
from relay.config import RelayConfig
from relay.postgres.command_queue import CommandKind
from relay.postgres.store import Store
from tests.support.db import append, connect
from tests.support.delivery import checkpoint
from tests.support.jetstream import (
    CAPPED,
    STREAM_REFUSED,
    create_stream,
    delete_stream,
    fetch_all,
    unique_name,
)
from tests.support.operator_cli import setup_outbox
from tests.support.scenario import (
    LIBRARY_MESSAGES,
    config_dict,
    eventually,
    load_and_migrate,
    running,
    status,
)


async def parked_rows(dsn: str) -> list[dict[str, object]]:
    async with connect(dsn) as conn:
        return [asdict(p) for p in await Store("relay").parked(conn, "loans")]


async def test_oversized_message_is_parked_and_the_rest_flows(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "BookLent", {"loanId": "ok-1", "memberId": "m"})
            huge = "x" * (2 * 1024 * 1024)  # above NATS's default 1 MB max_payload
            poison = await append(conn, "book", "b2", 1, "BookLent", {"loanId": huge})
            await append(conn, "book", "b1", 2, "BookLent", {"loanId": "ok-2", "memberId": "m"})
        async with running(config) as relay:
            received = await fetch_all(nats_url, subject, expected=2)
            await eventually(lambda: _parked_count(events_table, 1))
            assert relay.states["loans"].parked == 1
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1", "book/b1@2"]
        (row,) = await parked_rows(events_table)
        assert row["position"] == poison
        assert row["message_id"] == "book/b2@1"
        assert row["reason"] == "rejected"
        assert row["attempts"] == 1  # found before sending: no retry can mend it
        assert "max_payload" in str(row["error"])
        assert isinstance(row["body"], bytes) and len(row["body"]) > 2 * 1024 * 1024
        assert (await status(config))[0]["parked"] == 1
    finally:
        await delete_stream(nats_url, subject)


async def test_a_huge_aggregate_id_is_parked_without_freezing_the_holder(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Every log line about a 70 KB id went through the secret redaction, whose URL pattern
    took time quadratic in the id (19 s a line): the holder's event loop froze, its lease went
    unproven, the standby ended its session, and the next holder froze the same way."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "i" * 70_000, 1, "BookLent", {"loanId": "l"})
            await append(conn, "book", "b1", 1, "BookLent", {"loanId": "ok-1"})
        replicas = [relay_process(["run", "--config", str(config)]) for _ in range(2)]
        received = await fetch_all(nats_url, stream, expected=1, timeout=60)
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
        await eventually(lambda: _parked_count(events_table, 1), timeout=60)

        def logged(event: str) -> bool:
            return any(r.get("event") == event for replica in replicas for r in replica.logs())

        # The line that names the id comes after the park: it is the one that took 19 s.
        await eventually(lambda: logged("message parked"), timeout=90)
        events = [r.get("event") for replica in replicas for r in replica.logs()]
        assert "silent holder's session terminated" not in events
        assert not [e for e in events if str(e).startswith("lease lost")]
    finally:
        await delete_stream(nats_url, stream)


async def test_headers_larger_than_jetstream_takes_are_parked_not_retried_for_ever(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """A 70 KB aggregate id puts more than 64 KB in the headers (the id goes in Nats-Msg-Id
    and ce-id): JetStream answers err 10097, which no retry can fix. It was taken for a
    transient failure and retried for ever, holding the lane back."""
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as conn:
            poison = await append(conn, "book", "i" * 70_000, 1, "BookLent", {"loanId": "l"})
            await append(conn, "book", "b1", 1, "BookLent", {"loanId": "ok-1", "memberId": "m"})
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)
            await eventually(lambda: _parked_count(events_table, 1))
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
        (row,) = await parked_rows(events_table)
        assert (row["position"], row["reason"], row["attempts"]) == (poison, "rejected", 1)
        assert "header" in str(row["error"])
    finally:
        await delete_stream(nats_url, subject)


async def test_an_id_nats_would_alter_is_parked_at_its_first_attempt(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """An aggregate id with a tab, or white space at an end, is refused by the NATS publisher
    before it is sent, on every attempt alike. With the default park_after (10) each such
    event held its lane for ten attempts, about 51 s, before it was parked; a few hundred of
    them stalled the lane for hours. Each is parked at its first attempt now, while a
    refusal only the server gives (the stream's max_msg_size) is still retried."""
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"], max_msg_size=CAPPED)
    data = config_dict(events_table, nats_url, subject, park_after=10)
    config = await load_and_migrate(tmp_path, data)
    loan = {"loanId": "L", "memberId": "m"}
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "BookLent", loan)
            tab = await append(conn, "book", "b\t2", 1, "BookLent", loan)
            space = await append(conn, "book", "b3 ", 1, "BookLent", loan)
            big = await append(conn, "book", "b4", 1, "BookLent", {"loanId": "x" * STREAM_REFUSED})
            await append(conn, "book", "b1", 2, "BookLent", loan)
        async with running(config) as relay:
            received = await fetch_all(nats_url, subject, expected=2)
            await eventually(lambda: _parked_count(events_table, 3), timeout=30)
            failures = relay.metrics.registry.get_sample_value(
                "relay_publish_failures_total", {"outbox": "loans", "reason": "rejected"}
            )
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1", "book/b1@2"]
        rows = await parked_rows(events_table)
        assert [(r["position"], r["reason"], r["attempts"]) for r in rows] == [
            (tab, "rejected", 1),
            (space, "rejected", 1),
            (big, "rejected", 10),  # the stream's answer: retried park_after times
        ]
        assert "header Nats-Msg-Id holds a tab" in str(rows[0]["error"])
        assert "starts or ends with whitespace" in str(rows[1]["error"])
        assert failures == 1 + 1 + 10  # one attempt each, ten for the stream's refusal
    finally:
        await delete_stream(nats_url, subject)


async def test_mapping_failure_at_run_time_is_parked(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    messages = {
        **LIBRARY_MESSAGES,
        "FineCharged": {
            "type": "library.fine-charged.v1",
            "destination": "{subject}.fines",
            # abs() of a string is a JMESPath type error, found only at run time.
            "payload": {"amount": "abs(data.amount)"},
        },
    }
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, subject, messages=messages)
    )
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "FineCharged", {"amount": -3})
            await append(conn, "book", "b1", 2, "FineCharged", {"amount": "three"})
            await append(conn, "book", "b1", 3, "FineCharged", {"amount": -4})
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=2)
            await eventually(lambda: _parked_count(events_table, 1))
        assert [m.json()["amount"] for m in received] == [3, 4]
        (row,) = await parked_rows(events_table)
        assert row["reason"] == "mapping"
        assert row["message_id"] is None
        assert "outboxes.loans.messages.FineCharged" in str(row["error"])
        assert "book/b1@2" in str(row["error"])
    finally:
        await delete_stream(nats_url, subject)


async def test_missing_stream_is_transient_retried_not_parked(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """No stream captures the subject yet: retried (status says so), delivered once it exists."""
    subject = unique_name("parking")
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as conn:
            await append(conn, "book", "b1", 1, "BookLent", {"loanId": "L", "memberId": "m"})
        async with running(config):

            async def retrying_past_park_after() -> bool:
                row = (await status(config))[0]
                return bool(
                    row["state"] == "retrying" and row["last_error"].startswith("attempt 5:")
                )

            await eventually(retrying_past_park_after)
            row = (await status(config))[0]
            assert "no stream" in row["last_error"]
            await create_stream(nats_url, subject, [f"{subject}.>"])
            received = await fetch_all(nats_url, subject, expected=1)

            async def relaying() -> bool:
                return bool((await status(config))[0]["state"] == "relaying")

            await eventually(relaying)
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
        assert await parked_rows(events_table) == []
    finally:
        await delete_stream(nats_url, subject)


async def _parked_count(dsn: str, expected: int) -> bool:
    return len(await parked_rows(dsn)) == expected


async def _poison_config(
    events_table: str, nats_url: str, tmp_path: Path, subject: str, name: str
) -> RelayConfig:
    """park_after 5, and a steady 100 ms between attempts."""
    retry = {"initial": "100ms", "max": "100ms", "jitter": 0}
    data = config_dict(events_table, nats_url, subject, park_after=5, retry=retry)
    return await load_and_migrate(tmp_path / name, data)


async def _append_poison(dsn: str) -> int:
    """A loan the capped stream refuses (its answer, so it is retried `park_after` times)."""
    async with connect(dsn) as conn:
        return await append(conn, "book", "b1", 1, "BookLent", {"loanId": "x" * STREAM_REFUSED})


async def test_operator_commands_do_not_reset_the_retry_count(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """A CronJob's retry-parked every 250 ms must not hold a poison message for ever."""
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"], max_msg_size=CAPPED)
    config = await _poison_config(events_table, nats_url, tmp_path, subject, "a")
    try:
        poison = await _append_poison(events_table)
        async with running(config):
            controller = Operator(config, "loans", "cron-job")

            async def cron() -> None:
                while True:
                    await controller.run(CommandKind.RETRY_PARKED, {"ids": [999_999]}, 10)
                    await asyncio.sleep(0.25)

            job = asyncio.create_task(cron())
            try:
                await eventually(lambda: _parked_count(events_table, 1), timeout=15)
            finally:
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
        (row,) = await parked_rows(events_table)
        assert row["position"] == poison and row["attempts"] == 5
    finally:
        await delete_stream(nats_url, subject)


async def test_retry_count_survives_a_restart(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """The next holder goes on counting where the last one stopped."""
    subject = unique_name("parking")
    await create_stream(nats_url, subject, [f"{subject}.>"], max_msg_size=CAPPED)
    config = await _poison_config(events_table, nats_url, tmp_path, subject, "b")
    try:
        poison = await _append_poison(events_table)
        async with running(config) as first:
            await eventually(
                lambda: "loans" in first.states and first.states["loans"].attempts >= 2
            )
        stored = await checkpoint(events_table, "loans")
        assert stored is not None and stored["retry_position"] == poison
        so_far = stored["attempts"]
        assert 2 <= so_far < 5
        async with running(config) as second:
            await eventually(lambda: _parked_count(events_table, 1))
            failures = second.metrics.registry.get_sample_value(
                "relay_publish_failures_total", {"outbox": "loans", "reason": "rejected"}
            )
        assert failures == 5 - so_far
        (row,) = await parked_rows(events_table)
        assert row["attempts"] == 5
    finally:
        await delete_stream(nats_url, subject)
