"""Faults, one at a time, chosen by a seeded generator: the same seed, the same choices.

Each fault ends cleanly (a paused process is continued, a black hole is cut and opened
again, a crashed server is started again), so that once the schedule is over every outbox
must drain to its head.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass

import asyncpg

from tests.soak.brokers import SoakBroker
from tests.soak.cluster import TAKEOVER_AFTER, Database, Replica, Replicas

KILL = "kill -9 holder"
TERM = "SIGTERM holder"
STOP = "SIGSTOP holder"
BLACK_HOLE = "black-holed link"
TERMINATE = "terminate relay sessions"
BROKER = "broker crash"
POSTGRES = "postgres crash"
KINDS = (KILL, TERM, STOP, BLACK_HOLE, TERMINATE, BROKER, POSTGRES)
# A replica scaled away for a few seconds, then back: the others take its lanes, and give
# some back when it rejoins. Only for split outboxes, so that older seeds replay as before.
LEAVE = "replica leaves, rejoins"
SPLIT_KINDS = (*KINDS, LEAVE)


@dataclass(frozen=True)
class Fault:
    kind: str
    started: float  # wall clock, comparable with the broker's stored timestamps
    ended: float
    detail: str

    def describe(self, origin: float) -> str:
        return (
            f"t+{self.started - origin:6.1f}s  {self.kind:<24} ({self.ended - self.started:.1f}s)"
            f"  {self.detail}"
        )


class Chaos:
    """Injects one fault every few seconds until told to stop."""

    def __init__(
        self,
        rng: random.Random,
        replicas: Replicas,
        db: Database,
        broker: SoakBroker,
        *,
        kinds: tuple[str, ...] = KINDS,
        every: tuple[float, float] = (1.5, 4.0),
    ) -> None:
        self.rng = rng
        self.replicas = replicas
        self.db = db
        self.broker = broker
        self.kinds = kinds
        self.every = every
        self.log: list[Fault] = []

    async def run(self, seconds: float) -> list[Fault]:
        deadline = time.monotonic() + seconds
        while True:
            pause = self.rng.uniform(*self.every)
            if time.monotonic() + pause >= deadline:
                break
            await asyncio.sleep(pause)
            kind = self.rng.choice(self.kinds)
            lasting = self.rng.uniform(0.5, 2.5)  # drawn for every fault: same seed, same draws
            started = time.time()
            detail = await self._inject(kind, lasting)
            self.log.append(Fault(kind, started, time.time(), detail))
        return self.log

    async def _inject(self, kind: str, lasting: float) -> str:
        if kind in (KILL, TERM, STOP, BLACK_HOLE, LEAVE):
            target = await self._target()
            if target is None:
                return "no replica running"
            return await self._on_replica(kind, target, lasting)
        if kind == TERMINATE:
            return await self._terminate_sessions()
        if kind == BROKER:
            await self.broker.crash()
            await asyncio.sleep(lasting)
            await self.broker.restart()
            return f"{self.broker.crash_kind}, down {lasting:.1f}s"
        await self.db.crash()
        await asyncio.sleep(lasting)
        await self.db.restart()
        return f"immediate stop, down {lasting:.1f}s"

    async def _target(self) -> Replica | None:
        holder = await self.replicas.holder()
        if holder is not None and holder.running:
            return holder
        running = [r for r in self.replicas.members if r.running]
        return self.rng.choice(running) if running else None

    async def _on_replica(self, kind: str, target: Replica, lasting: float) -> str:
        who = f"replica {target.index} (pid {target.pid})"
        if kind == KILL:
            target.signal(signal.SIGKILL)
            return who
        if kind == TERM:
            target.signal(signal.SIGTERM)
            return who
        if kind == LEAVE:
            away = 3.0 + 2 * lasting  # long enough for the others to rebalance without it
            target.hold_out(away)
            target.signal(signal.SIGTERM)
            return f"{who}, away {away:.1f}s"
        if kind == STOP:
            paused = TAKEOVER_AFTER + lasting
            target.signal(signal.SIGSTOP)
            await asyncio.sleep(paused)
            target.signal(signal.SIGCONT)
            return f"{who}, paused {paused:.1f}s"
        silent = 1.5 + lasting
        target.proxy.pause()  # packets vanish; both ends keep their sockets
        await asyncio.sleep(silent)
        target.proxy.cut()  # then the server side is dropped
        target.proxy.resume()
        return f"{who}, silent {silent:.1f}s, then cut"

    async def _terminate_sessions(self) -> str:
        try:
            conn = await asyncpg.connect(self.db.dsn, timeout=3)
        except (OSError, TimeoutError, asyncpg.PostgresError):
            return "database unreachable"
        try:
            ended = await conn.fetchval(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name LIKE 'relay:%' AND pid <> pg_backend_pid()"
            )
        finally:
            conn.terminate()
        return f"{ended} sessions ended"
