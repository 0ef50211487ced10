"""Leases: one relaying replica per outbox, through a session advisory lock.

The lock lives on a dedicated connection, opened directly (never pooled, never
recycled while held), with server-side keepalives so that Postgres frees a
dead holder's lock within seconds. Standbys poll `pg_try_advisory_lock`
(never the blocking form: a dead standby could be granted the lock and sit on
it) and only until it succeeds, because session locks stack.

The holder proves every `check_interval` that its own backend still holds the
lock, and stamps a heartbeat while doing so. If the proof fails or times out
it stops publishing at once. A standby that finds the heartbeat older than
`takeover_after` (by the database clock) terminates the silent holder's
session: that covers what keepalives cannot see, such as a paused process or
a path that swallows packets but keeps the socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import structlog

from relay.config import LeaseConfig
from relay.errors import DatabaseError
from relay.postgres.database import CONNECTION_LOST, Database
from relay.postgres.sql import holds_lock, lock_holder, quote

LEASE_CHANNEL = "relay_lease"


def lease_channel_key(namespace: str, outbox: str) -> str:
    """The NOTIFY payload that tells standbys this outbox's lease was released."""
    return f"{namespace}/{outbox}"


def lock_key(namespace: str, outbox: str) -> int:
    """A stable signed 64-bit key: the first 8 bytes of SHA-256 of `namespace/outbox`."""
    digest = hashlib.sha256(f"{namespace}/{outbox}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease, seen from a standby."""

    pid: int
    identity: str
    heartbeat_age: float | None


async def holder_identity(conn: asyncpg.Connection, key: int) -> str | None:
    """The identity of the replica (or CLI) whose session holds lock `key`, if any."""
    row = await conn.fetchrow(lock_holder("$1"), key)
    if row is None:
        return None
    return str(row["application_name"]).removesuffix(":lease") or f"pid {row['pid']}"


class LeaseLost(Exception):
    """Raised inside the holder when its lease can no longer be proven."""


class Lease:
    """One outbox's lease, as seen by this replica."""

    def __init__(
        self, db: Database, config: LeaseConfig, outbox: str, schema: str, identity: str
    ) -> None:
        self.db = db
        self.config = config
        self.outbox = outbox
        self.identity = identity
        self.key = lock_key(config.namespace, outbox)
        self.conn: asyncpg.Connection | None = None
        self.held = False
        self.lock = asyncio.Lock()  # one statement at a time on the lease connection
        self._checkpoints = f"{quote(schema)}.checkpoints"
        self._holder = lock_holder(
            "$1",
            columns=", extract(epoch FROM now() - c.heartbeat)::float8 AS heartbeat_age",
            join=f" LEFT JOIN {self._checkpoints} c ON c.outbox = $2",
        )
        self._heartbeat = (
            f"UPDATE {self._checkpoints} SET heartbeat = now() WHERE outbox = $1 AND epoch = $2"
            f" AND {holds_lock('$3')} RETURNING true"
        )
        self.log = structlog.get_logger("relay.postgres.lease").bind(outbox=outbox)

    async def _connection(self) -> asyncpg.Connection:
        if self.conn is None or self.conn.is_closed():
            k = self.config.keepalives
            self.conn = await self.db.connect(
                "lease",
                tcp_keepalives_idle=str(int(k.idle)),
                tcp_keepalives_interval=str(int(k.interval)),
                tcp_keepalives_count=str(k.count),
                tcp_user_timeout=str(int(k.dead_after * 1000)),
                client_connection_check_interval=str(int(k.connection_check_interval * 1000)),
                idle_session_timeout="0",
                idle_in_transaction_session_timeout="0",
                statement_timeout="0",
            )
        return self.conn

    async def try_acquire(self) -> bool:
        """One attempt; never blocks on the lock itself."""
        if self.held:
            return True
        async with self.lock:
            conn = await self._connection()
            self.held = bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)", self.key))
        return self.held

    async def holder(self) -> Holder | None:
        """The replica holding this lease now, if any (any connection may ask)."""
        async with self.lock:
            conn = await self._connection()
            row = await conn.fetchrow(self._holder, self.key, self.outbox)
        if row is None:
            return None
        identity = row["application_name"].removesuffix(":lease")
        return Holder(row["pid"], identity, row["heartbeat_age"])

    async def take_over_if_silent(self, holder: Holder) -> Holder | None:
        """Terminate `holder` if its heartbeat is older than `takeover_after`; return it."""
        if holder.heartbeat_age is None:
            return None
        if holder.heartbeat_age < self.config.takeover_after:
            return None
        async with self.lock:
            conn = await self._connection()
            try:
                done = await conn.fetchval("SELECT pg_terminate_backend($1)", holder.pid)
            except asyncpg.InsufficientPrivilegeError as exc:
                self.log.warning("cannot end the silent holder's session", error=str(exc))
                return None
        if done:
            self.log.warning(
                "silent holder's session terminated",
                holder=holder.identity,
                holder_pid=holder.pid,
                heartbeat_age=round(holder.heartbeat_age, 1),
            )
        return holder if done else None

    async def prove(self, epoch: int) -> None:
        """Show, on the lease connection and in time, that this backend holds the lock."""
        try:
            async with asyncio.timeout(self.config.check_timeout), self.lock:
                conn = await self._connection()
                held = await conn.fetchval(self._heartbeat, self.outbox, epoch, self.key)
        except (*CONNECTION_LOST, asyncpg.PostgresError, DatabaseError) as exc:
            # Any refusal counts too: a lease that cannot be proven is not held.
            raise LeaseLost(f"lease check failed: {type(exc).__name__}: {exc}") from exc
        if not held:
            raise LeaseLost("lease check: this connection no longer holds the lock or the epoch")

    async def watch(self, epoch: int) -> str:
        """Prove the lease every `check_interval`; return why, once it is lost."""
        while True:
            await asyncio.sleep(self.config.check_interval)
            try:
                await self.prove(epoch)
            except LeaseLost as exc:
                self.held = False
                return str(exc)

    async def release(self) -> None:
        """Unlock, tell the standbys, and close; a broken connection is just dropped."""
        conn, self.conn = self.conn, None
        was_held, self.held = self.held, False
        if conn is None:
            return
        try:
            async with asyncio.timeout(self.config.check_timeout), self.lock:
                if was_held:
                    await conn.execute("SELECT pg_advisory_unlock($1)", self.key)
                    await conn.execute("SELECT pg_notify($1, $2)", LEASE_CHANNEL, self.channel_key)
                await conn.close()
        except Exception:  # noqa: BLE001 - any failure here means: drop the socket
            conn.terminate()

    def connection_lost(self) -> bool:
        """True when the lease connection is gone, and the lock with it."""
        return self.conn is None or self.conn.is_closed()

    def abandon(self) -> None:
        """Drop the connection without a word: the server frees the lock with the session."""
        conn, self.conn, self.held = self.conn, None, False
        if conn is not None:
            conn.terminate()

    @property
    def channel_key(self) -> str:
        return lease_channel_key(self.config.namespace, self.outbox)

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[asyncpg.Connection]:
        """Use the lease connection for one write (checkpoints are written here)."""
        async with self.lock:
            yield await self._connection()


class LeaseBudget:
    """`lease.max_per_replica`: how many outboxes this replica may hold at once."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def try_take(self) -> bool:
        if self.limit is not None and self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def give(self) -> None:
        self.taken = max(0, self.taken - 1)
