"""Writers that commit out of order, roll back, hold transactions and use two-phase commit.

Each writer owns its aggregates, so each aggregate's versions are committed in order. Every
event carries a unique `uid`; the ledger records what each writer knows of its fate. A
commit whose answer was lost (the connection died during COMMIT) is uncertain; the table,
read once the faults have stopped, is the final word on what was committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import asyncpg

from tests.soak.cluster import Database

AGGREGATE_TYPES = ("book", "member")  # two destinations: soak.book and soak.member
_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


@dataclass
class Ledger:
    """What the writers know: uids committed, rolled back, or of unknown outcome."""

    committed: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    uncertain: set[str] = field(default_factory=set)
    kinds: dict[str, int] = field(default_factory=dict)
    acknowledged_at: dict[str, float] = field(default_factory=dict)  # wall clock, by uid

    def acknowledge(self, uids: Iterable[str]) -> None:
        """The database said these are committed (a failover may still take them back)."""
        now = time.time()
        for uid in uids:
            self.committed.add(uid)
            self.acknowledged_at[uid] = now

    def count(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


@dataclass(frozen=True)
class Prepared:
    gid: str
    due: float
    commit: bool
    uids: tuple[str, ...]


class Coordinator:
    """Finishes prepared transactions later, as a transaction manager would.

    After a failover it recovers as an XA transaction manager does: a COMMIT PREPARED that
    the old primary acknowledged but never sent to its standby leaves the transaction
    prepared again on the new primary, holding the event table until it is finished anew.
    """

    def __init__(self, db: Database, ledger: Ledger) -> None:
        self.db = db
        self.ledger = ledger
        self.pending: list[Prepared] = []
        self.finished: dict[str, Prepared] = {}  # by gid: what was decided, to redo it
        self.recovered = 0  # the failovers recovered from

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`, then until every prepared transaction is finished and every
        failover recovered from."""
        conn: asyncpg.Connection | None = None
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set() or self.pending or self.db.failovers != self.recovered:
                due = [p for p in self.pending if stop.is_set() or p.due <= loop.time()]
                try:
                    if self.db.failovers != self.recovered:
                        if conn is not None:
                            conn.terminate()
                        conn = await self._recover()
                    for prepared in due:
                        conn = conn or await asyncpg.connect(self.db.dsn, timeout=3)
                        await self._finish(conn, prepared)
                        self.pending.remove(prepared)
                except _ERRORS:
                    if conn is not None:
                        conn.terminate()
                    conn = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.05)
                if stop.is_set() and (self.pending or self.db.failovers != self.recovered):
                    await asyncio.sleep(0.2)  # the database may be restarting
        finally:
            if conn is not None:
                conn.terminate()

    async def _recover(self) -> asyncpg.Connection:
        """Finish again what the new primary still holds prepared."""
        failovers = self.db.failovers
        conn = await asyncpg.connect(self.db.dsn, timeout=3)
        try:
            for (gid,) in await conn.fetch("SELECT gid FROM pg_prepared_xacts"):
                if gid in self.finished:
                    await self._finish(conn, self.finished[gid])
        except BaseException:
            conn.terminate()
            raise
        self.recovered = failovers
        return conn

    async def _finish(self, conn: asyncpg.Connection, p: Prepared) -> None:
        exists = await conn.fetchval("SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1", p.gid)
        if not exists:
            # Never prepared (the PREPARE failed), or finished by a lost earlier try.
            self.ledger.uncertain.update(p.uids)
            return
        await conn.execute(f"{'COMMIT' if p.commit else 'ROLLBACK'} PREPARED '{p.gid}'")
        self.finished[p.gid] = p
        if p.commit:
            self.ledger.acknowledge(p.uids)
        else:
            self.ledger.rolled_back.update(p.uids)
        self.ledger.uncertain.difference_update(p.uids)


class Writer:
    """One application session appending events, chosen by a seeded generator."""

    def __init__(
        self,
        index: int,
        seed: int,
        db: Database,
        ledger: Ledger,
        coordinator: Coordinator,
        *,
        partitioned: bool,
    ) -> None:
        self.index = index
        self.rng = random.Random(seed)
        self.db = db
        self.ledger = ledger
        self.coordinator = coordinator
        self.partitioned = partitioned
        self.aggregates = [(AGGREGATE_TYPES[k % 2], f"w{index}-{k}") for k in range(4)]
        self.versions: dict[tuple[str, str], int] = {}
        self.serial = 0

    async def run(self, stop: asyncio.Event) -> None:
        conn: asyncpg.Connection | None = None
        try:
            while not stop.is_set():
                if conn is None:
                    conn = await self._connect(stop)
                    if conn is None:
                        return
                    await self._resync(conn)
                try:
                    await self._one_transaction(conn)
                except _ERRORS:
                    conn.terminate()
                    conn = None
                await asyncio.sleep(self.rng.uniform(0.0, 0.02))
        finally:
            if conn is not None:
                conn.terminate()

    async def _connect(self, stop: asyncio.Event) -> asyncpg.Connection | None:
        while not stop.is_set():
            try:
                return await asyncpg.connect(self.db.dsn, timeout=3)
            except _ERRORS:
                await asyncio.sleep(0.2)
        return None

    async def _resync(self, conn: asyncpg.Connection) -> None:
        """After a lost connection, read the versions back: an uncertain commit may exist."""
        for key in self.aggregates:
            self.versions[key] = await conn.fetchval(
                "SELECT coalesce(max(version), 0) FROM events"
                " WHERE aggregate_type = $1 AND aggregate_id = $2",
                *key,
            )

    def _uid(self) -> str:
        self.serial += 1
        return f"w{self.index}-{self.serial}"

    async def _insert(
        self, conn: asyncpg.Connection, aggregate: tuple[str, str], version: int, uid: str
    ) -> None:
        direct = self.partitioned and self.rng.random() < 0.5
        table = "events_live" if direct else "events"
        await conn.execute(
            f"INSERT INTO {table} (aggregate_type, aggregate_id, version, type, payload)"
            " VALUES ($1, $2, $3, 'ItemAdded', $4::jsonb)",
            *aggregate,
            version,
            json.dumps({"uid": uid, "writer": self.index, "version": version}),
            timeout=10,
        )

    async def _one_transaction(self, conn: asyncpg.Connection) -> None:
        roll = self.rng.random()
        if roll < 0.07:
            await self._two_phase(conn)
            return
        # A few transactions stay open for seconds: one writer's, as a batch job's would.
        long = self.index == 0 and roll > 0.9
        kind = "rollback" if roll < 0.17 else "long" if long else "commit"
        self.ledger.count(kind)
        aggregate = self.rng.choice(self.aggregates)
        count = self.rng.randint(1, 3)
        version = self.versions.get(aggregate, 0)
        uids = [self._uid() for _ in range(count)]
        pause = self.rng.uniform(1.0, 3.0) if kind == "long" else self.rng.uniform(0, 0.06)
        await conn.execute("BEGIN")
        try:
            for i, uid in enumerate(uids, start=1):
                await self._insert(conn, aggregate, version + i, uid)
            if kind == "long" or self.rng.random() < 0.3:
                await asyncio.sleep(pause)  # commits land out of position order
        except _ERRORS:
            self.ledger.rolled_back.update(uids)  # the server aborts it with the session
            raise
        if kind == "rollback":
            await conn.execute("ROLLBACK")
            self.ledger.rolled_back.update(uids)
            return
        try:
            await conn.execute("COMMIT", timeout=10)
        except _ERRORS:
            self.ledger.uncertain.update(uids)
            raise
        self.ledger.acknowledge(uids)
        self.versions[aggregate] = version + count

    async def _two_phase(self, conn: asyncpg.Connection) -> None:
        """Prepare; the coordinator commits (mostly) or rolls back later."""
        self.ledger.count("two-phase")
        uid = self._uid()
        aggregate = (AGGREGATE_TYPES[self.serial % 2], f"w{self.index}-x{self.serial}")
        gid = f"soak-{uid}"
        await conn.execute("BEGIN")
        try:
            await self._insert(conn, aggregate, 1, uid)
        except _ERRORS:
            self.ledger.rolled_back.add(uid)
            raise
        try:
            await conn.execute(f"PREPARE TRANSACTION '{gid}'", timeout=10)
        except _ERRORS:
            self.ledger.uncertain.add(uid)
            raise
        finally:
            loop = asyncio.get_running_loop()
            commit = self.rng.random() < 0.8
            due = loop.time() + self.rng.uniform(0.2, 2.5)
            self.coordinator.pending.append(Prepared(gid, due, commit, (uid,)))
        self.ledger.uncertain.add(uid)  # until the coordinator has finished it
