"""Leases: one relaying replica per lane, through session advisory locks on one connection.

A replica keeps one lease session for every lock it holds or tries, whatever the
number of outboxes and lanes: Postgres checks each lock on its own, so fencing
works per lock on a shared session. The session is a dedicated connection, opened
directly (never pooled), with server-side keepalives so that Postgres frees a dead
replica's locks within seconds. Standbys try their candidate locks with
`pg_try_advisory_lock`, several in one statement and never more than they may
take (never the blocking form: a dead standby could be granted a lock and sit on
it), because session locks stack.

A holder proves every `check_interval` that its backend still holds the lane's
lock, and stamps the lane's heartbeat while doing so. If the proof fails or times
out it stops publishing at once. A standby that finds a heartbeat older than
`takeover_after` (by the database clock) terminates the silent holder's session:
that covers what keepalives cannot see, such as a paused process or a path that
swallows packets but keeps the socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import asyncpg
import structlog

from relay.config import LeaseConfig
from relay.errors import DatabaseError
from relay.postgres.database import CONNECTION_LOST, Database
from relay.postgres.sql import holds_lock, lock_holder, quote

LEASE_CHANNEL = "relay_lease"

_KEY = "((l.classid::bigint << 32) | l.objid::bigint)"


def lease_channel_key(namespace: str, lane: str) -> str:
    """The NOTIFY payload that tells standbys this lane's lease was released."""
    return f"{namespace}/{lane}"


def lock_key(namespace: str, lane: str) -> int:
    """A stable signed 64-bit key: the first 8 bytes of SHA-256 of `namespace/lane`.

    An outbox with one lane keeps the key it always had (`namespace/outbox`).
    """
    digest = hashlib.sha256(f"{namespace}/{lane}".encode()).digest()
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


class LeaseSession:
    """One process's lease connection: every lock it holds or tries lives on it."""

    def __init__(self, db: Database, config: LeaseConfig, schema: str, identity: str) -> None:
        self.db = db
        self.config = config
        self.identity = identity
        self.conn: asyncpg.Connection | None = None
        self.held: set[int] = set()
        self.suspect = False  # a check timed out: the connection may be silent, not dead
        self.lock = asyncio.Lock()  # one statement at a time on the lease connection
        checkpoints = f"{quote(schema)}.checkpoints"
        self._holders = (
            f"SELECT {_KEY} AS key, l.pid, coalesce(a.application_name, '') AS application_name,"
            " extract(epoch FROM now() - c.heartbeat)::float8 AS heartbeat_age"
            " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
            " LEFT JOIN unnest($1::bigint[], $2::text[]) AS w(key, lane) ON w.key = "
            + _KEY
            + f" LEFT JOIN {checkpoints} c ON c.outbox = w.lane"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            f" AND {_KEY} = ANY($1::bigint[])"
        )
        self._heartbeat = (
            f"UPDATE {checkpoints} SET heartbeat = now() WHERE outbox = $1 AND epoch = $2"
            f" AND {holds_lock('$3')} RETURNING true"
        )
        self.log = structlog.get_logger("relay.lease")

    async def _connection(self) -> asyncpg.Connection:
        if self.conn is None or self.conn.is_closed():
            k = self.config.keepalives
            self.held.clear()  # a new session holds nothing
            self.suspect = False
            self.conn = await self.db.connect(
                "lease",
                tcp_keepalives_idle=str(int(k.idle)),
                tcp_keepalives_interval=str(int(k.interval)),
                tcp_keepalives_count=str(k.count),
                tcp_user_timeout=str(int(k.dead_after * 1000)),
                client_connection_check_interval=str(int(k.connection_check_interval * 1000)),
            )
        return self.conn

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[asyncpg.Connection]:
        """Use the lease connection for one statement (checkpoints are written here).

        A statement that failed on the connection, timed out or was cancelled leaves it
        in an unknown state (asyncpg may still be busy with it): the session is dropped
        at once, before anyone else uses it, and every lock on it is then known gone.
        """
        async with self.lock:
            conn = await self._connection()
            try:
                yield conn
            except (*CONNECTION_LOST, asyncio.CancelledError):
                self._broken(conn)
                raise

    def _broken(self, conn: asyncpg.Connection) -> None:
        self.suspect = True
        if self.conn is conn:
            self.abandon()

    async def try_locks(self, keys: Sequence[int], limit: int) -> list[int]:
        """Take free locks among `keys`, in order, at most `limit`, in one statement.

        Rows are produced one at a time and LIMIT stops the scan, so no lock beyond
        `limit` is tried (and none is taken twice: the caller passes only keys it lacks).
        """
        wanted = [k for k in keys if k not in self.held]
        if limit <= 0 or not wanted:
            return []
        async with self.statement() as conn:
            rows = await conn.fetch(
                "SELECT k FROM unnest($1::bigint[]) AS k WHERE pg_try_advisory_lock(k) LIMIT $2",
                wanted,
                limit,
            )
        taken = [int(r["k"]) for r in rows]
        self.held.update(taken)
        return taken

    async def holders(self, keys: Sequence[int], lanes: Sequence[str]) -> dict[int, Holder]:
        """Who holds each of these locks now (with the lane's heartbeat age), in one query."""
        async with self.statement() as conn:
            rows = await conn.fetch(self._holders, list(keys), list(lanes))
        return {
            int(r["key"]): Holder(
                r["pid"], str(r["application_name"]).removesuffix(":lease"), r["heartbeat_age"]
            )
            for r in rows
        }

    async def terminate(self, holder: Holder) -> bool:
        """End a silent holder's session (it frees its locks); False without the right."""
        try:
            async with self.statement() as conn:
                done = bool(await conn.fetchval("SELECT pg_terminate_backend($1)", holder.pid))
        except asyncpg.InsufficientPrivilegeError as exc:
            self.log.warning("cannot end the silent holder's session", error=str(exc))
            return False
        if done:
            self.log.warning(
                "silent holder's session terminated",
                holder=holder.identity,
                holder_pid=holder.pid,
                heartbeat_age=round(holder.heartbeat_age or 0.0, 1),
            )
        return done

    async def prove(self, key: int, lane: str, epoch: int) -> None:
        """Show, on the lease connection and in time, that this backend holds the lock."""
        try:
            async with asyncio.timeout(self.config.check_timeout), self.lock:
                conn = await self._connection()
                held = await conn.fetchval(self._heartbeat, lane, epoch, key)
        except (*CONNECTION_LOST, asyncpg.PostgresError, DatabaseError) as exc:
            # Any refusal counts too: a lease that cannot be proven is not held, nor is
            # any other lock on this connection; drop it before another statement uses it.
            if self.conn is not None:
                self._broken(self.conn)
            raise LeaseLost(f"lease check failed: {type(exc).__name__}: {exc}") from exc
        if not held:
            self.held.discard(key)
            raise LeaseLost("lease check: this connection no longer holds the lock or the epoch")

    async def unlock(self, key: int, channel_key: str) -> None:
        """Release one lock and tell the standbys; a broken connection drops them all."""
        if key not in self.held or self.conn is None:
            self.held.discard(key)
            return
        self.held.discard(key)
        try:
            async with asyncio.timeout(self.config.check_timeout), self.lock:
                await self.conn.execute("SELECT pg_advisory_unlock($1)", key)
                await self.conn.execute("SELECT pg_notify($1, $2)", LEASE_CHANNEL, channel_key)
        except Exception:  # noqa: BLE001 - any failure here means: drop the socket
            self.abandon()

    def forget(self, key: int) -> None:
        """This lock is known lost (not held); the session itself is healthy."""
        self.held.discard(key)

    def connection_lost(self) -> bool:
        """True when the lease connection is gone, and every lock with it."""
        return self.conn is None or self.conn.is_closed()

    def abandon(self) -> None:
        """Drop the connection without a word: the server frees the locks with the session."""
        conn, self.conn = self.conn, None
        self.held.clear()
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        """Close the session; a lock still held is freed with it."""
        conn, self.conn = self.conn, None
        self.held.clear()
        if conn is None:
            return
        try:
            await asyncio.wait_for(conn.close(), timeout=self.config.check_timeout)
        except Exception:  # noqa: BLE001 - any failure here means: drop the socket
            conn.terminate()


class Lease:
    """One lane's lease, on this process's lease session."""

    def __init__(self, session: LeaseSession, lane: str) -> None:
        self.session = session
        self.config = session.config
        self.outbox = lane  # the lane's name: the checkpoint row it fences
        self.identity = session.identity
        self.key = lock_key(self.config.namespace, lane)
        self.log = structlog.get_logger("relay.lease").bind(outbox=lane)

    @property
    def held(self) -> bool:
        return self.key in self.session.held

    @property
    def channel_key(self) -> str:
        return lease_channel_key(self.config.namespace, self.outbox)

    async def try_acquire(self) -> bool:
        """One attempt; never blocks on the lock itself."""
        return self.held or bool(await self.session.try_locks([self.key], 1))

    async def holder(self) -> Holder | None:
        """The replica holding this lease now, if any."""
        return (await self.session.holders([self.key], [self.outbox])).get(self.key)

    async def take_over_if_silent(self, holder: Holder) -> Holder | None:
        """Terminate `holder` if its heartbeat is older than `takeover_after`; return it."""
        if holder.heartbeat_age is None or holder.heartbeat_age < self.config.takeover_after:
            return None
        return holder if await self.session.terminate(holder) else None

    async def watch(self, epoch: int) -> str:
        """Prove the lease every `check_interval`; return why, once it is lost."""
        while True:
            await asyncio.sleep(self.config.check_interval)
            try:
                await self.session.prove(self.key, self.outbox, epoch)
            except LeaseLost as exc:
                return str(exc)

    async def release(self) -> None:
        """Unlock and tell the standbys; the session stays for the other lanes."""
        await self.session.unlock(self.key, self.channel_key)

    def connection_lost(self) -> bool:
        return self.session.connection_lost()

    def abandon(self) -> None:
        """Stop holding at once: drop the whole session if it may be silent (every lane
        on it is then unproven), else just forget this lock."""
        if self.session.suspect or self.session.connection_lost():
            self.session.abandon()
        else:
            self.session.forget(self.key)

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[asyncpg.Connection]:
        async with self.session.statement() as conn:
            yield conn


class LeaseBudget:
    """`lease.max_per_replica`: how many lanes (of all outboxes) this replica may hold."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def reserve(self, wanted: int) -> int:
        """Take up to `wanted` now; how many were taken (give them back with `give`)."""
        granted = max(0, wanted)
        if self.limit is not None:
            granted = min(granted, max(0, self.limit - self.taken))
        self.taken += granted
        return granted

    def free(self) -> int | None:
        """How many more lanes this replica may take; None without a cap."""
        return None if self.limit is None else max(0, self.limit - self.taken)

    def try_take(self) -> bool:
        return self.reserve(1) == 1

    def give(self, count: int = 1) -> None:
        self.taken = max(0, self.taken - count)
