"""The audit's cost: its own rate, and a drain's rate with an audit beside it, in one run.

    .venv/bin/python -m bench.audit_bench [--events 100000] [--rounds 2]

Against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222), on
relay_bench's backlog (bench/backlog.py: N BookLent events, about 1000 aggregates):

1. a fresh database and stream; the backlog is drained once by the relay (in this process);
2. **the audit's rate**: `relay audit loans --from-start` as an operator runs it (a child
   process), timed from start to exit, twice; events audited per second, and the
   process's peak RSS (its memory is bounded by the chunk, whatever the range);
3. **drains with and without an audit beside them**, alternated `--rounds` times, each on
   a fresh stream with the checkpoint moved back to 0: `alone`; `continuous`, the same
   relay with `audit.enabled` (delay 1 s, every 1 s: it audits while it drains, in the
   relay's own event loop); and `beside`, alone again while a `relay audit --from-start`
   loop runs in another process. Reported as each mode's rate and its ratio to `alone`
   (the goal: 0.9 or more);
4. drops the database and deletes the stream, even on failure, and prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from bench.backlog import (
    ADMIN_DSN,
    NATS_URL,
    OUTBOX,
    RunOptions,
    bench_config,
    cleanup,
    create_stream,
    delete_stream,
    set_up,
    with_database,
)
from bench.measure import drain
from bench.report import Results, say
from relay.config import RelayConfig
from tests.support.config import write_config

AUDIT_EVERY = {"enabled": True, "delay": "1s", "every": "1s"}


@dataclass
class AuditRun:
    seconds: float
    events: int
    exit_code: int
    peak_rss_kib: int

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


@dataclass
class Found:
    audits: list[AuditRun] = field(default_factory=list)
    drains: dict[str, list[float]] = field(default_factory=dict)  # mode -> events/s


def cli_config(config: RelayConfig, path: Path) -> Path:
    """The bench's relay config as a file, for `relay audit` in a child process."""
    data = config.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["database"]["url"] = config.database.url.get_secret_value()
    return write_config(path, data)


def audit_once(config_file: Path) -> AuditRun:
    """`relay audit loans --from-start --json`, timed; its RSS peak from the kernel."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay",
            "audit",
            OUTBOX,
            "--from-start",
            "--json",
            "--config",
            str(config_file),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    events = 0
    if done.returncode in (0, 1):
        events = int(json.loads(done.stdout)["events"])
    else:
        say(f"  relay audit exited {done.returncode}: {done.stderr.strip()[-300:]}")
    return AuditRun(seconds, events, done.returncode, max(peak, before))


async def reset(options: RunOptions, dsn: str, name: str) -> None:
    """A fresh stream (no duplicate window remembering the last drain's ids), the
    checkpoint back at 0, the audit's place gone."""
    await delete_stream(options.nats, name)
    await create_stream(options.nats, name)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE relay.checkpoints SET position = 0")
        await conn.execute("DELETE FROM relay.audits")
    finally:
        await conn.close()


async def timed_drain(config: RelayConfig, dsn: str, last: int) -> float:
    conn = await asyncpg.connect(dsn)
    try:
        run = await drain(config, conn, last, timeout=600)
    finally:
        await conn.close()
    return last / run.seconds


async def bench(options: RunOptions, rounds: int) -> Found:
    found = Found()
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = with_database(options.pg, name)
    results = Results(events=options.events, batch=options.batch)
    try:
        last = await set_up(options, dsn, name, results)
        plain = bench_config(options, dsn, name)
        audited = plain.model_copy(
            update={
                "outboxes": {
                    OUTBOX: plain.outboxes[OUTBOX].model_copy(
                        update={"audit": plain.outboxes[OUTBOX].audit.model_validate(AUDIT_EVERY)}
                    )
                }
            }
        )
        say("first drain (the stream the audits read)")
        await timed_drain(plain, dsn, last)
        with tempfile.TemporaryDirectory() as tmp:
            config_file = cli_config(plain, Path(tmp) / "relay.yaml")
            for _ in range(2):
                run = await asyncio.to_thread(audit_once, config_file)
                say(f"  relay audit: {run.events} events in {run.seconds:.2f}s ({run.rate:,.0f}/s)")
                found.audits.append(run)
            for round_ in range(rounds):
                for mode in ("alone", "continuous", "beside"):
                    await reset(options, dsn, name)
                    config = audited if mode == "continuous" else plain
                    looping = None
                    if mode == "beside":  # audits up to the checkpoint, back to back
                        loop = (
                            f"while true; do {sys.executable} -m relay audit {OUTBOX}"
                            f" --from-start --config {config_file} >/dev/null 2>&1;"
                            " sleep 0.1; done"
                        )
                        looping = await asyncio.create_subprocess_exec(
                            "bash", "-c", loop, start_new_session=True
                        )
                    try:
                        rate = await timed_drain(config, dsn, last)
                    finally:
                        if looping is not None:  # the loop and the audit it runs
                            os.killpg(looping.pid, signal.SIGTERM)
                            await looping.wait()
                    found.drains.setdefault(mode, []).append(rate)
                    say(f"  round {round_ + 1} {mode:<10}: {rate:,.0f} events/s")
    finally:
        await cleanup(options, name)
    return found


def report(found: Found, options: RunOptions) -> str:
    alone = statistics.mean(found.drains["alone"])
    lines = [
        f"## Audit bench ({options.events:,} events, {os.cpu_count()} CPUs)",
        "",
        "| `relay audit --from-start` | seconds | events/s | peak RSS of the command |",
        "|---|---|---|---|",
    ]
    for run in found.audits:
        lines.append(
            f"| exit {run.exit_code} | {run.seconds:.2f} | {run.rate:,.0f} |"
            f" {run.peak_rss_kib / 1024:.0f} MiB |"
        )
    lines += [
        "",
        "| Drain | events/s (each round) | mean | ratio to alone |",
        "|---|---|---|---|",
    ]
    for mode, rates in found.drains.items():
        mean = statistics.mean(rates)
        each = ", ".join(f"{r:,.0f}" for r in rates)
        lines.append(f"| {mode} | {each} | {mean:,.0f} | {mean / alone:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pg", default=ADMIN_DSN)
    parser.add_argument("--nats", default=NATS_URL)
    args = parser.parse_args(argv)
    options = RunOptions(events=args.events, pg=args.pg, nats=args.nats)
    found = asyncio.run(bench(options, args.rounds))
    print(report(found, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
