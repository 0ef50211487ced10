"""Faults, one at a time, as the seed's schedule (schedule.py) lists them.

Each fault ends cleanly (a paused process is continued, a black hole is cut and opened
again, a crashed server is started again, a failed primary rejoins as a standby), so that
once the schedule is over every outbox must drain to its head.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import asyncpg
import nats.errors

from tests.soak.brokers import SoakBroker
from tests.soak.cluster import OUTBOX, Database, Replica, Replicas
from tests.soak.rollouts import Rollouts
from tests.soak.schedule import (
    BLACK_HOLE,
    BROKER,
    DEAD_PATH,
    FAILOVER,
    KILL,
    LEAVE,
    LOSE,
    ROLLOUT_KINDS,
    STOP,
    TERM,
    TERMINATE,
    Planned,
    away_for,
    dead_for,
    frozen_for,
    paused_for,
    silent_for,
)
from tests.support.dead_path import DeadPath


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


@dataclass(frozen=True)
class Lost:
    """A message a LOSE fault deleted from the broker: the audit must find it."""

    id: str
    uid: str
    position: int


class Chaos:
    """Injects the planned faults in order, each after its pause.

    `rng` only picks a running replica when no one holds a lease, which depends on the
    run's timing: a generator of its own, so that it cannot shift the schedule's draws.
    """

    def __init__(
        self, rng: random.Random, replicas: Replicas, db: Database, broker: SoakBroker
    ) -> None:
        self.rng = rng
        self.replicas = replicas
        self.db = db
        self.broker = broker
        self.rollouts = Rollouts(rng, replicas)
        self.log: list[Fault] = []
        self.lost: list[Lost] = []  # what LOSE faults deleted

    async def run(self, schedule: list[Planned]) -> list[Fault]:
        for planned in schedule:
            await asyncio.sleep(planned.pause)
            started = time.time()
            detail = await self._inject(planned.kind, planned.lasting)
            self.log.append(Fault(planned.kind, started, time.time(), detail))
        return self.log

    async def _inject(self, kind: str, lasting: float) -> str:
        if kind in ROLLOUT_KINDS:
            return await self.rollouts.inject(kind, lasting)
        if kind in (KILL, TERM, STOP, BLACK_HOLE, LEAVE):
            target = await self._target()
            if target is None:
                return "no replica running"
            return await self._on_replica(kind, target, lasting)
        if kind == TERMINATE:
            return await self._terminate_sessions()
        if kind == LOSE:
            return await self._lose()
        if kind == FAILOVER:
            return await self.db.failover(frozen_for(lasting))
        if kind == DEAD_PATH:
            target = await self._target()
            if target is None:
                return "no replica running"
            return await self._dead_path(target, dead_for(lasting))
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
            away = away_for(lasting)
            target.hold_out(away)
            target.signal(signal.SIGTERM)
            return f"{who}, away {away:.1f}s"
        if kind == STOP:
            paused = paused_for(lasting)
            target.signal(signal.SIGSTOP)
            await asyncio.sleep(paused)
            target.signal(signal.SIGCONT)
            return f"{who}, paused {paused:.1f}s"
        silent = silent_for(lasting)
        target.proxy.pause()  # packets vanish; both ends keep their sockets
        await asyncio.sleep(silent)
        target.proxy.cut()  # then the server side is dropped
        target.proxy.resume()
        return f"{who}, silent {silent:.1f}s, then cut"

    async def _dead_path(self, target: Replica, dead: float) -> str:
        """One of the replica's connections, picked at random, loses its path for `dead`."""
        who = f"replica {target.index} (pid {target.pid})"
        sessions = await self._ask(
            "SELECT client_port, application_name FROM pg_stat_activity"
            " WHERE application_name LIKE $1 AND client_port IS NOT NULL"
            " ORDER BY application_name, client_port",
            f"%:{target.pid}:%",
        )
        if sessions is None:
            return "database unreachable"
        found: dict[str, list[tuple[DeadPath, int]]] = {}
        for r in sessions:
            if (where := target.proxy.path_of(r["client_port"])) is not None:
                found.setdefault(r["application_name"].rpartition(":")[2], []).append(where)
        if not found:
            return f"{who}: no connection found"
        role = self.rng.choice(sorted(found))  # a role, then one of its connections: a
        path, port = self.rng.choice(found[role])  # replica has a reader per lane it holds
        path.kill(port)
        await asyncio.sleep(dead)
        path.revive(port)
        return f"{who}, its {role} connection's path dead {dead:.1f}s"

    async def _lose(self) -> str:
        """Delete one message the broker stored in the last second, of an event past the
        audit's place: with `audit.delay` of a few seconds, no round has read it yet."""
        rows = await self._ask("SELECT position FROM relay.audits WHERE outbox = $1", OUTBOX)
        if rows is None:
            return "database unreachable"
        if not rows:
            return "the audit has not begun"
        audited = int(rows[0][0])
        try:
            recent = await self.broker.recent(300)  # type: ignore[attr-defined]
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            return f"broker unreachable: {exc!r}"
        copies = Counter(d.id for _, d in recent)
        now = time.time()
        fresh = {
            d.uid: (seq, d) for seq, d in recent if copies[d.id] == 1 and now - d.stored_at < 1
        }
        found = await self._ask(
            "SELECT payload->>'uid', position FROM events WHERE payload->>'uid' = ANY($1::text[])",
            list(fresh),
        )
        if found is None:
            return "database unreachable"
        candidates = sorted((int(p), uid) for uid, p in found if int(p) > audited)
        if not candidates:
            return f"no message stored in the last second past the audit's place ({audited})"
        position, uid = self.rng.choice(candidates)
        seq, delivery = fresh[uid]
        try:
            await self.broker.delete(seq)  # type: ignore[attr-defined]
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            return f"broker unreachable: {exc!r}"
        self.lost.append(Lost(delivery.id, uid, position))
        return f"{delivery.id} (position {position}, stream seq {seq}; audit at {audited})"

    async def _terminate_sessions(self) -> str:
        rows = await self._ask(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE 'relay:%' AND pid <> pg_backend_pid()"
        )
        return "database unreachable" if rows is None else f"{rows[0][0]} sessions ended"

    async def _ask(self, query: str, *args: object) -> list[asyncpg.Record] | None:
        """The rows of a query on the soak's primary; None if it could not be asked (a fault
        of the schedule's may have it down)."""
        try:
            conn = await asyncpg.connect(self.db.dsn, timeout=3)
        except (OSError, TimeoutError, asyncpg.PostgresError):
            return None
        try:
            return list(await conn.fetch(query, *args))
        finally:
            conn.terminate()
