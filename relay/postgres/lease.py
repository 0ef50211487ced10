"""Leases: one relaying replica per lane, through session advisory locks on one connection.

A replica keeps one lease session for every lock it holds or tries, whatever the
number of outboxes and lanes: Postgres checks each lock on its own, so fencing
works per lock on a shared session. The session is a dedicated connection, opened
directly (never pooled), with server-side keepalives so that Postgres frees a dead
replica's locks within seconds. Standbys try their candidate locks with
`pg_try_advisory_lock`, several in one statement and never more than they may
take (never the blocking form: a dead standby could be granted a lock and sit on
it), because session locks stack.

A holder proves every `check_interval` that its backend still holds its lanes'
locks, and stamps their heartbeats while doing so: one statement for every lane the
session holds, which goes ahead of the other statements waiting for the connection,
so that neither the number of lanes nor their checkpoint writes delay it. If the
proof fails or times out every lane stops publishing at once. A standby that finds
the holding session silent for `takeover_after` (by the database clock: its freshest
heartbeat on any lane it holds, or its last statement; knowing neither, its replica's
membership beat on that session) terminates it: that covers what
keepalives cannot see, such as a paused process or a path that swallows packets but
keeps the socket open. The lane's own heartbeat is not enough: until the new holder's
claim stamps it, it is the previous holder's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import structlog

from relay.config import LeaseConfig
from relay.errors import DatabaseError, RelayError
from relay.postgres.database import CONNECTION_LOST, Database, driver_text
from relay.postgres.queries import HOLDER_OF, NOTIFY, lock_wait, statements

LEASE_CHANNEL = "relay_lease"
T = TypeVar("T")


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
    heartbeat_age: float | None  # how long its session has been silent (lease.holders)


async def holder_identity(conn: asyncpg.Connection, key: int) -> str | None:
    """The identity of the replica (or CLI) whose session holds lock `key`, if any."""
    row = await conn.fetchrow(HOLDER_OF, key)
    if row is None:
        return None
    return str(row["application_name"]).removesuffix(":lease") or f"pid {row['pid']}"


class LeaseLost(Exception):
    """Raised inside the holder when its lease can no longer be proven."""


# A claim waits this share of `check_timeout` at most for each lock (the outbox's row of
# the partition set, its lane's checkpoint row): the proofs wait for the claim.
CLAIM_LOCK_WAIT = 0.25


class RowLocked(RelayError):
    """A claim gave up waiting for a row that another session's transaction holds locked
    (a replica frozen or cut off half way through its own claim, say): nothing written."""

    def __init__(self, message: str, holder: str | None) -> None:
        super().__init__(message)
        self.holder = holder  # the locking session (`identity (pid N)`), when known


NOT_HELD = "lease check: this connection no longer holds the lock or the epoch"


def _now() -> float:
    return asyncio.get_running_loop().time()


def _future() -> asyncio.Future[str]:
    return asyncio.get_running_loop().create_future()


@dataclass(slots=True)
class _Watched:
    """A held lock the session proves, at the epoch its lane claimed; `lost` says why not."""

    lane: str
    epoch: int
    proven: float = field(default_factory=_now)  # the last answer that proved it (loop time)
    lost: asyncio.Future[str] = field(default_factory=_future)

    def lose(self, reason: str) -> None:
        if not self.lost.done():
            self.lost.set_result(reason)


async def answered_within(timeout: float, work: Coroutine[Any, Any, T]) -> T:  # noqa: ASYNC109
    """`work`'s result, or TimeoutError when it has none after `timeout` (the work is then
    cancelled, and done with, before this returns).

    An answer the server sent in time, which a busy event loop (64 lanes' batches on two
    cores, say) had not handed over yet when the deadline's timer ran, still counts: the
    loop is given a few turns to read it before the work is cancelled. Under
    `asyncio.timeout` the timer cancelled the work even with the answer in the socket.
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task}, timeout=timeout)
        for _ in range(_TURNS):
            if task.done():
                break
            await asyncio.sleep(0)
        if not task.done():
            raise TimeoutError(f"no answer within {timeout:g}s")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


_TURNS = 8  # event-loop turns that read an answer already received


class LeaseConnection:
    """One process's lease connection: every lock it holds or tries lives on it."""

    def __init__(self, db: Database, config: LeaseConfig, schema: str, identity: str) -> None:
        self.db = db
        self.config = config
        self.identity = identity
        self.conn: asyncpg.Connection | None = None
        self.held: set[int] = set()
        self.suspect = False  # a check timed out: the connection may be silent, not dead
        self.lock = asyncio.Lock()  # one statement at a time on the lease connection
        # Every statement but the proof (and unlocking) queues here before taking `lock`,
        # so a proof waits for the statement in progress only, never for the queue.
        self._line = asyncio.Lock()
        self._watched: dict[int, _Watched] = {}  # the held locks the proofs cover, by key
        self._prover: asyncio.Task[None] | None = None
        self.queries = statements("lease", schema)
        self.log = structlog.get_logger("relay.lease")

    async def _connection(self) -> asyncpg.Connection:
        if self.conn is None or self.conn.is_closed():
            k = self.config.keepalives
            self.held.clear()  # a new session holds nothing
            self.suspect = False
            # Keepalives on both sides, as on every connection (database.py), the lease
            # config's; a check for a vanished client during a statement; and, for a client
            # gone behind a proxy that keeps the server's side open (its keepalives are
            # answered), an end to the session once it has said nothing for far longer than
            # a live one ever does.
            self.conn = await self.db.connect(
                "lease",
                keepalives=k,
                client_connection_check_interval=str(int(k.connection_check_interval * 1000)),
                idle_session_timeout=str(int(self.config.orphan_after * 1000)),
            )
        return self.conn

    @contextlib.asynccontextmanager
    async def statement(self) -> AsyncIterator[asyncpg.Connection]:
        """Use the lease connection for one statement (checkpoints are written here), after
        those queued before it; a proof goes ahead of them.

        A statement that failed on the connection, timed out or was cancelled leaves it
        in an unknown state (asyncpg may still be busy with it): the session is dropped
        at once, before anyone else uses it, and every lock on it is then known gone.

        While the session holds no lock, no proof watches it: a statement there gets
        `takeover_after` to answer. Behind a proxy that stops forwarding but keeps its
        sockets open (its kernel acknowledging, so no keepalive fails), a standby waited
        for its look at the lanes for good, Ready and silent, while its lanes had no holder.
        """
        async with self._line, self.lock:
            conn = await self._connection()
            deadline = None if self.held else self.config.takeover_after
            try:
                async with asyncio.timeout(deadline):
                    yield conn
            except (*CONNECTION_LOST, asyncio.CancelledError) as exc:
                self._broken(
                    conn, f"lease connection lost: {type(exc).__name__}: {driver_text(exc)}"
                )
                raise

    def _broken(self, conn: asyncpg.Connection, reason: str) -> None:
        self.suspect = True
        if self.conn is conn:
            self.abandon(reason)

    async def try_locks(self, keys: Sequence[int], limit: int) -> list[int]:
        """Take free locks among `keys`, in order, at most `limit`, in one statement.

        Rows are produced one at a time and LIMIT stops the scan, so no lock beyond
        `limit` is tried (and none is taken twice: the caller passes only keys it lacks).
        """
        wanted = [k for k in keys if k not in self.held]
        if limit <= 0 or not wanted:
            return []
        async with self.statement() as conn:
            rows = await conn.fetch(self.queries["try_locks"], wanted, limit)
        taken = [int(r["k"]) for r in rows]
        self.held.update(taken)
        return taken

    async def holders(self, keys: Sequence[int], lanes: Sequence[str]) -> dict[int, Holder]:
        """Who holds each of these locks now, with how long the holder's session has been
        silent (not how old the lane's heartbeat is: a holder that has just taken the lock
        has not stamped it yet), in one query."""
        namespace = self.config.namespace
        async with self.statement() as conn:
            rows = await conn.fetch(self.queries["holders"], list(keys), list(lanes), namespace)
        return {
            int(r["key"]): Holder(
                r["pid"], str(r["application_name"]).removesuffix(":lease"), r["heartbeat_age"]
            )
            for r in rows
        }

    def is_other(self, holder: Holder) -> bool:
        """Whether `holder` is a session other than this live one: another replica's, or an
        earlier lease session of this process, lost to it but kept open on the server (by a
        proxy, say), which is judged and ended as any silent holder is. Judged by identity,
        such an orphan was this process's own, and its lanes waited for it for good."""
        conn = self.conn
        return conn is None or conn.is_closed() or holder.pid != conn.get_server_pid()

    async def terminate(self, holder: Holder) -> bool:
        """End a silent holder's session (it frees its locks); False without the right."""
        try:
            async with self.statement() as conn:
                done = bool(await conn.fetchval(self.queries["terminate"], holder.pid))
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

    def watch(self, key: int, lane: str, epoch: int) -> asyncio.Future[str]:
        """Prove this lock with the others from now on; the future says why it was lost.

        Called by the claim, whose statement just proved the lock, while it still has the
        connection: a proof that takes the connection after it covers this lock too.
        """
        watched = self._watched[key] = _Watched(lane, epoch)
        if self._prover is None or self._prover.done():
            self._prover = asyncio.create_task(self._prove_every_interval(), name="lease-proofs")
        return watched.lost

    def unwatch(self, key: int) -> None:
        watched = self._watched.pop(key, None)
        if watched is not None:
            watched.lose("the lease was let go")

    async def _prove_every_interval(self) -> None:
        """One proof for every watched lock, `check_interval` after the oldest proof of one
        (a claim, or the last proof), while there are any."""
        while self._watched:
            oldest = min(w.proven for w in self._watched.values())
            await asyncio.sleep(max(0.0, oldest + self.config.check_interval - _now()))
            try:
                await self.prove()
            except LeaseLost as exc:
                self._lose_all(str(exc))

    async def prove(self) -> None:
        """Show, on the lease connection and in time, that this backend holds every lock
        it watches, at their lanes' epochs; stamp their heartbeats. A lock it no longer
        holds, or whose lane another replica claimed since, is lost on its own."""

        started = _now()
        try:
            # Waiting only for the statement in progress: a proof goes ahead of the line.
            async with asyncio.timeout(self.config.check_timeout):
                await self.lock.acquire()
        except TimeoutError as exc:
            raise self._unproven(exc) from exc
        try:
            watched = dict(self._watched)  # now: every claim made before is among them
            if not watched:
                return
            conn = await self._connection()
            rows = await answered_within(
                max(0.0, started + self.config.check_timeout - _now()),
                conn.fetch(
                    self.queries["heartbeat"],
                    list(watched),
                    [w.lane for w in watched.values()],
                    [w.epoch for w in watched.values()],
                ),
            )
        except (*CONNECTION_LOST, asyncpg.PostgresError, DatabaseError) as exc:
            # Dropped while the lock is still held: no statement may meet the connection
            # half way through a cancelled proof.
            raise self._unproven(exc) from exc
        finally:
            self.lock.release()
        proven, now = {int(r[0]) for r in rows}, _now()
        for key, lock in watched.items():
            if key in proven:
                lock.proven = now
            else:
                self.held.discard(key)
                self._lose(key, lock, NOT_HELD)

    def _unproven(self, exc: BaseException) -> LeaseLost:
        """Any refusal counts too: a lease that cannot be proven is not held, nor is any
        other lock on this connection; drop it before another statement uses it."""
        reason = f"lease check failed: {type(exc).__name__}: {driver_text(exc)}"
        if self.conn is not None:
            self._broken(self.conn, reason)
        return LeaseLost(reason)

    def _lose(self, key: int, watched: _Watched, reason: str) -> None:
        if self._watched.get(key) is watched:
            del self._watched[key]
        watched.lose(reason)

    def _lose_all(self, reason: str) -> None:
        watched, self._watched = self._watched, {}
        for lock in watched.values():
            lock.lose(reason)

    async def unlock(self, key: int, channel_key: str) -> None:
        """Release one lock and tell the standbys; a broken connection drops them all."""
        self.unwatch(key)
        if key not in self.held or self.conn is None:
            self.held.discard(key)
            return
        self.held.discard(key)
        try:  # ahead of the line, as a proof: a hand-over must not wait for every lane's writes
            async with asyncio.timeout(self.config.check_timeout), self.lock:
                await self.conn.execute(self.queries["unlock"], key)
                await self.conn.execute(NOTIFY, LEASE_CHANNEL, channel_key)
        except Exception:  # noqa: BLE001 - any failure here means: drop the socket
            self.abandon("lease connection dropped: unlocking a lease failed")
        except asyncio.CancelledError:
            # Cut off part way, the lock may still be held with no lane watching it, or the
            # connection be mid-statement: either way only dropping the session is sure.
            self.abandon("lease connection dropped: unlocking a lease was cancelled")
            raise

    def forget(self, key: int) -> None:
        """This lock is known lost (not held); the session itself is healthy."""
        self.held.discard(key)
        self.unwatch(key)

    def connection_lost(self) -> bool:
        """True when the lease connection is gone, and every lock with it."""
        return self.conn is None or self.conn.is_closed()

    def abandon(self, reason: str = "lease connection dropped: every lock on it is gone") -> None:
        """Drop the connection without a word: the server frees the locks with the session,
        and every lane that held one is told at once."""
        conn, self.conn = self.conn, None
        self.held.clear()
        self._lose_all(reason)
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        """Close the session; a lock still held is freed with it."""
        conn, self.conn = self.conn, None
        self.held.clear()
        self._lose_all("the lease session was closed")
        if self._prover is not None:
            self._prover.cancel()
            await asyncio.gather(self._prover, return_exceptions=True)
        if conn is None:
            return
        try:
            await asyncio.wait_for(conn.close(), timeout=self.config.check_timeout)
        except Exception:  # noqa: BLE001 - any failure here means: drop the socket
            conn.terminate()


class Lease:
    """One lane's lease, on this process's lease session."""

    def __init__(self, session: LeaseConnection, lane: str) -> None:
        self.session = session
        self.config = session.config
        self.outbox = lane  # the lane's name: the checkpoint row it fences
        self.identity = session.identity
        self.key = lock_key(self.config.namespace, lane)
        self.log = structlog.get_logger("relay.lease").bind(outbox=lane)
        self._lost: tuple[int, asyncio.Future[str]] | None = None  # the claim's epoch, why lost

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
        """Terminate `holder` if its session has been silent for `takeover_after` and is not
        this live session (an orphan of this process is ended too); return it."""
        if holder.heartbeat_age is None or holder.heartbeat_age < self.config.takeover_after:
            return None
        if not self.session.is_other(holder):
            return None  # this very session: never ended by itself
        return holder if await self.session.terminate(holder) else None

    def claimed(self, epoch: int) -> None:
        """The claim at `epoch` just proved the lock: the session's proofs cover it now.

        Call it while the claim still has the lease connection (see LeaseConnection.watch).
        """
        self._lost = epoch, self.session.watch(self.key, self.outbox, epoch)

    async def watch(self, epoch: int) -> str:
        """Until the session's proofs (every `check_interval`) find the lease lost: why."""
        if self._lost is None or self._lost[0] != epoch:
            self.claimed(epoch)  # not claimed through holding.claim: covered from now on
        assert self._lost is not None
        return await asyncio.shield(self._lost[1])

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

    @contextlib.asynccontextmanager
    async def claiming(self, outbox: str, *, bounded: bool) -> AsyncIterator[asyncpg.Connection]:
        """The claim's transaction on the lease connection.

        `bounded` (a replica's claim): each wait for a row lock lasts `CLAIM_LOCK_WAIT` of
        `check_timeout` at most, then RowLocked. The replica's every lane shares the
        connection: a claim waiting for a frozen session's row would hold up their proofs
        (which then fail), their checkpoints and the standby checks that end that session.
        """
        async with self.session.statement() as conn:
            try:
                async with conn.transaction():
                    if bounded:
                        wait = self.config.check_timeout * CLAIM_LOCK_WAIT
                        await conn.execute(lock_wait(wait))
                    yield conn
            except asyncpg.LockNotAvailableError as exc:
                holder = await self._row_holder(conn, outbox)
                raise RowLocked(
                    f"outbox {outbox!r}: its row of the partition set (or the lane's checkpoint"
                    f" row) is locked by {holder or 'another session'}; the claim gave up: {exc}",
                    holder,
                ) from exc

    async def _row_holder(self, conn: asyncpg.Connection, outbox: str) -> str | None:
        """Who locks the outbox's row, if one transaction does and it may be seen."""
        with contextlib.suppress(asyncpg.PostgresError):
            row = await conn.fetchrow(self.session.queries["row_holder"], outbox)
            if row is not None:
                name = str(row["application_name"] or "").removesuffix(":lease")
                return f"{name or 'a session'} (pid {row['pid']})"
        return None


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
