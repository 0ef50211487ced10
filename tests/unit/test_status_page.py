"""The status page's cache, lag ring and files, with a fake clock and a fake fleet read.

The real read, the real page and real replicas are in tests/integration/status_page/.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import jsonschema
import pytest

from relay.errors import DatabaseError
from relay.fleet.snapshot import FleetSnapshot, ReplicaStatus
from relay.fleet.status import OutboxStatus
from relay.postgres.store import ParkedMessage
from relay.runtime.status_page import (
    FILES,
    HISTORY,
    SAMPLE_EVERY,
    LagHistory,
    StatusCache,
    StatusPage,
    page_file,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def lane(name: str, lag: int, seconds: float = 1.0) -> OutboxStatus:
    return OutboxStatus(
        name=name,
        partition=int(name.partition("/")[2] or 0),
        state="relaying",
        holder="relay:a:1",
        epoch=1,
        checkpoint=100 - lag,
        head=100,
        lag_events=lag,
        lag_seconds=seconds,
        parked=0,
        last_error="publish to nats://user:hunter2@broker:4222 failed",
        blocking_transaction=None,
        partitions=1,
        configured_partitions=1,
        waiting_replicas=[],
    )


def snapshot(at: datetime = T0) -> FleetSnapshot:
    parked = ParkedMessage(
        id=1,
        outbox="loans",
        position=7,
        event_type="<b>",
        aggregate_type="book",
        aggregate_id="<script>",
        version=1,
        message_id=None,
        message_type=None,
        destination=None,
        message_key=None,
        body=None,
        rule="",
        reason="mapping",
        error="token=s3cret in the error",
        attempts=3,
        parked_at=at,
    )
    replica = ReplicaStatus("relay:a:1", "0.2.0", connected=True, holds=["loans"])
    return FleetSnapshot(at, [lane("loans", 5)], [parked], [replica])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """A fleet read that counts its calls and can be made to fail or to wait."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls = 0
        self.fail: Exception | None = None
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self) -> FleetSnapshot:
        self.calls += 1
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return snapshot(T0 + timedelta(seconds=self.clock.now))


async def test_many_viewers_at_once_cost_one_read() -> None:
    clock = Clock()
    reads = Reads(clock)
    cache = StatusCache(reads, timeout=5, clock=clock)
    reads.gate.clear()  # the first read is slow: every viewer arrives while it runs
    viewers = [asyncio.create_task(cache.get()) for _ in range(10)]
    await asyncio.sleep(0)
    reads.gate.set()
    answers = await asyncio.gather(*viewers)
    assert reads.calls == 1
    assert {a.snapshot.taken_at for a in answers if a.snapshot} == {T0}


async def test_a_read_is_shared_for_a_second_then_made_again() -> None:
    clock = Clock()
    reads = Reads(clock)
    cache = StatusCache(reads, timeout=5, clock=clock)
    for now in (0.0, 0.3, 0.99):
        clock.now = now
        assert (await cache.get()).snapshot == snapshot(T0)
    assert reads.calls == 1
    clock.now = 1.0
    assert (await cache.get()).snapshot == snapshot(T0 + timedelta(seconds=1))
    assert reads.calls == 2


async def test_a_failed_read_keeps_the_last_good_one_and_is_not_retried_per_viewer() -> None:
    clock = Clock()
    reads = Reads(clock)
    cache = StatusCache(reads, timeout=5, clock=clock)
    await cache.get()
    clock.now = 2.0
    reads.fail = DatabaseError("lost postgresql://relay:hunter2@db:5432/app")
    for _ in range(5):
        cached = await cache.get()
    assert reads.calls == 2
    assert cached.snapshot == snapshot(T0)  # the last good read, with its own time
    assert cached.error is not None and "hunter2" not in cached.error
    assert "postgresql://***@db:5432/app" in cached.error
    clock.now = 3.0
    reads.fail = None
    cached = await cache.get()
    assert cached.error is None and cached.snapshot == snapshot(T0 + timedelta(seconds=3))


async def test_a_read_that_hangs_is_given_up_and_said_so() -> None:
    clock = Clock()
    reads = Reads(clock)
    reads.gate.clear()
    cache = StatusCache(reads, timeout=0.01, clock=clock)
    cached = await cache.get()
    assert cached.snapshot is None
    assert cached.error == "reading the fleet's status took longer than 0.01s"


def test_the_ring_keeps_fifteen_minutes_per_outbox() -> None:
    history = LagHistory()
    start = T0.timestamp()
    steps = int(2 * HISTORY / SAMPLE_EVERY)
    for i in range(steps):
        at = start + i * SAMPLE_EVERY
        history.add(at, [lane("loans", i), lane("split/0", 1, 2.0), lane("split/1", 2, 5.0)])
    rings = history.as_json()
    last = start + (steps - 1) * SAMPLE_EVERY
    for ring in rings.values():
        assert len(ring) == HISTORY / SAMPLE_EVERY + 1
        assert ring[0]["at"] == last - HISTORY and ring[-1]["at"] == last
    assert rings["loans"][-1]["lag_events"] == steps - 1
    # A split outbox is one chart: its lanes' events summed, its slowest lane's seconds.
    assert rings["split"][-1] == {"at": last, "lag_events": 3, "lag_seconds": 5.0}


def test_the_ring_drops_a_sample_no_newer_than_the_last_and_forgets_gone_outboxes() -> None:
    history = LagHistory()
    start = T0.timestamp()
    history.add(start, [lane("loans", 3), lane("old", 1)])
    history.add(start, [lane("loans", 9)])  # the same read again (the cache served it)
    assert [s["lag_events"] for s in history.as_json()["loans"]] == [3]
    history.add(start + HISTORY + 1, [lane("loans", 4)])
    assert set(history.as_json()) == {"loans"}


async def test_status_json_follows_its_schema_and_carries_no_secret() -> None:
    clock = Clock()
    page = StatusPage(StatusCache(Reads(clock), timeout=5, clock=clock), "relay:a:1")
    page.history.add(T0.timestamp(), [lane("loans", 5)])
    body = json.loads(await page.status_json())
    jsonschema.validate(body, json.loads(page_file("status.schema.json")))
    assert body["lanes"][0]["last_error"] == "publish to nats://***@broker:4222 failed"
    assert body["parked"][0]["error"] == "token=*** in the error"
    assert body["parked_total"] == 0 and body["taken_at"] == T0.isoformat()
    assert "hunter2" not in json.dumps(body) and "s3cret" not in json.dumps(body)


async def test_status_json_before_any_good_read_says_why() -> None:
    clock = Clock()
    reads = Reads(clock)
    reads.fail = DatabaseError("connection refused")
    page = StatusPage(StatusCache(reads, timeout=5, clock=clock), "relay:a:1")
    body = json.loads(await page.status_json())
    jsonschema.validate(body, json.loads(page_file("status.schema.json")))
    assert (body["taken_at"], body["error"]) == (None, "connection refused")
    # Unknown, not an empty fleet: a script must not read "nothing parked, no replica".
    unknown = [body[k] for k in ("lanes", "parked_total", "parked", "replicas")]
    assert unknown == [None, None, None, None]


def test_the_lanes_of_status_json_are_relay_status_rows() -> None:
    """The page's lanes are `relay status --json`'s rows: the schema names exactly them."""
    schema = json.loads(page_file("status.schema.json"))
    row = replace(lane("loans", 1), last_error=None).as_json()
    assert set(schema["$defs"]["lane"]["properties"]) == set(row)
    assert set(schema["$defs"]["lane"]["required"]) == set(row)


@pytest.mark.parametrize("path", sorted(FILES))
def test_every_file_of_the_page_ships_with_the_package(path: str) -> None:
    assert page_file(FILES[path][0])


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """Its markup names only its own files and runs no inline script (the CSP forbids it);
    the browser tests see what it fetches."""
    html = page_file("index.html").decode()
    for attribute in ("src", "href"):
        for value in html.split(f'{attribute}="')[1:]:
            target = value.split('"', 1)[0]
            assert not urllib.parse.urlparse(target).netloc, target
            assert target.startswith("/"), target
    assert html.count("<script") == 1 and '<script src="/status.js"' in html
    assert "innerHTML" not in page_file("status.js").decode()


async def test_viewers_of_one_read_share_one_encoded_answer() -> None:
    """Ten tabs, or a flood of requests, cost one JSON encoding per read and per sample, not
    one each, on the event loop the relay delivers on."""
    clock = Clock()
    page = StatusPage(StatusCache(Reads(clock), timeout=5, clock=clock), "relay:a:1")
    first = await page.status_json()
    assert await page.status_json() is first
    page.history.add(T0.timestamp(), [lane("loans", 5)])
    sampled = await page.status_json()
    assert sampled is not first and json.loads(sampled)["history"]["loans"][0]["lag_events"] == 5
    clock.now += 2  # the read is a second old: the next viewer reads again
    assert await page.status_json() is not sampled
