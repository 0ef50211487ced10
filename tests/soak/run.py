"""One soak, start to end: set up, write and inject faults, stop the faults, drain, judge."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tests.soak.brokers import SoakBroker, make_broker
from tests.soak.cluster import AUDITED, CHECKPOINTS, OUTBOX, RECORDED, Database, Replicas
from tests.soak.faults import Chaos
from tests.soak.schedule import (
    DEAD_PATH,
    FAILOVER,
    KINDS,
    LEAVE,
    LOSE,
    ROLLOUT_KINDS,
    Planned,
    plan,
)
from tests.soak.verdict import AuditCheck, Verdict, judge
from tests.soak.writers import Coordinator, Ledger, Writer


@dataclass(frozen=True)
class Settings:
    seed: int
    seconds: float  # how long faults are injected; writers write meanwhile
    faults_at_least: int = 0  # faults go on past `seconds` until there are this many
    faults_including: tuple[str, ...] = ()  # ... and until each of these kinds is among them
    broker: str = "nats"
    replicas: int = 3
    writers: int = 6
    partitioned: bool = False  # the event table is a partitioned table
    lanes: int = 1  # the outbox's `partitions`: split over the replicas when above 1
    kinds: tuple[str, ...] = KINDS
    failover: bool = False  # Postgres has a standby, and failovers are among the faults
    dead_paths: bool = False  # replicas reach Postgres over paths a connection can die on
    max_per_replica: int | None = None  # `lease.max_per_replica` of every replica
    # The continuous audit in every replica: "report" (finds) or "repair" (finds and puts
    # back); either adds the fault "the broker loses a message". None: off.
    audit: str | None = None
    drain_timeout: float = 60.0
    keep: Path | None = None  # keep logs and data here instead of a temporary directory


async def soak(settings: Settings) -> tuple[Verdict, float]:
    """Run it; the verdict and the wall-clock origin (for the fault log's offsets)."""
    root = settings.keep or Path(tempfile.mkdtemp(prefix="relay-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    db, broker = Database(standby=settings.failover), make_broker(settings.broker, root)
    replicas: Replicas | None = None
    try:
        await db.start(settings.partitioned)
        await broker.start()
        replicas = Replicas(
            settings.replicas,
            db,
            root,
            broker.relay_config(),
            broker.rule,
            lanes=settings.lanes,
            dead_paths=settings.dead_paths,
            max_per_replica=settings.max_per_replica,
            audit=settings.audit,
        )
        await asyncio.to_thread(replicas.migrate)
        replicas.start()
        return await _exercise(settings, db, broker, replicas)
    finally:
        if replicas is not None:
            replicas.stop()
        broker.stop()
        db.stop()
        if settings.keep is None:
            shutil.rmtree(root, ignore_errors=True)


async def _exercise(
    settings: Settings, db: Database, broker: SoakBroker, replicas: Replicas
) -> tuple[Verdict, float]:
    ledger = Ledger()
    coordinator = Coordinator(db, ledger)
    writers = [
        Writer(
            i, settings.seed * 1000 + i, db, ledger, coordinator, partitioned=settings.partitioned
        )
        for i in range(settings.writers)
    ]
    stop_writing, stop_watching = asyncio.Event(), asyncio.Event()
    sampler = CheckpointSampler(db)
    writing = [asyncio.create_task(w.run(stop_writing)) for w in writers]
    background = [
        asyncio.create_task(coordinator.run(stop_writing)),
        asyncio.create_task(replicas.supervise(stop_watching, random.Random(settings.seed + 1))),
        asyncio.create_task(sampler.run(stop_watching)),
    ]
    origin = time.time()
    try:
        chaos = Chaos(random.Random(settings.seed + 2), replicas, db, broker)
        faults = await chaos.run(schedule(settings))
        stop_writing.set()
        await asyncio.gather(*writing, background[0])
        drained = await _drained(db, settings.lanes, settings.drain_timeout)
        if settings.audit is not None:
            drained = drained and await _audited(db, settings.drain_timeout)
    finally:
        stop_writing.set()
        stop_watching.set()
        await asyncio.gather(*writing, *background, return_exceptions=True)
    verdict = judge(
        seed=settings.seed,
        broker=broker.name,
        deliveries=await broker.read_all(),
        table=await _committed(db),
        ledger=ledger,
        faults=faults,
        regressions=sampler.regressions,
        drained=drained,
        restarts=sum(r.starts - 1 for r in replicas.members),
        unreplicated=db.unreplicated,
        audit=None
        if settings.audit is None
        else AuditCheck(
            repairs=settings.audit == "repair",
            deleted=chaos.lost,
            reported={i for r in replicas.members for i in r.audit_findings()},
        ),
    )
    return verdict, origin


def schedule(settings: Settings) -> list[Planned]:
    """The seed's faults for this soak; a split outbox also sees replicas leave and rejoin,
    and rollouts (its partitions changed, its replicas' outbox sets mixed); a database with a
    standby also fails over."""
    kinds = settings.kinds
    if settings.lanes > 1:
        kinds = (*kinds, LEAVE, *ROLLOUT_KINDS)
    if settings.failover:
        kinds = (*kinds, FAILOVER)
    if settings.dead_paths:
        kinds = (*kinds, DEAD_PATH)
    if settings.audit is not None:
        kinds = (*kinds, LOSE)
    return plan(
        settings.seed,
        settings.seconds,
        kinds,
        at_least=settings.faults_at_least,
        including=settings.faults_including,
    )


async def _drained(db: Database, lanes: int, timeout: float) -> bool:  # noqa: ASYNC109
    """True once every lane's checkpoint has reached the head, with nothing left open: the
    lanes of the partitions the outbox runs with at the end (rollouts may change them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, TimeoutError, asyncpg.PostgresError):
            async with db.connection() as conn:
                head = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
                count = await conn.fetchval(RECORDED, OUTBOX) or lanes
                rows = await conn.fetch(CHECKPOINTS, OUTBOX)
                if len(rows) == count and all(row["position"] >= head for row in rows):
                    return True
        await asyncio.sleep(0.2)
    return False


async def _audited(db: Database, timeout: float) -> bool:  # noqa: ASYNC109
    """True once the continuous audit has read the broker back up to the head."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, TimeoutError, asyncpg.PostgresError):
            async with db.connection() as conn:
                head = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
                if (await conn.fetchval(AUDITED, OUTBOX) or 0) >= head:
                    return True
        await asyncio.sleep(0.2)
    return False


async def _committed(db: Database) -> set[str]:
    async with db.connection() as conn:
        rows = await conn.fetch("SELECT payload->>'uid' FROM events")
    return {r[0] for r in rows}


class CheckpointSampler:
    """Reads the checkpoints ten times a second; none may be seen lower than before.

    A change of the outbox's partitions starts new lanes (some of the same names) where
    the slowest old one stood: a lane is judged against its own partition set's samples.
    A failover may take back the last checkpoint writes (the promise allows the re-sends
    that follow): each primary's samples are judged apart."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.highest: dict[tuple[str, object], int] = {}  # by lane and partition set
        self.samples = 0
        self.regressions: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        conn: asyncpg.Connection | None = None
        primary = 0  # how many failovers came before the server `conn` reaches
        while not stop.is_set():
            try:
                if conn is None:
                    primary = self.db.failovers
                    conn = await asyncpg.connect(self.db.dsn, timeout=2)
                for row in await conn.fetch(CHECKPOINTS, OUTBOX):
                    self._sample((row["outbox"], (row["updated_at"], primary)), row["position"])
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if conn is not None:
                    conn.terminate()
                conn = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
        if conn is not None:
            conn.terminate()

    def _sample(self, lane: tuple[str, object], position: int) -> None:
        self.samples += 1
        highest = self.highest.get(lane, 0)
        if position < highest:
            self.regressions.append(f"checkpoint of {lane[0]}: {position} after {highest}")
        self.highest[lane] = max(highest, position)
