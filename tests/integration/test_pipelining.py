"""Reading ahead never changes a guarantee: a failed batch goes first, the checkpoint waits.

The relay reads and maps batch N+1 while batch N waits for its acknowledgements,
and writes N's checkpoint while N+1 is sent. These tests fail batch N, for real,
after N+1 has been read: transiently (the stream is full) and permanently (a
message above the stream's max_msg_size: the server's answer, retried `park_after`
times). N is retried or parked first, N+1 follows in order, and while N fails the
checkpoint stays before its failed message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nats.js.api import DiscardPolicy, StreamConfig

from relay.runtime.runner import Relay
from tests.support.db import append_many, connect
from tests.support.delivery import checkpoint_position
from tests.support.jetstream import CAPPED, STREAM_REFUSED, delete_stream, fetch_all, unique_name
from tests.support.jetstream import connect as nats_connect
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, status

BATCH = 5
EVENTS = 15  # three full batches
MESSAGES: dict[str, Any] = {
    "BookLent": {
        "type": "library.book-lent.v1",
        "destination": "{subject}.{aggregate_type}",
        "payload": "data",
    }
}
OPTIONS: dict[str, Any] = {"messages": MESSAGES, "batch": {"max_messages": BATCH, "linger": "0s"}}


def events_read(relay: Relay) -> float:
    """relay_events_read_total for the outbox, from the relay's own metrics."""
    return sum(
        sample.value
        for metric in relay.metrics.events_read.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def add_stream(nats_url: str, prefix: str, **limits: Any) -> str:
    """A fresh stream capturing `<name>.>`, with these StreamConfig limits; its name."""
    stream = unique_name(prefix)
    async with nats_connect(nats_url) as nc:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[f"{stream}.>"], **limits)
        )
    return stream


def attempts(relay: Relay) -> int:
    """How often the head message has failed, as the relay reports it."""
    state = relay.states.get("loans")
    return state.attempts if state is not None else 0


async def write_backlog(dsn: str, poison_at: int | None = None) -> list[int]:
    """EVENTS loans over three books; the one numbered `poison_at` (1-based) is too big for
    a stream capped at CAPPED bytes a message."""
    rows = []
    for n in range(1, EVENTS + 1):
        loan = "x" * STREAM_REFUSED if n == poison_at else f"loan-{n}"
        rows.append(("book", f"b{n % 3}", n // 3 + 1, "BookLent", {"loanId": loan, "n": n}))
    async with connect(dsn) as conn:
        return await append_many(conn, rows)


async def test_a_transient_failure_of_batch_n_is_retried_before_the_batch_read_ahead(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    # Holds 7 messages: the 8th, in the second batch, is refused until the limit goes.
    stream = await add_stream(nats_url, "ahead", max_msgs=7, discard=DiscardPolicy.NEW)
    config = await load_and_migrate(
        tmp_path,
        config_dict(events_table, nats_url, stream, **OPTIONS),
    )
    positions = await write_backlog(events_table)
    try:
        async with running(config) as relay:
            await eventually(lambda: attempts(relay) >= 2)
            # The third batch was read while the second failed...
            assert events_read(relay) == EVENTS
            # ...but nothing after the 7th message was checkpointed or published.
            assert await checkpoint_position(events_table, "loans") == positions[6]
            (row,) = await status(config)
            assert row["state"] == "retrying"
            assert "maximum messages" in row["last_error"]
            async with nats_connect(nats_url) as nc:
                await nc.jetstream().update_stream(
                    StreamConfig(name=stream, subjects=[f"{stream}.>"], max_msgs=-1)
                )
            received = await fetch_all(nats_url, stream, expected=EVENTS)
            await eventually(lambda: _checkpoint_is(events_table, positions[-1]), timeout=10)
        assert [m.json()["n"] for m in received] == list(range(1, EVENTS + 1))
    finally:
        await delete_stream(nats_url, stream)


async def test_a_permanent_failure_of_batch_n_is_parked_before_the_batch_read_ahead(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    stream = await add_stream(nats_url, "ahead", max_msg_size=CAPPED)
    config = await load_and_migrate(
        tmp_path,
        config_dict(
            events_table,
            nats_url,
            stream,
            **OPTIONS,
            retry={"initial": "300ms", "max": "300ms"},
        ),
    )
    positions = await write_backlog(events_table, poison_at=8)
    try:
        async with running(config) as relay:
            await eventually(lambda: attempts(relay) >= 1)
            assert events_read(relay) == EVENTS  # the third batch is read already
            assert await checkpoint_position(events_table, "loans") == positions[6]
            received = await fetch_all(nats_url, stream, expected=EVENTS - 1)
            await eventually(lambda: _checkpoint_is(events_table, positions[-1]), timeout=10)
            assert relay.states["loans"].parked == 1
        assert [m.json()["n"] for m in received] == [n for n in range(1, EVENTS + 1) if n != 8]
        async with connect(events_table) as conn:
            parked = await conn.fetch("SELECT position, reason FROM relay.parked")
        assert [(r["position"], r["reason"]) for r in parked] == [(positions[7], "rejected")]
    finally:
        await delete_stream(nats_url, stream)


async def _checkpoint_is(dsn: str, position: int) -> bool:
    return await checkpoint_position(dsn, "loans") == position


async def test_batches_close_at_max_bytes_and_a_larger_event_goes_alone(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """batch.max_bytes bounds what one batch holds; nothing is lost or reordered by it."""
    stream = await add_stream(nats_url, "bytes")
    options = {**OPTIONS, "batch": {"max_messages": 100, "linger": "0s", "max_bytes": "4KiB"}}
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, stream, **options)
    )
    assert config.outboxes["loans"].batch.max_bytes == 4096
    rows = [
        (
            "book",
            f"b{n % 3}",
            n // 3 + 1,
            "BookLent",
            {"n": n, "pad": "p" * (9000 if n == 7 else 900)},
        )
        for n in range(1, 31)
    ]
    async with connect(events_table) as conn:
        await append_many(conn, rows)
    try:
        async with running(config) as relay:
            received = await fetch_all(nats_url, stream, expected=30)
            sizes = batch_sizes(relay)
        assert [m.json()["n"] for m in received] == list(range(1, 31))
        # ~0.9 KiB bodies: four fit in 4 KiB; the 9 KiB one is sent alone. Without the cap
        # the 30 events would go in one batch.
        assert sum(sizes.values()) >= 8
        assert max(size for size, count in sizes.items() if count) <= 5
        assert sizes[1] >= 1
    finally:
        await delete_stream(nats_url, stream)


def batch_sizes(relay: Relay) -> dict[int, int]:
    """How many published batches had at most n messages, per bucket, from the histogram."""
    buckets: dict[int, int] = {}
    for metric in relay.metrics.batch_messages.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                buckets[int(float(sample.labels["le"]))] = int(sample.value)
    # cumulative -> per bucket
    per, before = {}, 0
    for bound in sorted(buckets):
        per[bound], before = buckets[bound] - before, buckets[bound]
    return per
