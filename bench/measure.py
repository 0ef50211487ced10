"""What a bench run measures on its backlog: the broker's own client sending the relay's
messages (the reference and the ceiling), the real relay draining the backlog (wall and CPU
time, memory), and commit-to-broker latency at a steady rate.

The backlog, the stream and the relay's config come from `bench/backlog.py`; the results are
`bench/report.py`'s classes. Importing this module has no side effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from bench.backlog import (
    AGGREGATE_TYPE,
    AGGREGATES,
    EVENT_TYPE,
    OUTBOX,
    aggregate_ids,
    nats_connection,
    purge_stream,
    stored_messages,
)
from bench.memory import RssSampler, maxrss_kib, reset_peak_rss, status_kib, trim_heap, vmrss_kib
from bench.report import PROGRESS, Latency, RelayRun, Throughput
from relay.brokers.nats import message_headers  # the relay's exact CloudEvents headers
from relay.config import RelayConfig
from relay.core.publishing import Message
from relay.mapping.mapper import Mapper
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.postgres.source import EventSource
from relay.runtime.runner import Relay

POLL = 0.05  # the checkpoint table and VmRSS read during the backlog run
WATCH = 0.005  # the relay's own stored checkpoint looked at during the backlog run

Prepared = TypeVar("Prepared")


# -- the broker's own client: the reference and the ceiling, plain nats-py ------------------


async def timed_publish(
    config: RelayConfig,
    last: int,
    batch: int,
    prepare: Callable[[list[Message]], Prepared],
    send: Callable[[Prepared], Awaitable[None]],
) -> Throughput:
    """Read and map the backlog `batch` events at a time, and time only the sending.

    Each chunk is read with the relay's EventSource and mapped with its Mapper, then turned
    into what the client sends (`prepare`); all that happens before the chunk's timers start,
    so only `send` (the client's calls and the broker's acknowledgements) is measured, and
    memory stays bounded. Returns the messages sent, the seconds and the CPU seconds of this
    process spent in `send` (the client's CPU: the broker is another process), and the bytes
    of the bodies; `stored` is left for the caller to count.
    """
    source = EventSource(config.source)
    mapper = Mapper(OUTBOX, config.outboxes[OUTBOX])
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    result, position = Throughput(0, 0.0), 0
    try:
        while position < last:
            page: Any = await source.read(
                conn, after=position, upto=last, limit=batch, aggregates=None, types=[EVENT_TYPE]
            )
            # (events, cut) since batch.max_bytes; a bare list before, for before/after runs.
            events = page[0] if isinstance(page, tuple) else page
            if not events:
                break
            position = events[-1].position
            messages = []
            for event in events:
                message = mapper.map(event)
                assert message is not None
                messages.append(message)
            chunk = prepare(messages)
            started, cpu_started = time.perf_counter(), time.process_time()
            await send(chunk)
            result.cpu_seconds += time.process_time() - cpu_started
            result.seconds += time.perf_counter() - started
            result.count += len(messages)
            result.body_bytes += sum(len(m.body) for m in messages)
    finally:
        await conn.close()
    return result


async def ceiling(
    config: RelayConfig,
    nats_url: str,
    last: int,
    batch: int,
    tag: str,
    *,
    pipelined: bool = False,
) -> Throughput:
    """Publish the relay's own messages, `batch` at a time, and time only the publishing.

    With `pipelined`, the reference (the headline's denominator): `batch` `js.publish_async`
    calls, then all their PubAcks awaited, which is how the relay's NATS publisher sends a
    batch. Without, the ceiling, for information: `batch` `js.publish` calls gathered at a
    time, every PubAck awaited (each one a full request, so slower).

    Reading and mapping stay outside the timer (see `timed_publish`). The stream is purged
    first, and every message gets a Nats-Msg-Id of its own (`<id>#<tag>`), so none is dropped
    as a duplicate of an earlier phase's.
    """
    await purge_stream(nats_url, stream_of(config))
    NatsChunk = list[tuple[str, bytes, dict[str, str]]]

    def prepare(messages: list[Message]) -> NatsChunk:
        return [
            (m.destination, m.body, {**message_headers(m), "Nats-Msg-Id": f"{m.id}#{tag}"})
            for m in messages
        ]

    async with nats_connection(nats_url) as nc:
        js = nc.jetstream(timeout=5.0)
        await js.account_info()

        async def send(chunk: NatsChunk) -> None:
            if pipelined:
                acks = [await js.publish_async(s, b, headers=h) for s, b, h in chunk]
                await asyncio.gather(*acks)
            else:
                await asyncio.gather(*(js.publish(s, b, headers=h) for s, b, h in chunk))

        result = await timed_publish(config, last, batch, prepare, send)
    result.stored = await stored_messages(nats_url, stream_of(config))
    return result


def stream_of(config: RelayConfig) -> str:
    """The stream (and subject prefix) is named after the database: `bench_<hex>`."""
    return urlsplit(config.database.url.get_secret_value()).path.lstrip("/")


# -- the relay on the backlog -------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(config: RelayConfig) -> AsyncIterator[Relay]:
    """The real relay in this loop; stopped gracefully, and it must exit 0."""
    relay = Relay(config)
    task = asyncio.create_task(relay.run(), name="relay-under-bench")
    try:
        yield relay
    finally:
        relay.stop.set()
        code = await asyncio.wait_for(task, timeout=30)
        if code != 0:
            raise RuntimeError(f"the relay exited {code}")


async def checkpoint(conn: asyncpg.Connection) -> int:
    value = await conn.fetchval("SELECT position FROM relay.checkpoints WHERE outbox = $1", OUTBOX)
    return int(value or 0)


@dataclass
class Drain:
    """What `drain` saw: wall and CPU seconds, VmRSS at each progress mark, and its peak."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    marks: dict[int, int] = field(default_factory=dict)  # progress percent -> VmRSS
    peak_kib: int = 0


async def drain(
    config: RelayConfig,
    conn: asyncpg.Connection,
    last: int,
    timeout: float | None,  # noqa: ASYNC109 - a deadline for the whole drain
) -> Drain:
    """Run the relay until its checkpoint reaches `last`, looking every WATCH seconds.

    The end is when the relay's own record of its stored checkpoint (`OutboxState.checkpoint`,
    set once the fenced write has returned) reaches `last`, looked at every WATCH (5 ms, a
    read of an attribute in this process), then confirmed in `relay.checkpoints`. Polling the
    table every POLL (50 ms) alone added 25 ms on average to every drain, a twentieth of a
    0.5 s one. The table, VmRSS and the stop checks are still read every POLL.

    The CPU clock is this process's (user + system), read where the wall clock is read: the
    relay runs in this process, Postgres and the broker do not, so it is the relay's CPU, its
    start-up included. This loop runs here too, and counts against the relay: a wake-up per
    5 ms costs about 1% of a core (one per 2 ms, as first written, 2.5 to 3.5%), plus one
    small query and one read of /proc/self/status per 50 ms. The VmRSS sampler is another
    process.
    """
    result = Drain()
    started, cpu_started = time.perf_counter(), time.process_time()
    async with running(config) as relay:
        tick = started
        while True:
            now, cpu = time.perf_counter(), time.process_time()
            state = relay.states.get(OUTBOX)
            if state is not None and (state.checkpoint or 0) >= last:
                result.seconds, result.cpu_seconds = now - started, cpu - cpu_started
                if await checkpoint(conn) < last:
                    raise RuntimeError("the relay said its checkpoint was stored; it is not")
                rss = vmrss_kib()
                result.peak_kib = max(result.peak_kib, rss)
                for pct in PROGRESS:
                    result.marks.setdefault(pct, rss)
                return result
            if now >= tick:
                position = await checkpoint(conn)
                now, cpu, rss = time.perf_counter(), time.process_time(), vmrss_kib()
                result.seconds, result.cpu_seconds = now - started, cpu - cpu_started
                result.peak_kib = max(result.peak_kib, rss)
                for pct in PROGRESS:
                    if pct not in result.marks and position * 100 >= last * pct:
                        result.marks[pct] = rss
                if position >= last:
                    return result
                if state is not None and state.role == "stopped":
                    raise RuntimeError("the relay stopped before draining the backlog")
                if timeout is not None and now - started > timeout:
                    raise RuntimeError(
                        f"the relay reached position {position} of {last} in {timeout:g}s"
                    )
                tick += POLL
            await asyncio.sleep(WATCH)


async def relay_backlog(
    config: RelayConfig,
    last: int,
    profile: Path | None,
    count_stored: Callable[[], Awaitable[int]],
    timeout: float | None = None,  # noqa: ASYNC109 - a deadline for the whole drain
) -> RelayRun:
    """Run the relay until its checkpoint reaches `last`; `count_stored` then counts what the
    destination holds. Fails if the relay stops, or if it has not finished within `timeout`
    seconds (a broker that keeps refusing would otherwise keep it retrying for ever)."""
    gc.collect()
    trim_heap()
    maxrss_before, vmrss_start = maxrss_kib(), vmrss_kib()
    hwm_reset = reset_peak_rss()
    profiler = cProfile.Profile() if profile else None
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    try:
        if profiler:
            profiler.enable()
        with RssSampler() as sampler:
            run = await drain(config, conn, last, timeout)
        if profiler and profile:
            profiler.disable()
            profiler.dump_stats(profile)
    finally:
        await conn.close()
    hwm = status_kib("VmHWM:") if hwm_reset else 0
    sampled = max(vmrss_start, run.peak_kib, sampler.peak_kib)
    maxrss_after = max(maxrss_before, maxrss_kib())  # the reset lowered ru_maxrss too
    stored = await count_stored()
    return RelayRun(
        throughput=Throughput(last, run.seconds, stored, run.cpu_seconds),
        maxrss_before_kib=maxrss_before,
        maxrss_after_kib=maxrss_after,
        vmrss_start_kib=vmrss_start,
        vmrss_at_kib=run.marks,
        vmrss_peak_kib=max(sampled, hwm),
        stored=stored,
        vmrss_samples=sampler.samples,
        vmrss_max_gap_ms=round(sampler.max_gap * 1000, 1),
        vmrss_late=sampler.late,
        vmrss_sampled_peak_kib=sampled,
        vmhwm_kib=hwm,
    )


# -- latency: a paced writer and a NATS subscriber, in a child process ---------------------


@dataclass(frozen=True)
class LoadSpec:
    dsn: str
    nats_url: str
    subject: str
    rate: float
    seconds: float
    warmup: float
    seed: int


def run_load(spec: LoadSpec) -> dict[str, Any]:
    """Child-process entry point: returns latencies (ms) of the events after the warm-up."""
    return asyncio.run(_load(spec))


async def _load(spec: LoadSpec) -> dict[str, Any]:
    received: dict[str, float] = {}
    committed: dict[str, float] = {}
    total = round(spec.rate * (spec.seconds + spec.warmup))
    all_in = asyncio.Event()

    async def on_message(msg: Any) -> None:
        received[msg.headers["Nats-Msg-Id"]] = time.monotonic()
        if len(received) >= total:
            all_in.set()

    books = aggregate_ids(random.Random(spec.seed), AGGREGATES)
    warm = round(spec.rate * spec.warmup)
    insert = (
        "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
        " VALUES ($1, $2, $3, $4, $5::jsonb)"
    )
    async with nats_connection(spec.nats_url) as nc:
        await nc.subscribe(f"{spec.subject}.>", cb=on_message, pending_msgs_limit=1_000_000)
        await nc.flush()
        conn = await asyncpg.connect(spec.dsn)
        try:
            await conn.execute("SELECT 1")
            start = time.monotonic() + 0.05
            for k in range(total):
                delay = start + k / spec.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                book, version = books[k % AGGREGATES], k // AGGREGATES + 1
                payload = json.dumps({"loanId": f"loan-{k}", "memberId": f"member-{k % 997}"})
                await conn.execute(insert, AGGREGATE_TYPE, book, version, EVENT_TYPE, payload)
                if k >= warm:
                    committed[f"{AGGREGATE_TYPE}/{book}@{version}"] = time.monotonic()
            wrote = time.monotonic() - start
        finally:
            await conn.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), 10.0)
    latencies = sorted(
        (received[key] - at) * 1000 for key, at in committed.items() if key in received
    )
    return {
        "sent": total,
        "rate": total / wrote,
        "latencies_ms": latencies,
        "missing": len(committed) - len(latencies),
    }


async def latency(
    config: RelayConfig, spec: LoadSpec, last: int, mode: str, pool: ProcessPoolExecutor
) -> Latency:
    await migrate_database(
        Database(config.database, "relay:bench:0"), config
    )  # installs the NOTIFY trigger, or removes it
    async with running(config) as relay:
        for _ in range(200):  # holding the lease and caught up with everything before
            state = relay.states.get(OUTBOX)
            if state and state.role == "holder" and (state.checkpoint or 0) >= last:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"the relay did not catch up to position {last} within 10 s")
        await asyncio.sleep(0.5)
        out = await asyncio.get_running_loop().run_in_executor(pool, run_load, spec)
    values: list[float] = out["latencies_ms"]
    return Latency(
        mode=mode,
        rate_target=spec.rate,
        rate_achieved=round(out["rate"], 1),
        sent=out["sent"],
        measured=len(values),
        missing=out["missing"],
        p50_ms=round(percentile(values, 50), 2),
        p90_ms=round(percentile(values, 90), 2),
        p99_ms=round(percentile(values, 99), 2),
        max_ms=round(values[-1] if values else float("nan"), 2),
    )


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]
