"""One outbox, as seen by one replica: stand by, take the lease, relay while it holds.

    standby --try lock--> holder --lease lost / fenced--> standby
       ^                    |
       +---- released <-----+ (on stop: stop publishing, last checkpoint, unlock, close)

While holding, the relay loop and the lease watch run side by side (holding.py).
If the watch cannot prove the lease, the loop is cancelled at once: the in-flight
batch is abandoned without a checkpoint and the replica goes back to standby.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import structlog

from relay.config import RetryConfig
from relay.core.retry import Backoff
from relay.core.waiting import sleep_unless, wait_any
from relay.errors import DatabaseError, FencedError
from relay.ops import holding
from relay.ops.context import OutboxContext
from relay.ops.outbox import OutboxRelay, Session
from relay.postgres.database import CONNECTION_LOST, Database
from relay.postgres.lease import Lease, LeaseBudget


class OutboxReplica:
    def __init__(
        self,
        context: OutboxContext,
        *,
        lease: Lease,
        budget: LeaseBudget,
        db: Database,
        reconnect: RetryConfig,
    ) -> None:
        self.ctx = context
        self.name = context.name
        self.lease = lease
        self.budget = budget
        self.db = db
        self.reconnect = reconnect
        self.relay = OutboxRelay(context)
        self.log = structlog.get_logger("relay.lease").bind(outbox=self.name)

    async def run(self) -> None:
        """Until `stop`: hold the lease when it can be had, stand by otherwise."""
        backoff, attempt, stop = Backoff(self.reconnect), 0, self.ctx.stop
        try:
            while not stop.is_set():
                try:
                    if await self._acquire():
                        await self._hold()
                    else:
                        await self._stand_by()
                    attempt = 0
                except (DatabaseError, *CONNECTION_LOST) as exc:
                    attempt += 1
                    await self._disconnected(exc, backoff.delay(attempt), attempt)
        finally:
            await self.lease.release()
            self.ctx.state.stopped()

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
        state = self.ctx.state
        holder = await self.lease.holder()
        if holder is not None and holder.identity != state.holder:
            self.log.info("standing by", holder=holder.identity)
        state.standing_by(holder.identity if holder else None)
        if holder is not None and await self.lease.take_over_if_silent(holder):
            return  # its session is gone: try again at once
        self.ctx.wakes.lease.clear()
        wait = self.lease.config.retry_interval
        await wait_any(self.ctx.stop, self.ctx.wakes.lease, within=wait)

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
                await self._let_go()
                raise
            reason = f"lease connection lost: {exc}"
        except BaseException:
            await self._let_go()
            raise
        if reason is None:  # stopped gracefully
            await self._let_go()
            self.log.info("lease released")
            self._transition("released")
            return
        self.lease.abandon()
        self.budget.give()
        self.ctx.state.lost(reason)
        self.log.error("lease lost: stopped publishing, back to standby", reason=reason)
        self._transition("fenced" if fenced else "lost")
        # A replica that just lost its lease is the suspect one: let a healthy standby
        # (which retries every retry_interval) take over first.
        await sleep_unless(self.ctx.stop, 2 * self.lease.config.retry_interval)

    async def _let_go(self) -> None:
        await self.lease.release()
        self.budget.give()

    async def _claim(self) -> Session:
        ctx = self.ctx
        claimant = holding.Claimant(
            self.name, ctx.config.start, ctx.source, ctx.store, ctx.commands
        )
        claimed = await holding.claim(self.lease, claimant)
        reader = await self.db.connect("reader")
        claim = claimed.claim
        ctx.state.holding(self.lease.identity, claim.epoch, claim.position)
        self.log.info("lease acquired: relaying", epoch=claim.epoch, checkpoint=claim.position)
        self._transition("acquired")
        ctx.metrics.parked.labels(self.name).set(await claimed.parked_count())
        return Session(reader=reader, claimed=claimed)

    async def _relay_while_held(self, session: Session) -> str | None:
        """Relay until stopped (None) or until the lease is lost (why)."""

        def stop_publishing() -> None:
            self.lease.abandon()
            session.reader.terminate()

        try:
            held = await holding.while_held(
                self.lease,
                session.claimed.claim.epoch,
                self.relay.run(session),
                on_lost=stop_publishing,
            )
            return held.lost
        finally:
            await _close(session.reader)

    def _transition(self, event: str) -> None:
        """Count the lease change; only a holder reports lag and parked gauges."""
        metrics = self.ctx.metrics
        metrics.lease_transitions.labels(self.name, event).inc()
        holding_now = event == "acquired"
        metrics.lease_held.labels(self.name).set(1 if holding_now else 0)
        if not holding_now:
            for gauge in (metrics.lag_events, metrics.lag_seconds, metrics.parked):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.name)
            metrics.retrying.labels(self.name).set(0)
            metrics.halted.labels(self.name).set(0)  # the next holder says so, if still true

    async def _disconnected(self, exc: BaseException, delay: float, attempt: int) -> None:
        if self.ctx.state.role == "holder":
            self._transition("released")
        self.lease.abandon()
        self.ctx.state.disconnected(str(exc))
        self.log.warning(
            "database unavailable, retrying",
            error=str(exc),
            attempt=attempt,
            retry_in=round(delay, 3),
        )
        await sleep_unless(self.ctx.stop, delay)


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), timeout=2)
    except Exception:  # noqa: BLE001 - a broken reader is dropped either way
        conn.terminate()
