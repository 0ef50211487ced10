"""Outbox Relay benchmark: one lane against what its broker client can do; CPU, memory, latency.

    .venv/bin/python -m bench.relay_bench [--events 100000] [--batch 500]
        [--payload-bytes 0] [--max-bytes N]

One run, against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222):

1. creates a fresh database `bench_<hex>` holding the example event table, migrates the relay's
   schema, creates a fresh file-backed stream `bench_<hex>` (subjects `bench_<hex>.>`) and COPYs
   a backlog of N BookLent events (about 1000 aggregates, versions rising per aggregate); with
   `--payload-bytes N` each payload also carries a `note` of N ASCII bytes, which the mapping
   copies into the message, so each body is about N bytes;
2. measures the reference: nats-py `js.publish_async` of the same mapped messages (same
   subjects, bodies and headers, a distinct Nats-Msg-Id), `--batch` in flight, then all their
   PubAcks awaited, which is how the relay's own NATS publisher sends a batch; only the
   publishing is timed, on the wall clock and on the process's CPU clock. For information it
   also measures the former ceiling, `--batch` `js.publish` calls gathered, every PubAck awaited
   (slower: each call is a full request);
3. relays the backlog with the real relay (`relay.runtime.runner.Relay`, in this process,
   default batch and retry settings; `--max-bytes` sets `batch.max_bytes`) and times it from
   start until
   `relay.checkpoints` reaches the last position, on the wall clock and on the process's CPU
   clock (user + system: the relay's CPU per event); its memory peak is the kernel's VmHWM,
   reset at the start, checked against VmRSS sampled every 10 ms from a child process;
4. measures the reference and the ceiling again (in mirror order), and reports
   relay / mean(reference before, reference after), the headline figure (goal >= 0.85), and
   relay / mean(ceiling before, ceiling after), for information;
5. measures commit-to-broker latency at a steady rate (default 1000 events/s for 15 s), once with
   the NOTIFY trigger and once relying on the default 1 s poll; the writer and the NATS
   subscriber run in a child process so they do not share the relay's event loop;
6. drops the database and deletes the stream, even on failure, and prints a Markdown summary.

This file is the script: its options, the run's phases in order and the report. What it is
built of is shared with the other benches: `bench/backlog.py` (the database, the backlog, the
stream, the relay's config, set-up and clean-up) and `bench/measure.py` (the clients'
reference and ceiling, the relay's drain, latency). Importing this module has no side
effects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from bench.backlog import (
    ADMIN_DSN,
    SCHEMAS,
    RunOptions,
    bench_config,
    cleanup,
    purge_stream,
    set_up,
    stored_messages,
    with_database,
)
from bench.measure import LoadSpec, ceiling, latency, relay_backlog
from bench.report import HEADLINE_GOAL, Results, Throughput, say, summary, to_json
from relay.runtime.logs import configure

DEFAULTS = RunOptions()


@dataclass(frozen=True, kw_only=True)
class BenchOptions(RunOptions):
    """The command line: what the run is set up with, and the phases' own options."""

    rate: float  # latency: events/s
    latency_seconds: float  # latency: measured seconds (0: skip)
    warmup: float  # latency: seconds not measured
    json: Path | None  # also write the results as JSON here
    profile: Path | None  # cProfile the relay's backlog run into this .pstats file


# -- the run ------------------------------------------------------------------------------


async def bench(args: BenchOptions) -> Results:
    configure("warning", "json")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = with_database(args.pg, name)
    results = Results(
        events=args.events,
        batch=args.batch,
        payload_bytes=args.payload_bytes,
        max_bytes=args.max_bytes,
    )
    try:
        last = await set_up(args, dsn, name, results)
        await throughput_phases(args, dsn, name, last, results)
        if args.latency_seconds > 0:
            await latency_phases(args, dsn, name, last, results)
    finally:
        await cleanup(args, name)
    return results


async def throughput_phases(
    args: BenchOptions, dsn: str, name: str, last: int, results: Results
) -> None:
    """Ceiling, reference, relay, reference, ceiling: in mirror order, so that drift on the
    machine affects both sides alike."""
    config = bench_config(args, dsn, name)
    results.ceiling_before = await ceiling(config, args.nats, last, args.batch, "c1")
    say(f"ceiling (before), js.publish x{args.batch} gathered: {rate(results.ceiling_before)}")
    results.pipelined_before = await ceiling(
        config, args.nats, last, args.batch, "p1", pipelined=True
    )
    say(f"reference (before), publish_async pipelined: {rate(results.pipelined_before)}")

    await purge_stream(args.nats, name)
    results.relay = await relay_backlog(
        config, last, args.profile, lambda: stored_messages(args.nats, name)
    )
    say(f"relay: {rate(results.relay.throughput, 'event')}")

    results.pipelined_after = await ceiling(
        config, args.nats, last, args.batch, "p2", pipelined=True
    )
    say(f"reference (after), publish_async pipelined: {rate(results.pipelined_after)}")
    results.ceiling_after = await ceiling(config, args.nats, last, args.batch, "c2")
    say(f"ceiling (after), js.publish x{args.batch} gathered: {rate(results.ceiling_after)}")
    say(
        f"headline, relay / publish_async reference: {results.headline_ratio:.3f} "
        f"(goal >= {HEADLINE_GOAL}); relay / js.publish ceiling, for information: "
        f"{results.ratio:.3f}"
    )
    if args.profile:
        say(f"NOTE: the relay ran under cProfile ({args.profile}): its figures are not valid")


async def latency_phases(
    args: BenchOptions, dsn: str, name: str, last: int, results: Results
) -> None:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        for seed, (mode, trigger) in enumerate(
            (("NOTIFY trigger", True), ("polling (1s)", False)), start=1
        ):
            config = bench_config(args, dsn, name, notify_trigger=trigger, poll_interval="1s")
            spec = LoadSpec(
                dsn, args.nats, name, args.rate, args.latency_seconds, args.warmup, seed
            )
            result = await latency(config, spec, last, mode, pool)
            results.latency.append(result)
            last += result.sent
            say(
                f"latency, {mode}: p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms "
                f"({result.measured:,} events at {result.rate_achieved:,.0f}/s, "
                f"{result.missing} missing)"
            )


# -- options and report -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> BenchOptions:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=DEFAULTS.events, help="backlog size")
    parser.add_argument(
        "--batch",
        type=int,
        default=DEFAULTS.batch,
        help="relay batch.max_messages and ceiling gather size (default 500, the relay default)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=DEFAULTS.payload_bytes,
        metavar="N",
        help="add a `note` of N ASCII bytes to each backlog event, carried into its message"
        " (default 0: none)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        metavar="N",
        help="set the relay's batch.max_bytes to N (default: not set, the relay's default)",
    )
    parser.add_argument(
        "--schema",
        choices=SCHEMAS,
        default=DEFAULTS.schema,
        help="validate each message against a JSON Schema: draft7 (fastjsonschema) or 2020-12"
        " (jsonschema); default none",
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="latency: events/s")
    parser.add_argument(
        "--latency-seconds", type=float, default=15.0, help="latency: measured seconds (0: skip)"
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="latency: seconds not measured")
    parser.add_argument("--pg", default=DEFAULTS.pg, help="admin DSN of the Postgres server")
    parser.add_argument("--nats", default=DEFAULTS.nats, help="NATS JetStream URL")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="cProfile the relay's backlog run into this .pstats file (slows it down)",
    )
    return BenchOptions(**vars(parser.parse_args(argv)))


def check_options(args: BenchOptions) -> None:
    """Fail before anything is created if the relay does not take this run's config (a relay
    without `batch.max_bytes` refuses `--max-bytes`)."""
    try:
        bench_config(args, ADMIN_DSN, "bench_check")
    except ValidationError as exc:
        raise SystemExit(f"relay_bench: the relay refuses this config: {exc}") from None


def rate(t: Throughput, unit: str = "msg") -> str:
    return (
        f"{t.rate:,.0f} {unit}s/s ({t.seconds:.2f}s, {t.cpu_us_per_msg:.1f} µs CPU/{unit}; "
        f"stream holds {t.stored:,})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_options(args)
    results = asyncio.run(bench(args))
    report = summary(results)
    say("\n## Outbox Relay benchmark\n")
    say(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
