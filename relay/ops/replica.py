"""One outbox, as seen by one replica: stand by, take the lease, relay while it holds.

    standby --try lock--> holder --lease lost / fenced--> standby
       ^                    |
       +---- released <-----+ (on stop: stop publishing, last checkpoint, unlock, close)

While holding, the relay loop and the lease watch run side by side. If the
watch cannot prove the lease, the loop is cancelled at once: the in-flight
batch is abandoned without a checkpoint and the replica goes back to standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import asyncpg
import structlog

from relay.config import OutboxConfig
from relay.core.retry import Backoff
from relay.core.state import OutboxState
from relay.core.waiting import sleep_unless, wait_any
from relay.errors import DatabaseError, FencedError
from relay.ops.outbox import DB_ERRORS, OutboxRelay, Session
from relay.postgres.database import Database
from relay.postgres.lease import Lease, LeaseBudget
from relay.postgres.source import EventSource
from relay.postgres.store import ClaimedOutbox, Store


class OutboxReplica:
    def __init__(
        self,
        relay: OutboxRelay,
        *,
        config: OutboxConfig,
        lease: Lease,
        budget: LeaseBudget,
        db: Database,
        store: Store,
        source: EventSource,
        lease_wake: asyncio.Event,
        stop: asyncio.Event,
    ) -> None:
        self.relay = relay
        self.name = relay.name
        self.config = config
        self.lease = lease
        self.budget = budget
        self.db = db
        self.store = store
        self.source = source
        self.lease_wake = lease_wake
        self.stop = stop
        self.state: OutboxState = relay.state
        self.log = structlog.get_logger("relay.postgres.lease").bind(outbox=self.name)

    async def run(self) -> None:
        """Until `stop`: hold the lease when it can be had, stand by otherwise."""
        backoff, attempt = Backoff(self.config.retry), 0
        try:
            while not self.stop.is_set():
                try:
                    if await self._acquire():
                        await self._hold()
                    else:
                        await self._stand_by()
                    attempt = 0
                except (DatabaseError, *DB_ERRORS) as exc:
                    attempt += 1
                    await self._disconnected(exc, backoff.delay(attempt), attempt)
        finally:
            await self.lease.release()
            self.state.set(role="stopped", activity="stopped")

    async def _acquire(self) -> bool:
        if not self.budget.try_take():
            return False
        try:
            got = await self.lease.try_acquire()
        finally:
            if not self.lease.held:
                self.budget.give()
        return got

    async def _stand_by(self) -> None:
        holder = await self.lease.holder()
        if holder is not None and holder.identity != self.state.holder:
            self.log.info("standing by", holder=holder.identity)
        self.state.set(
            role="standby",
            activity="idle",
            holder=holder.identity if holder else None,
            held_since=None,
            epoch=None,
        )
        if holder is not None and await self.lease.take_over_if_silent(holder):
            return  # its session is gone: try again at once
        self.lease_wake.clear()
        await wait_any(self.stop, self.lease_wake, within=self.lease.config.retry_interval)

    async def _hold(self) -> None:
        fenced = False
        try:
            session = await self._claim()
            reason = await self._relay_while_held(session)
        except FencedError as exc:
            reason = str(exc)
            fenced = True
        except DatabaseError as exc:
            if not self.lease.connection_lost():
                await self.lease.release()
                self.budget.give()
                raise
            reason = f"lease connection lost: {exc}"
        except BaseException:
            await self.lease.release()
            self.budget.give()
            raise
        if reason is None:  # stopped gracefully
            await self.lease.release()
            self.budget.give()
            self.log.info("lease released")
            self._transition("released")
            return
        self.lease.abandon()
        self.budget.give()
        self.state.set(role="standby", activity="idle", holder=None, last_error=reason)
        self.log.error("lease lost: stopped publishing, back to standby", reason=reason)
        self._transition("fenced" if fenced else "lost")
        # A replica that just lost its lease is the suspect one: let a healthy standby
        # (which retries every retry_interval) take over first.
        await sleep_unless(self.stop, 2 * self.lease.config.retry_interval)

    async def _claim(self) -> Session:
        async with self.lease.statement() as conn:
            await self.source.check(conn)
            start, start_xmin = await self.source.start_point(conn, self.config.start)
            claim = await self.store.claim(
                conn, self.name, self.lease.identity, start, self.lease.key, start_xmin=start_xmin
            )
            await self.relay.commands.abandon_running(conn, self.name)
        reader = await self.db.connect("reader")
        self.state.set(
            role="holder",
            holder=self.lease.identity,
            held_since=time.time(),
            epoch=claim.epoch,
            checkpoint=claim.position,
            activity="relaying",
            last_error=None,
        )
        self.log.info("lease acquired: relaying", epoch=claim.epoch, checkpoint=claim.position)
        self._transition("acquired")
        async with self.lease.statement() as conn:
            parked = await self.store.parked_count(conn, self.name)
        self.relay.metrics.parked.labels(self.name).set(parked)
        return Session(reader=reader, checkpoint=ClaimedOutbox(self.store, self.lease, claim))

    async def _relay_while_held(self, session: Session) -> str | None:
        """Relay until stopped (None) or until the lease is lost (why)."""
        relaying = asyncio.create_task(self.relay.run(session), name=f"relay:{self.name}")
        watching = asyncio.create_task(
            self.lease.watch(session.checkpoint.claim.epoch), name=f"lease:{self.name}"
        )
        try:
            done, _ = await asyncio.wait({relaying, watching}, return_when=asyncio.FIRST_COMPLETED)
            if watching in done:
                # Stop publishing first; closing the sockets makes any statement stuck
                # on a dead path fail at once instead of at the next keepalive.
                self.lease.abandon()
                session.reader.terminate()
                relaying.cancel()
                await asyncio.gather(relaying, return_exceptions=True)
                return watching.result()
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            relaying.result()  # FencedError or DatabaseError propagate from here
            return None
        finally:
            for task in (relaying, watching):
                task.cancel()
            await asyncio.gather(relaying, watching, return_exceptions=True)
            await _close(session.reader)

    def _transition(self, event: str) -> None:
        """Count the lease change; only a holder reports lag and parked gauges."""
        metrics = self.relay.metrics
        metrics.lease_transitions.labels(self.name, event).inc()
        holding = event == "acquired"
        metrics.lease_held.labels(self.name).set(1 if holding else 0)
        if not holding:
            for gauge in (metrics.lag_events, metrics.lag_seconds, metrics.parked):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.name)
            metrics.retrying.labels(self.name).set(0)
            metrics.halted.labels(self.name).set(0)  # the next holder says so, if still true

    async def _disconnected(self, exc: BaseException, delay: float, attempt: int) -> None:
        if self.state.role == "holder":
            self._transition("released")
        self.lease.abandon()
        self.state.set(role="standby", activity="disconnected", last_error=str(exc))
        self.log.warning(
            "database unavailable, retrying",
            error=str(exc),
            attempt=attempt,
            retry_in=round(delay, 3),
        )
        await sleep_unless(self.stop, delay)


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), timeout=2)
    except Exception:  # noqa: BLE001 - a broken reader is dropped either way
        conn.terminate()
