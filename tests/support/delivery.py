"""What a user checks after a relay run: which events reached the stream, how often, in what order.

Also: appending a library's loan events (a backlog at once, or a steady trickle from a writer
task), watching a stream's message count, and reading the relay's checkpoint row.
Nothing here imports `relay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg

from tests.support.db import NewEvent, append, append_many
from tests.support.db import connect as db_connect
from tests.support.jetstream import Received
from tests.support.jetstream import connect as nats_connect
from tests.support.relay_process import RelayProcess

AGGREGATE = "book"


def event_id(aggregate_id: str, version: int) -> str:
    """The message id the default `id` template gives an event: `book/book-1@2`."""
    return f"{AGGREGATE}/{aggregate_id}@{version}"


def book_lent(aggregate_id: str, version: int) -> NewEvent:
    return NewEvent(
        AGGREGATE,
        aggregate_id,
        version,
        "BookLent",
        {"loanId": f"loan-{aggregate_id}-{version}", "memberId": f"member-{version % 7}"},
    )


async def append_backlog(
    dsn: str, count: int, aggregates: int, prefix: str = "book"
) -> dict[int, str]:
    """Append `count` BookLent events round-robin over `aggregates` books (`prefix`-1, ...;
    another prefix for books of their own); position -> id."""
    events = [
        book_lent(f"{prefix}-{i % aggregates + 1}", i // aggregates + 1) for i in range(count)
    ]
    async with db_connect(dsn) as conn:
        positions = await append_many(conn, events)
    return {
        position: event_id(event.aggregate_id, event.version)
        for position, event in zip(positions, events, strict=True)
    }


@dataclass
class Delivery:
    """The stream's contents, judged against the events that should be on it."""

    ids: list[str]  # in stream order
    counts: Counter[str]
    duplicates: dict[str, int]  # id -> times stored, for ids stored more than once
    header_mismatches: list[str]  # messages whose ce-id differs from Nats-Msg-Id
    order_violations: list[str]  # first deliveries where an aggregate's version did not increase

    def missing(self, expected: set[str] | list[str]) -> list[str]:
        return sorted(set(expected) - set(self.counts))

    def unexpected(self, expected: set[str] | list[str]) -> list[str]:
        return sorted(set(self.counts) - set(expected))

    def report(self, label: str) -> str:
        text = (
            f"{label}: {len(self.ids)} messages, {len(self.counts)} distinct ids, "
            f"{sum(n - 1 for n in self.duplicates.values())} duplicate(s)"
        )
        if self.duplicates:
            text += f": {sorted(self.duplicates.items())[:20]}"
        return text


def analyse(messages: list[Received]) -> Delivery:
    ids: list[str] = []
    mismatches: list[str] = []
    for message in messages:
        msg_id = message.headers.get("Nats-Msg-Id", "")
        if message.headers.get("ce-id") != msg_id:
            mismatches.append(f"seq {message.seq}: {message.headers}")
        ids.append(msg_id)
    counts = Counter(ids)
    last: dict[str, tuple[int, str]] = {}
    violations: list[str] = []
    seen: set[str] = set()
    for msg_id in ids:
        if msg_id in seen:  # a re-sent copy: a consumer drops it by its id
            continue
        seen.add(msg_id)
        aggregate, _, version = msg_id.rpartition("@")
        number = int(version) if version.isdigit() else -1
        previous = last.get(aggregate)
        if previous is not None and number <= previous[0]:
            violations.append(f"{msg_id} after {previous[1]}")
        last[aggregate] = (number, msg_id)
    return Delivery(
        ids=ids,
        counts=counts,
        duplicates={i: n for i, n in counts.items() if n > 1},
        header_mismatches=mismatches,
        order_violations=violations,
    )


async def wait_for_count(
    url: str,
    stream: str,
    done: Callable[[int], bool],
    *,
    timeout: float = 20.0,  # noqa: ASYNC109 - one deadline across many polls
    interval: float = 0.01,
    process: RelayProcess | None = None,
) -> int:
    """Poll the stream's message count until `done(count)`; return that count.

    With `process`, fail at once (with its output) if that relay exits meanwhile.
    """
    deadline = time.monotonic() + timeout
    async with nats_connect(url) as nc:
        js = nc.jetstream()
        while True:
            count = int((await js.stream_info(stream)).state.messages)
            if done(count):
                return count
            if process is not None and process.returncode is not None:
                raise AssertionError(
                    f"relay exited with {process.returncode} while the stream held {count}\n"
                    + process.output()
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"stream {stream} holds {count} messages after {timeout}s")
            await asyncio.sleep(interval)


async def settled_count(
    url: str,
    stream: str,
    quiet: float = 0.3,
    timeout: float = 10.0,  # noqa: ASYNC109
) -> int:
    """The stream's message count once it stopped changing for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    async with nats_connect(url) as nc:
        js = nc.jetstream()
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            count = int((await js.stream_info(stream)).state.messages)
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return count
            await asyncio.sleep(0.02)
    raise AssertionError(f"stream {stream} kept changing for {timeout}s")


async def checkpoint(dsn: str, outbox: str, schema: str = "relay") -> asyncpg.Record | None:
    """The outbox's row in `<schema>.checkpoints`, or None."""
    async with db_connect(dsn) as conn:
        row: asyncpg.Record | None = await conn.fetchrow(
            f'SELECT * FROM "{schema}".checkpoints WHERE outbox = $1', outbox
        )
        return row


async def checkpoint_position(dsn: str, outbox: str, schema: str = "relay") -> int:
    """The outbox's checkpoint; the outbox must have been claimed."""
    row = await checkpoint(dsn, outbox, schema)
    assert row is not None, f"outbox {outbox!r} has no checkpoint row"
    return int(row["position"])


@dataclass
class Writer:
    """Appends BookLent events at a steady rate from a task, like a live application.

    Every append that raised is kept in `errors`; `appended` maps position -> id.
    """

    dsn: str
    rate: float = 20.0
    aggregates: int = 5
    appended: dict[int, str] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Writer:
        self._task = asyncio.create_task(self._run(), name="writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop appending (after the append in progress) and wait for the task."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        versions: Counter[str] = Counter()
        n = 0
        async with db_connect(self.dsn) as conn:
            while not self._stop.is_set():
                aggregate_id = f"live-{n % self.aggregates + 1}"
                versions[aggregate_id] += 1
                event = book_lent(aggregate_id, versions[aggregate_id])
                try:
                    position = await append(conn, *event[:5])
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                    self.errors.append(exc)
                    versions[aggregate_id] -= 1
                else:
                    self.appended[position] = event_id(aggregate_id, event.version)
                n += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1 / self.rate)


async def wait_for_checkpoint(
    dsn: str,
    outbox: str,
    position: int,
    timeout: float = 20.0,  # noqa: ASYNC109 - one deadline across many polls
    schema: str = "relay",
) -> None:
    """Poll `<schema>.checkpoints` until the outbox's checkpoint reaches `position`."""
    deadline = time.monotonic() + timeout
    async with db_connect(dsn) as conn:
        while True:
            current = await conn.fetchval(
                f'SELECT position FROM "{schema}".checkpoints WHERE outbox = $1', outbox
            )
            if current is not None and current >= position:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"checkpoint at {current}, not {position}, after {timeout}s")
            await asyncio.sleep(0.02)
