"""Database sessions per replica, for several outbox x partition x replica shapes, in one run.

    .venv/bin/python -m bench.sessions_bench

Against the machine's Postgres (127.0.0.1:5432) and NATS (127.0.0.1:4222). For each shape, a
fresh database with an empty event table and real `relay run` processes; once every lane
has a holder and the lanes are spread fairly, the replicas' sessions are counted in
pg_stat_activity by the role in their application_name (`relay:<host>:<pid>:<role>`).
The goal (docs/scaling.md): at most 4 per replica plus 1 per lane it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from bench import backlog
from bench.report import say
from relay.config import RelayConfig
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from tests.support.config import write_config


@dataclass(frozen=True)
class Shape:
    outboxes: int
    partitions: int
    replicas: int

    @property
    def lanes(self) -> int:
        return self.outboxes * self.partitions


@dataclass
class Count:
    shape: Shape
    per_replica: list[Counter[str]]  # sessions by role, one counter per replica
    held: list[int]  # lanes held, per replica

    @property
    def worst_margin(self) -> int:
        """The most any replica uses beyond 4 + its held lanes (<= 0 meets the goal)."""
        return max(
            sum(roles.values()) - (4 + held)
            for roles, held in zip(self.per_replica, self.held, strict=True)
        )


def config(dsn: str, nats_url: str, subject: str, shape: Shape) -> dict[str, Any]:
    base = backlog.relay_config(dsn, nats_url, subject, batch=500)
    data = base.model_dump(by_alias=True, mode="json")
    data["database"]["url"] = dsn
    data["lease"]["retry_interval"] = "200ms"
    outbox = data["outboxes"].pop(backlog.OUTBOX)
    for i in range(shape.outboxes):
        rules = {
            event_type: {**rule, "destination": f"{subject}.o{i}"}
            for event_type, rule in outbox["messages"].items()
        }
        data["outboxes"][f"o{i}"] = {**outbox, "messages": rules, "partitions": shape.partitions}
    return data


async def count(shape: Shape, args: argparse.Namespace, tmp: Path) -> Count:
    name = f"sessions_{uuid.uuid4().hex[:10]}"
    dsn = backlog.with_database(args.pg, name)
    await backlog.admin_execute(args.pg, f'CREATE DATABASE "{name}"')
    processes: list[asyncio.subprocess.Process] = []
    try:
        await backlog.admin_execute(dsn, backlog.read_events_sql())
        data = config(dsn, args.nats, name, shape)
        relay = RelayConfig(**data)
        await migrate_database(Database(relay.database, "relay:bench:0"), relay)
        path = write_config(tmp / f"{name}.yaml", data)
        for _ in range(shape.replicas):
            processes.append(
                await asyncio.create_subprocess_exec(
                    *[sys.executable, "-m", "relay", "run", "--config", str(path)],
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        pids = [p.pid for p in processes]
        held = await settled(dsn, pids, shape, args.timeout)
        sessions = await roles(dsn)
        per_replica = [
            Counter(role for pid, role in sessions if pid == replica) for replica in pids
        ]
        return Count(shape, per_replica, held)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            await asyncio.wait_for(process.wait(), 20)
        await backlog.admin_execute(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def settled(dsn: str, pids: list[int], shape: Shape, timeout: float) -> list[int]:  # noqa: ASYNC109
    """Wait until every lane is held and no replica holds more than its fair share."""
    share = -(-shape.partitions // shape.replicas) * shape.outboxes
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = await asyncpg.connect(dsn)
        try:
            holders = await conn.fetch(
                "SELECT holder FROM relay.checkpoints WHERE holder IS NOT NULL"
            )
            locks = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        finally:
            await conn.close()
        by = Counter(int(str(r["holder"]).rsplit(":", 1)[1]) for r in holders)
        held = [by.get(pid, 0) for pid in pids]
        if sum(held) == shape.lanes and locks == shape.lanes and max(held) <= share:
            await asyncio.sleep(1.0)  # a few passes more: nothing else is opened later
            return held
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{shape}: lanes not settled within {timeout}s")


async def roles(dsn: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'relay:%'"
        )
    finally:
        await conn.close()
    out = []
    for row in rows:
        _, pid, role = str(row["application_name"]).rsplit(":", 2)
        if pid.isdigit():
            out.append((int(pid), role))
    return out


def table(counts: list[Count]) -> str:
    lines = [
        "| outboxes x partitions | replicas | lanes held per replica | sessions per replica"
        " | by role (first replica) | within 4 + held |",
        "|---|---|---|---|---|---|",
    ]
    for c in counts:
        s = c.shape
        totals = [sum(r.values()) for r in c.per_replica]
        first = ", ".join(f"{role} {n}" for role, n in sorted(c.per_replica[0].items()))
        lines.append(
            f"| {s.outboxes} x {s.partitions} | {s.replicas} | {'/'.join(map(str, c.held))}"
            f" | {'/'.join(map(str, totals))} | {first}"
            f" | {'yes' if c.worst_margin <= 0 else 'NO'} |"
        )
    return "\n".join(lines)


SHAPES = [Shape(10, 1, 2), Shape(1, 16, 4), Shape(10, 4, 2), Shape(4, 16, 4)]


async def bench(args: argparse.Namespace) -> list[Count]:
    with tempfile.TemporaryDirectory(prefix="relay-sessions-") as tmp:
        return [await count(shape, args, Path(tmp)) for shape in SHAPES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg", default=backlog.ADMIN_DSN)
    parser.add_argument("--nats", default=backlog.NATS_URL)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    counts = asyncio.run(bench(args))
    say("\n" + table(counts))
    return 0 if all(c.worst_margin <= 0 for c in counts) else 1


if __name__ == "__main__":
    sys.exit(main())
