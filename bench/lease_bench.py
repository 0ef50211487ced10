"""One replica taking an outbox of 64 partitions under load: do its lease proofs keep up?

    .venv/bin/python -m bench.lease_bench [--compare DIR] [--rounds 3] [--partitions 64]
        [--writers 2] [--backlog 20000] [--seconds 30] [--keep DIR]

Against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222). Each
run: a fresh database with the example event table; writers inserting as fast as they can
(20 events per statement) until `--backlog` events are in, and on until the end; then one
real `relay run` (every lease and source setting at its default, JSON logs) for
`--seconds`. The relay runs with a probe (this file, loaded into its process) that times
every use of the lease connection: how long it waited for the connection and how long it
held it, by what it was for (a lease proof, a claim, a checkpoint write, the standby's
statements, the rest), the statements sent on it per second, and the event loop's lag.
At the end: the 'lease lost' lines of its log and the lanes `relay status --json` shows
held. With `--compare DIR` (another commit's tree, such as `git archive` of it unpacked)
the runs alternate between DIR's relay and this tree's, with this file's probe and load in
both, and the ratios of the means are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from statistics import mean
from typing import Any, Literal

HERE = Path(__file__).resolve().parents[1]
_WHAT: contextvars.ContextVar[str] = contextvars.ContextVar("lease_use", default="other")
# What each use of the lease connection is for, by the function it comes from.
_KINDS = {
    ("relay.postgres.lease", "LeaseConnection", "prove"): "proof",
    ("relay.postgres.lease", "LeaseConnection", "try_locks"): "standby",
    ("relay.postgres.lease", "LeaseConnection", "holders"): "standby",
    ("relay.postgres.lease", "LeaseConnection", "terminate"): "standby",
    ("relay.runtime.replica", "OutboxReplica", "_beat"): "standby",
    ("relay.postgres.lease", "LeaseConnection", "unlock"): "release",
    ("relay.runtime.holding", None, "claim"): "claim",
    ("relay.postgres.claimed", "ClaimedOutbox", "advance"): "checkpoint",
    ("relay.postgres.claimed", "ClaimedOutbox", "parked_count"): "parked count",
    ("relay.runtime.outbox", "OutboxRelay", "_carry_out_commands"): "commands",
}
_STATEMENTS = ("execute", "executemany", "fetch", "fetchval", "fetchrow")
# `--compare` with a tree from before relay/ops/ was split: the same code under older names.
_OLDER = {
    "relay.runtime.": "relay.ops.",
    "relay.cli.main": "relay.ops.cli",
    "LeaseConnection": "LeaseSession",
}


def _older(name: str) -> str:
    for new, old in _OLDER.items():
        name = name.replace(new, old)
    return name


def _import(module: str) -> Any:
    """The module of the relay on the path, under its name there."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        return importlib.import_module(_older(module))


# -- the probe, inside the relay's process ---------------------------------------------------


class Probe:
    """Every use of the lease connection: (seconds since start, kind, lock wait, lock held)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.uses: list[tuple[float, str, float, float]] = []
        self.statements: list[tuple[float, str]] = []
        self.lags: list[tuple[float, float]] = []
        self.lease_connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self.lag_task: asyncio.Task[None] | None = None

    def now(self) -> float:
        return time.monotonic() - self.started

    async def sample_lag(self) -> None:
        """The event loop's lag: how late a 50 ms sleep wakes, every 50 ms; and a dump a second."""
        dumped = 0.0
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.05)
            self.lags.append((self.now(), time.monotonic() - before - 0.05))
            if self.now() - dumped >= 1.0:
                self.dump()
                dumped = self.now()

    def dump(self) -> None:
        data = {"uses": self.uses, "statements": self.statements, "lags": self.lags}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.out)


def _timed_lock(probe: Probe) -> type[asyncio.Lock]:
    class TimedLock(asyncio.Lock):
        """The lease connection's lock, timing each wait and each hold by what it was for."""

        _since = 0.0

        async def acquire(self) -> Literal[True]:
            asked = time.monotonic()
            try:
                await super().acquire()
            except asyncio.CancelledError:  # a timeout while waiting: held for no time (-1)
                probe.uses.append((probe.now(), _WHAT.get(), time.monotonic() - asked, -1.0))
                raise
            self._since = time.monotonic()
            self._waited = (_WHAT.get(), self._since - asked)
            return True

        def release(self) -> None:
            what, waited = self._waited
            probe.uses.append((probe.now(), what, waited, time.monotonic() - self._since))
            super().release()

    return TimedLock


def _tag(owner: Any, name: str, kind: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    async def tagged(*args: Any, **kwargs: Any) -> Any:
        token = _WHAT.set(kind)
        try:
            return await original(*args, **kwargs)
        finally:
            _WHAT.reset(token)

    setattr(owner, name, tagged)


def install(out: Path) -> None:
    """Patch the relay importable here so that its lease connection reports to a probe."""

    import asyncpg  # noqa: PLC0415

    from relay.postgres import lease  # noqa: PLC0415

    probe = Probe(out)
    lock = _timed_lock(probe)
    for (module, cls, name), kind in _KINDS.items():
        owner: Any = _import(module)
        if cls:
            owner = getattr(owner, cls, None) or getattr(owner, _older(cls))
        if hasattr(owner, name):
            _tag(owner, name, kind)
    connection_class: Any = getattr(lease, "LeaseConnection", None) or lease.LeaseSession  # type: ignore[attr-defined]
    init = connection_class.__init__

    def init_with_probe(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.lock = lock()
        probe.lag_task = asyncio.get_running_loop().create_task(probe.sample_lag())

    connection_class.__init__ = init_with_probe
    connect = connection_class._connection

    async def connection(self: Any) -> Any:
        conn = await connect(self)
        probe.lease_connections.add(conn)
        return conn

    connection_class._connection = connection
    for name in _STATEMENTS:
        _count_statements(asyncpg.Connection, name, probe)


def _count_statements(cls: Any, name: str, probe: Probe) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self in probe.lease_connections:
            probe.statements.append((probe.now(), _WHAT.get()))
        return await original(self, *args, **kwargs)

    setattr(cls, name, counted)


def run_relay(config: str, out: str) -> None:
    """The child: `relay run --config config`, with the probe writing to `out`."""
    install(Path(out))
    main = _import("relay.cli.main").main

    sys.argv = ["relay", "run", "--config", config]
    main()


_CHILD = (
    "import sys, importlib.util as u; sys.path.insert(0, sys.argv[1]);"
    "s = u.spec_from_file_location('lease_bench_here', sys.argv[2]); m = u.module_from_spec(s);"
    "sys.modules[s.name] = m; s.loader.exec_module(m);"
    "import relay; assert relay.__file__.startswith(sys.argv[1]);"
    "m.run_relay(sys.argv[3], sys.argv[4])"
)


# -- the parent: database, load, the replica, the figures -----------------------------------


@dataclass
class Run:
    """What the parent saw of one replica's run."""

    tree: Path
    log: Path
    probe: Path
    held_at_end: int  # lanes held by `relay status --json` at the end
    all_held_after: float | None  # seconds from the start until it first held every lock
    events: int  # written by the load meanwhile


@dataclass
class Figures:
    """One run's figures, from its log and its probe."""

    held_at_end: int
    lost_lines: int
    first_lost_after: float | None  # seconds from the start to the first 'lease lost'
    lost_reasons: Counter[str]
    all_held_after: float | None
    events: int
    statements_per_second: float
    proofs_per_second: float
    proof_wait_p50: float
    proof_wait_p99: float
    proof_wait_max: float
    proof_held_p99: float  # from taking the connection to giving it back, the statement's run
    proofs_timed_out: int
    lag_p99: float
    lag_max: float
    holds: dict[str, float] = field(default_factory=dict)  # lock held, seconds per second


async def one_run(tree: Path, args: argparse.Namespace, tmp: Path) -> Figures:
    from bench import backlog  # noqa: PLC0415

    name = f"lease_{uuid.uuid4().hex[:10]}"
    dsn = backlog.with_database(args.pg, name)
    await backlog.admin_execute(args.pg, f'CREATE DATABASE "{name}"')
    await backlog.create_stream(args.nats, name)
    try:
        config = await _set_up(dsn, name, args, tmp)
        run = await _measure(tree, args, dsn, config, tmp / f"{name}.log")
    finally:
        await backlog.delete_stream(args.nats, name)
        await backlog.admin_execute(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return _figures(run)


async def _set_up(dsn: str, name: str, args: argparse.Namespace, tmp: Path) -> Path:
    from bench import backlog  # noqa: PLC0415
    from relay.config import RelayConfig  # noqa: PLC0415
    from relay.postgres.database import Database  # noqa: PLC0415
    from relay.postgres.migrations import migrate_database  # noqa: PLC0415
    from tests.support.config import write_config  # noqa: PLC0415

    await backlog.admin_execute(dsn, backlog.read_events_sql())
    data = backlog.relay_config(dsn, args.nats, name, batch=500).model_dump(
        by_alias=True, mode="json"
    )
    data["database"]["url"] = dsn
    data["outboxes"][backlog.OUTBOX]["partitions"] = args.partitions
    data["lease"] = {"namespace": name}  # every other lease setting at its default
    data["source"] = {}  # and every source setting (poll_interval 1 s)
    data["logging"] = {"level": "info", "format": "json"}
    config = RelayConfig(**data)
    await migrate_database(Database(config.database, "relay:bench:0"), config)
    return write_config(tmp / f"{name}.yaml", data)


async def _write(dsn: str, stop: asyncio.Event, written: list[int], writer: int) -> None:
    """One writer: 20 events per statement, as fast as Postgres takes them."""
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        n = 0
        while not stop.is_set():
            rows = [(f"w{writer}-{n}-{i}", json.dumps({"loanId": f"L{i}"})) for i in range(20)]
            await conn.executemany(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
                " VALUES ('book', $1, 1, 'BookLent', $2::jsonb)",
                rows,
            )
            written[0] += len(rows)
            n += 1
    finally:
        await conn.close()


async def _measure(tree: Path, args: argparse.Namespace, dsn: str, config: Path, log: Path) -> Run:
    probe = log.with_suffix(".probe.json")
    stop, written = asyncio.Event(), [0]
    writers = [asyncio.create_task(_write(dsn, stop, written, w)) for w in range(args.writers)]
    try:
        await _until(lambda: written[0] >= args.backlog)  # under way before the replica starts
        with log.open("wb") as sink:
            relay = await asyncio.create_subprocess_exec(
                *[sys.executable, "-c", _CHILD, str(tree), __file__, str(config), str(probe)],
                env={**os.environ, "PYTHONPATH": str(tree)},
                cwd=tree,
                stdout=sink,
                stderr=sink,
            )
        started = time.monotonic()
        all_held = await _all_held(dsn, args.partitions, args.seconds)
        await asyncio.sleep(max(0.0, args.seconds - (time.monotonic() - started)))
        held = await _held_by_status(tree, config)
    finally:
        stop.set()
        await asyncio.gather(*writers, return_exceptions=True)
    if relay.returncode is not None:
        raise SystemExit(f"the relay exited {relay.returncode} early; its log: {log}")
    relay.terminate()
    await asyncio.wait_for(relay.wait(), 30)
    return Run(tree, log, probe, held, all_held, written[0])


async def _until(check: Callable[[], bool]) -> None:
    while not check():  # noqa: ASYNC110 - a bench polls what it measures
        await asyncio.sleep(0.05)


async def _all_held(dsn: str, lanes: int, timeout: float) -> float | None:  # noqa: ASYNC109
    """Seconds until the replica first held every lane (by pg_locks), None if it never did."""
    import asyncpg  # noqa: PLC0415

    started = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        while time.monotonic() - started < timeout:
            held = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND"
                " database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            if held == lanes:
                return time.monotonic() - started
            await asyncio.sleep(0.1)
    finally:
        await conn.close()
    return None


async def _held_by_status(tree: Path, config: Path) -> int:
    """How many lanes `relay status --json` shows held, as an operator would look."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "relay", "status", "--json", "--config", str(config)],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(1 for row in json.loads(done.stdout) if row["holder"])


def _figures(run: Run) -> Figures:
    lines = [json.loads(x) for x in run.log.read_text().splitlines() if x.startswith("{")]
    lost = [x for x in lines if str(x.get("event", "")).startswith("lease lost")]
    data = json.loads(run.probe.read_text())
    uses, statements = data["uses"], data["statements"]
    span = max(1.0, max((u[0] for u in uses), default=0.0))
    proofs = [u for u in uses if u[1] == "proof"]
    waits = sorted(u[2] for u in proofs) or [0.0]
    ran = sorted(u[3] for u in proofs if u[3] >= 0) or [0.0]
    lags = sorted(x[1] for x in data["lags"]) or [0.0]
    holds: Counter[str] = Counter()
    for _, kind, _, hold in uses:
        holds[kind] += max(hold, 0.0)
    return Figures(
        held_at_end=run.held_at_end,
        lost_lines=len(lost),
        first_lost_after=_first_lost_after(lines, lost),
        lost_reasons=Counter(str(x.get("reason", ""))[:60] for x in lost),
        all_held_after=run.all_held_after,
        events=run.events,
        statements_per_second=len(statements) / span,
        proofs_per_second=len(proofs) / span,
        proof_wait_p50=_pct(waits, 50),
        proof_wait_p99=_pct(waits, 99),
        proof_wait_max=waits[-1],
        proof_held_p99=_pct(ran, 99),
        proofs_timed_out=sum(1 for u in proofs if u[3] < 0),
        lag_p99=_pct(lags, 99),
        lag_max=lags[-1],
        holds={k: v / span for k, v in holds.items()},
    )


def _first_lost_after(lines: list[dict[str, Any]], lost: list[dict[str, Any]]) -> float | None:
    """Seconds from the relay's first log line to its first 'lease lost'."""
    if not lost or not lines:
        return None
    first, at = (datetime.fromisoformat(x["timestamp"]) for x in (lines[0], lost[0]))
    return (at - first).total_seconds()


def _pct(ordered: list[float], pct: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


HEADER = (
    "| tree | lanes held at the end | 'lease lost' lines (first after) | every lock taken after"
    " | events written | lease statements/s | proofs/s | proof wait for the connection"
    " p50 / p99 / max ms | proof run p99 ms | proofs timed out | loop lag p99 / max ms"
    " | connection held, s per s, by use |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(f: Figures, label: str) -> str:
    after = "never" if f.all_held_after is None else f"{f.all_held_after:.1f} s"
    first = "" if f.first_lost_after is None else f" ({f.first_lost_after:.1f} s)"
    holds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(f.holds.items()) if v >= 0.005)
    return (
        f"| {label} | {f.held_at_end} | {f.lost_lines}{first} | {after} | {f.events:,}"
        f" | {f.statements_per_second:.0f} | {f.proofs_per_second:.1f}"
        f" | {f.proof_wait_p50 * 1000:.0f} / {f.proof_wait_p99 * 1000:.0f} /"
        f" {f.proof_wait_max * 1000:.0f} | {f.proof_held_p99 * 1000:.0f} | {f.proofs_timed_out}"
        f" | {f.lag_p99 * 1000:.0f} / {f.lag_max * 1000:.0f} | {holds} |"
    )


def main(argv: list[str] | None = None) -> int:
    from bench import backlog  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="another relay tree, e.g. the old commit's")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree")
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--backlog", type=int, default=20_000, help="events written first")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--keep", type=Path, help="keep each run's log and probe data here")
    parser.add_argument("--pg", default=backlog.ADMIN_DSN)
    parser.add_argument("--nats", default=backlog.NATS_URL)
    args = parser.parse_args(argv)
    trees = [("this tree", HERE)]
    if args.compare:
        trees.insert(0, (str(args.compare), args.compare.resolve()))
    results: dict[str, list[Figures]] = {label: [] for label, _ in trees}
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="relay-lease-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for n in range(1, args.rounds + 1):
            for label, tree in trees if n % 2 else trees[::-1]:
                figures = asyncio.run(one_run(tree, args, where))
                results[label].append(figures)
                print(_row(figures, label), flush=True)
                for reason, count in figures.lost_reasons.items():
                    print(f"  {count} x {reason}", flush=True)
    if args.compare:
        _ratios(*(results[label] for label, _ in trees))
    print(f"\nmachine: {os.cpu_count()} cores, load at the end {os.getloadavg()[0]:.2f}")
    return 0


def _ratios(before: list[Figures], after: list[Figures]) -> None:
    print("\nthis tree / the other, means over the rounds:")
    for key in ("statements_per_second", "proofs_per_second", "proof_wait_p99", "proof_wait_max"):
        b, a = mean(getattr(f, key) for f in before), mean(getattr(f, key) for f in after)
        print(f"  {key}: {a / b:.3f}" if b else f"  {key}: {a:.3f} (the other: 0)")
    for key in ("lost_lines", "held_at_end", "events"):
        b, a = mean(getattr(f, key) for f in before), mean(getattr(f, key) for f in after)
        print(f"  {key}: {a:g} (the other: {b:g})")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
