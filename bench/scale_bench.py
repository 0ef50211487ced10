"""Scale-out: one backlog drained by one replica (K = 1) and by R replicas (K = 4), in one run.

    .venv/bin/python -m bench.scale_bench [--events 100000] [--index] [--partitions 4]

Against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222). For
each shape, a fresh database with the same N-event backlog (relay_bench's rows), a fresh
file-backed stream, and real `relay run` processes; timed from their start until the
stream holds N messages. CPU seconds are read from /proc for the relay processes, every
postgres process and the nats-server, over the same span, so the table shows what limits
the drain on this machine. With `--index`, the split shape also runs with the expression
index that lets each lane read only its own rows (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench import backlog
from bench.report import say
from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.postgres.queries import lane_of
from tests.support.config import write_config

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Shape:
    label: str
    replicas: int
    partitions: int
    index: bool = False


@dataclass
class Drain:
    shape: Shape
    events: int
    seconds: float
    relay_cpu: float
    postgres_cpu: float
    nats_cpu: float

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes (those still alive), in seconds."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def pids_of(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def drain(shape: Shape, args: argparse.Namespace, tmp: Path) -> Drain:
    name = f"scale_{uuid.uuid4().hex[:10]}"
    dsn = backlog.with_database(args.pg, name)
    await backlog.admin_execute(args.pg, f'CREATE DATABASE "{name}"')
    await backlog.create_stream(args.nats, name)
    processes: list[asyncio.subprocess.Process] = []
    try:
        await backlog.admin_execute(dsn, backlog.read_events_sql())
        await backlog.insert_backlog(dsn, args.events)
        config = backlog.relay_config(dsn, args.nats, name, batch=args.batch)
        data = config.model_dump(by_alias=True, mode="json")
        data["database"]["url"] = dsn
        data["outboxes"][backlog.OUTBOX]["partitions"] = shape.partitions
        data["lease"]["retry_interval"] = "200ms"
        relay = RelayConfig(**data)
        await migrate_database(Database(relay.database, "relay:bench:0"), relay)
        if shape.index:
            lane = lane_of(relay.source.columns, shape.partitions)
            await backlog.admin_execute(dsn, f"CREATE INDEX ON events (({lane}), position)")
        path = write_config(tmp / f"{name}.yaml", data)
        postgres, nats = pids_of("postgres"), pids_of("nats-server")
        before = (cpu_seconds(postgres), cpu_seconds(nats))
        started = time.perf_counter()
        for _ in range(shape.replicas):
            processes.append(
                await asyncio.create_subprocess_exec(
                    *[sys.executable, "-m", "relay", "run", "--config", str(path)],
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        while await backlog.stored_messages(args.nats, name) < args.events:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        seconds = time.perf_counter() - started
        relay_cpu = cpu_seconds([p.pid for p in processes])
        after = (cpu_seconds(pids_of("postgres")), cpu_seconds(pids_of("nats-server")))
        lanes = len(lanes_of(backlog.OUTBOX, shape.partitions))
        say(f"{shape.label}: {args.events / seconds:,.0f} events/s ({seconds:.2f}s, {lanes} lanes)")
        return Drain(
            shape, args.events, seconds, relay_cpu, after[0] - before[0], after[1] - before[1]
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            await asyncio.wait_for(process.wait(), 20)
        await backlog.delete_stream(args.nats, name)
        await backlog.admin_execute(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def table(drains: list[Drain]) -> str:
    base = drains[0].rate
    lines = [
        "| shape | events/s | vs one replica | relay CPU s | Postgres CPU s | NATS CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for d in drains:
        lines.append(
            f"| {d.shape.label} | {d.rate:,.0f} | {d.rate / base:.2f} | {d.relay_cpu:.1f}"
            f" | {d.postgres_cpu:.1f} | {d.nats_cpu:.1f} |"
        )
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> list[Drain]:
    r, k = args.replicas, args.partitions
    shapes = [
        Shape("1 replica, partitions 1", 1, 1),
        Shape(f"{r} replicas, partitions {k}", r, k),
    ]
    if args.index:
        shapes.append(Shape(f"{r} replicas, partitions {k}, lane index", r, k, index=True))
    with tempfile.TemporaryDirectory(prefix="relay-scale-") as tmp:
        return [await drain(shape, args, Path(tmp)) for shape in shapes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the split shape")
    parser.add_argument("--partitions", type=int, default=4, help="its `partitions`")
    parser.add_argument("--index", action="store_true", help="also with the lane index")
    parser.add_argument("--pg", default=backlog.ADMIN_DSN)
    parser.add_argument("--nats", default=backlog.NATS_URL)
    args = parser.parse_args(argv)
    drains = asyncio.run(bench(args))
    say("\n" + table(drains))
    say(f"\nmachine: {os.cpu_count()} cores, load at start {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
