"""One outbox, as seen by one replica: hold a fair share of its lanes, stand by for the rest.

    standby --try lock--> holder --lease lost / fenced--> standby
       ^                    |
       +---- released <-----+ (on stop or hand-over: finish the batch, last checkpoint,
                               unlock, NOTIFY)

Every `retry_interval` (or at once when a lease is released) the replica says it is
alive, counts the live replicas R, and aims at floor(K / R) or ceil(K / R) of the
outbox's K lanes (capped by `lease.max_per_replica`). Below its share it tries the free
lanes' locks in one statement, and ends the session of a holder whose heartbeat is
older than `takeover_after`. Above it (another replica joined) it hands lanes over the graceful
way, at a batch boundary, so the newcomer starts from their checkpoints and nothing
is sent twice. With one lane this is the single lease it always was.

Only replicas that run the outbox with its recorded partition count share its lanes.
A replica configured with another count holds none, says why (status, log, metric) and
waits; once every live replica that runs the outbox says the new count (the last one of
the old count has left in a rolling deploy), it changes the outbox over itself, under
every lane's lock (repartition.py), unless an operator's `relay repartition` set the count.

Each held lane runs in a task of its own (`LaneHolder`): the relay loop and the lease
watch side by side (holding.py). If the watch cannot prove the lease, the loop is
cancelled at once: the in-flight batch is abandoned without a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import Counter

import asyncpg
import structlog

from relay.config import RetryConfig
from relay.config.broker_identity import broker_identity
from relay.core.lanes import balance
from relay.core.retry import Backoff
from relay.core.waiting import sleep_unless, wait_any
from relay.errors import DatabaseError, FencedError
from relay.fleet.repartition import change_over, end_silent_holders
from relay.postgres.database import CONNECTION_LOST, Database
from relay.postgres.lease import Holder, Lease, LeaseBudget, LeaseConnection, RowLocked
from relay.postgres.membership import Member, Membership, change_coming
from relay.postgres.partitions import PartitionsChanged, PartitionSet, mismatch
from relay.runtime import holding
from relay.runtime.auditing import ContinuousAudit
from relay.runtime.context import OutboxContext
from relay.runtime.outbox import Hold, OutboxRelay

# Over its share for this many passes in a row before handing a lane over: a replica
# that is starting (or one that just died) must not set lanes moving back and forth.
_OVER_SHARE_PASSES = 2
# A free lane is left to a replica below its share for this many retry intervals.
_PATIENCE = 3


class NoReader(DatabaseError):
    """A lane's claim could not open the connection it reads on; the lock is let go."""


class LaneHolder:
    """One held lane: claim it, relay it while the lease holds, let it go."""

    def __init__(self, context: OutboxContext, lease: Lease, db: Database) -> None:
        self.ctx = context
        self.name = context.name
        self.lease = lease
        self.db = db
        self.relay = OutboxRelay(context)
        self.log = structlog.get_logger("relay.lease").bind(outbox=self.name)
        # The outbox's continuous audit runs on the holder of its first lane.
        audited = context.config.audit.enabled and context.lane.index == 0
        self.audit = ContinuousAudit(context, lease, db) if audited else None

    async def hold(self) -> str | None:
        """Relay until stopped or handed over (None), or until the lease is lost (why)."""
        fenced = False
        try:
            hold = await self._claim()
            reason = await self._relay_while_held(hold)
        except PartitionsChanged as exc:
            # Another count is recorded (a change since the coordinator last looked): the
            # claim wrote nothing. The coordinator says so on its next pass.
            await self.lease.release()
            self.log.warning("lane not claimed: the outbox's partitions changed", reason=str(exc))
            return None
        except NoReader:
            # No connection to read on (the role or the server at its connection limit, say):
            # nothing was claimed. Let the lock go; the coordinator backs off this lane.
            await self.lease.release()
            raise
        except RowLocked as exc:
            # A frozen or cut-off session holds the row mid-claim: the claim wrote nothing,
            # and the lease connection is free again for the other lanes and for the
            # standby checks that end that session. The coordinator tries again later.
            await self.lease.release()
            self.log.warning(
                "lane not claimed: the outbox's row is locked by another session",
                held_by=exc.holder,
                reason=str(exc),
            )
            return None
        except FencedError as exc:
            reason, fenced = str(exc), True
        except DatabaseError as exc:
            # The lease session may already be a new one (another lane reconnected it):
            # whether this lane's lock survived is what counts.
            if self.lease.held and not self.lease.connection_lost():
                await self.lease.release()
                self._transition("released")
                raise
            reason = f"lease connection lost: {exc}"
        except BaseException:
            await self.lease.release()
            raise
        if reason is None:
            await self.lease.release()
            self.log.info("lease released")
            self._transition("released")
            return None
        if fenced:
            # Fenced by the lane's row (its epoch moved on), the lock itself may still be
            # this session's: forgotten, it stayed held with no lane behind it, and the
            # replica stood by for itself for as long as the session lived.
            await self.lease.release()
        self.lease.abandon()
        self.ctx.state.lost(reason)
        self.log.error("lease lost: stopped publishing, back to standby", reason=reason)
        self._transition("fenced" if fenced else "lost")
        return reason

    async def _claim(self) -> Hold:
        ctx = self.ctx
        broker = broker_identity(ctx.relay_config.brokers[ctx.config.broker])
        claimant = holding.Claimant(
            ctx.lane,
            ctx.config.start,
            ctx.source,
            ctx.store,
            ctx.commands,
            ctx.partitions,
            broker,
        )
        try:
            reader = await self.db.connect("reader")  # the claim's reads go here (holding.py)
        except DatabaseError as exc:
            raise NoReader(str(exc)) from exc
        try:
            claimed = await holding.claim(self.lease, claimant, reader)
            parked = await ctx.store.parked_count(reader, self.name)
        except BaseException:
            await _close(reader)
            raise
        claim = claimed.claim
        ctx.state.holding(self.lease.identity, claim.epoch, claim.position)
        self.log.info("lease acquired: relaying", epoch=claim.epoch, checkpoint=claim.position)
        holding.warn_if_broker_changed(self.log, ctx.lane.outbox, claim)
        holding.warn_if_skip_unreadable(self.log, claim)
        self._transition("acquired")
        if parked is not None:  # None: relay.parked is locked by another session
            ctx.metrics.parked.labels(*ctx.lane.labels).set(parked)
        return Hold(reader=reader, claimed=claimed)

    async def _relay_while_held(self, hold: Hold) -> str | None:
        def stop_publishing() -> None:
            self.lease.abandon()
            hold.reader.terminate()

        try:
            held = await holding.while_held(
                self.lease,
                hold.claimed.claim.epoch,
                self._work(hold),
                on_lost=stop_publishing,
            )
            return held.lost
        finally:
            await _close(hold.reader)

    async def _work(self, hold: Hold) -> None:
        """The lane's loop and, on an audited outbox's first lane, its audit beside it: the
        audit ends with the loop, and an error of its own is logged at once."""
        if self.audit is None:
            return await self.relay.run(hold)
        stop = asyncio.Event()
        claimed_at = hold.claimed.claim.position
        auditing = asyncio.create_task(self.audit.run(stop, claimed_at), name=f"audit:{self.name}")
        auditing.add_done_callback(self._audit_ended)
        try:
            return await self.relay.run(hold)
        finally:
            stop.set()
            auditing.cancel()
            await asyncio.gather(auditing, return_exceptions=True)

    def _audit_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.error("the continuous audit stopped on an error", exc_info=exc)

    def _transition(self, event: str) -> None:
        """Count the lease change; only a holder reports lag and parked gauges."""
        transition(self.ctx, event)


def transition(ctx: OutboxContext, event: str) -> None:
    metrics, labels = ctx.metrics, ctx.lane.labels
    metrics.lease_transitions.labels(*labels, event).inc()
    holding_now = event == "acquired"
    metrics.lease_held.labels(*labels).set(1 if holding_now else 0)
    if not holding_now:
        for gauge in (metrics.lag_events, metrics.lag_seconds, metrics.parked):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        metrics.retrying.labels(*labels).set(0)
        metrics.halted.labels(*labels).set(0)  # the next holder says so, if still true


class OutboxReplica:
    """The coordinator of one outbox's lanes in this replica."""

    def __init__(
        self,
        lanes: list[OutboxContext],
        *,
        session: LeaseConnection,
        budget: LeaseBudget,
        db: Database,
        reconnect: RetryConfig,
        membership: Membership,
        stop: asyncio.Event,
    ) -> None:
        self.lanes = lanes
        self.name = lanes[0].lane.outbox
        self.session = session
        self.budget = budget
        self.db = db
        self.reconnect = reconnect
        self.membership = membership
        self.stop = stop
        self.wake = asyncio.Event()  # a lease of this outbox was released
        self.leases = [Lease(session, ctx.name) for ctx in lanes]
        self.config = session.config
        self.count = len(lanes)  # the partitions its config gives the outbox
        self.partitions = lanes[0].partitions
        self._held: dict[int, asyncio.Task[str | None]] = {}
        self._resting: dict[int, float] = {}  # lost lane -> when it may be tried again
        self._unread: dict[int, int] = {}  # lane -> claims in a row that found no reader
        self._handed: dict[int, float] = {}  # handed-over lane -> when it may be taken back
        self._live = 0  # replicas running the outbox with its count, at the last pass
        self._over = 0
        self._free_since: float | None = None
        self._waiting: tuple[str, ...] | None = None  # why no lane is held, as last said
        self.me = session.identity
        lanes[0].metrics.partitions_mismatch.labels(self.name).set(0)
        if lanes[0].config.audit.enabled:  # an alert sees an audit that no holder runs
            lanes[0].metrics.audit_enabled.labels(self.name).set(1)
        # Start from a different lane on each replica, so that they spread at once.
        self._first = zlib.crc32(session.identity.encode()) % len(lanes)
        self.log = structlog.get_logger("relay.lease").bind(outbox=self.name)

    async def run(self) -> None:
        """Until `stop`: hold a fair share of the lanes, stand by for the others."""
        backoff, attempt = Backoff(self.reconnect), 0
        try:
            while not self.stop.is_set():
                self.wake.clear()  # before the pass: a release during it means another pass
                try:
                    took_over = await self._pass()
                    attempt = 0
                except (DatabaseError, *CONNECTION_LOST) as exc:
                    attempt += 1
                    await self._disconnected(exc, backoff.delay(attempt), attempt)
                    continue
                if took_over:
                    continue  # a silent holder's session is gone: try its lanes at once
                await wait_any(self.stop, self.wake, within=self.config.retry_interval)
        finally:
            await self._let_all_go()

    async def _pass(self) -> bool:
        """One look at the lanes; True if a silent holder was just ended, or the outbox was
        just changed over (then its lanes are free at once)."""
        self._reap()
        members = await self._beat()
        record = await self._record()
        if record is not None and record.partitions != self.count:
            return await self._mismatched(record, members)
        self._matched()
        sharing = {
            m.identity: m.room
            for m in members
            if m.connected and m.outboxes.get(self.name) == self.count
        }
        if len(sharing) < self._live:  # one left: what was handed over may be needed back
            self._handed.clear()
        self._live = len(sharing)
        keys = [lease.key for lease in self.leases]
        holders = await self.session.holders(keys, [ctx.name for ctx in self.lanes])
        holding = Counter(h.identity for k, h in holders.items() if h.identity != self.me)
        holding[self.me] = len(self._held)
        free = [i for i in self._order() if self.leases[i].key not in holders]
        now = time.monotonic()
        if not free:
            self._free_since = None
        elif self._free_since is None:
            self._free_since = now
        waited = now - (self._free_since or now)
        patient = waited < _PATIENCE * self.config.retry_interval
        plan = balance(
            lanes=len(self.lanes), members=sharing, me=self.me, holding=holding, patient=patient
        )
        self._over = self._over + 1 if plan.give else 0
        if self._over >= _OVER_SHARE_PASSES:
            self._hand_over(plan.give)
            self._over = 0
        took_over = await self._stand_by(holders)
        ready = [i for i in free if max(self._resting.get(i, 0.0), self._handed.get(i, 0.0)) <= now]
        await self._take(ready, plan.take)
        return took_over

    async def _beat(self) -> list[Member]:
        async with self.session.statement() as conn:
            return await self.membership.beat(conn, self.config.takeover_after)

    async def _record(self) -> PartitionSet | None:
        async with self.session.statement() as conn:
            return await self.partitions.read(conn, self.name)

    async def _mismatched(self, record: PartitionSet, members: list[Member]) -> bool:
        """The outbox runs with another count: hold nothing of it, say why, and change it
        over once every live replica that runs it says this replica's count (True then)."""
        self._hand_over(len(self._held))  # none: a change needs every lane's lock
        reason = mismatch(self.name, record, self.count)
        others = sorted(
            (m.identity, m.outboxes[self.name])
            for m in members
            if m.identity != self.me and self.name in m.outboxes
        )
        dissent = tuple(f"{who} ({count})" for who, count in others if count != self.count)
        dissent += tuple(
            f"{m.identity} (a heartbeat this release cannot read)"
            for m in members
            if m.speaks_for(self.name)
        )
        for ctx in self.lanes:
            ctx.state.mismatched(reason)
        self.lanes[0].metrics.partitions_mismatch.labels(self.name).set(1)
        coming = change_coming(self.name, record.partitions, record.pinned, members)
        if coming == self.count:  # `members` holds this replica too
            done = await change_over(
                self.session,
                self.lanes[0].relay_config,
                self.name,
                self.count,
                by=self.me,
                expect=record.partitions,
            )
            if done is not None:
                self.log.warning(
                    "partitions changed over: every live replica that runs the outbox says"
                    f" {self.count}",
                    before=done.before,
                    after=done.after,
                    start=done.start,
                    skipped=done.skipped,
                    parked_moved=done.parked_moved,
                )
                return True
            # A lock still held: by a replica on its way out, or by a silent one (no longer
            # live by its heartbeat, so not among the dissent) or a cut-off `relay
            # repartition`, which is ended as a standby ends a lane's silent holder.
            if await end_silent_holders(self.session, self.name, record.partitions, self.count):
                return True
        said = (reason, *dissent)
        if said != self._waiting:
            self._waiting = said
            self.log.warning(
                "not relaying the outbox: it runs with another partition count",
                reason=reason,
                waiting_for=list(dissent) or None,
            )
        return False

    def _matched(self) -> None:
        """The recorded count is this replica's (again): share the lanes."""
        self.lanes[0].metrics.partitions_mismatch.labels(self.name).set(0)
        if self._waiting is not None:
            self._waiting = None
            self.log.info("the outbox runs with this replica's partition count: relaying")

    async def _stand_by(self, holders: dict[int, Holder]) -> bool:
        """Say who holds the lanes this replica does not; end silent holders."""
        took_over = False
        for i, ctx in enumerate(self.lanes):
            if i in self._held:
                continue
            holder = holders.get(self.leases[i].key)
            if holder is not None and holder.identity != ctx.state.holder:
                self.log.info("standing by", lane=ctx.name, holder=holder.identity)
            ctx.state.standing_by(holder.identity if holder else None)
            if holder is not None:
                took_over |= await self.leases[i].take_over_if_silent(holder) is not None
        return took_over

    async def _take(self, free: list[int], wanted: int) -> None:
        """Try the free lanes' locks in one statement, at most `wanted` (and the budget).

        A lane whose task is still here is left out, though its lock looked free: its
        holding ended after this pass collected the ended ones (`_reap`), and started
        again over it, the old task would never be collected, its error never read and
        its place in the budget never given back. The next pass collects it first.
        """
        free = [i for i in free if i not in self._held]
        if not free or wanted <= 0:
            return
        # Reserve the budget first: other outboxes' coordinators share it.
        room = self.budget.reserve(wanted)
        try:
            taken = await self.session.try_locks([self.leases[i].key for i in free], room)
        finally:
            self.budget.give(room)  # what is held is taken back below, one by one
        for i in free:
            if self.leases[i].key in taken and self.budget.try_take():
                self._start(i)

    def _order(self) -> list[int]:
        count = len(self.lanes)
        return [(self._first + n) % count for n in range(count)]

    def _start(self, index: int) -> None:
        assert index not in self._held, f"lane {index} started again before it was collected"
        ctx = self.lanes[index]
        ctx.stop.clear()
        holder = LaneHolder(ctx, self.leases[index], self.db)
        self._held[index] = asyncio.create_task(holder.hold(), name=f"lane:{ctx.name}")

    def _hand_over(self, count: int) -> None:
        """Give `count` lanes back at their next batch boundary, the highest first."""
        for index in sorted(self._held, reverse=True)[:count]:
            ctx = self.lanes[index]
            if not ctx.stop.is_set():
                self.log.info("handing the lane over: another replica joined", lane=ctx.name)
                ctx.stop.set()
                self._handed[index] = time.monotonic() + 2 * self.config.retry_interval

    def _reap(self) -> None:
        """Collect lanes whose holding ended; a lost lane rests before it is tried again."""
        for index, task in list(self._held.items()):
            if not task.done():
                continue
            del self._held[index]
            self.budget.give(1)
            try:
                lost = task.result()  # an unexpected error ends the replica, and says why
            except NoReader as exc:
                self._back_off(index, exc)
                continue
            self._unread.pop(index, None)
            if lost is not None:
                # A replica that just lost a lease is the suspect one: let a healthy
                # standby (which retries every retry_interval) take over first.
                self._resting[index] = time.monotonic() + 2 * self.config.retry_interval

    def _back_off(self, index: int, exc: NoReader) -> None:
        """A claim that found no connection to read on rests its lane, longer each time in
        a row (the database's retry policy): it took the lock and let it go every retry
        interval, and told every lane the database was unavailable, for as long as a
        connection limit held."""
        attempt = self._unread[index] = self._unread.get(index, 0) + 1
        delay = Backoff(self.reconnect).delay(attempt)
        self._resting[index] = time.monotonic() + delay
        self.lanes[index].state.disconnected(str(exc))
        self.log.warning(
            "lane not claimed: no connection for its reads",
            lane=self.lanes[index].name,
            error=str(exc),
            attempt=attempt,
            retry_in=round(delay, 3),
        )

    async def _let_all_go(self) -> None:
        """Stop every held lane the graceful way, then wait for them."""
        for index in self._held:
            self.lanes[index].stop.set()
        tasks = list(self._held.values())
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.budget.give(len(tasks))
            self._held.clear()
            for ctx in self.lanes:
                ctx.state.stopped()

    async def _disconnected(self, exc: BaseException, delay: float, attempt: int) -> None:
        for ctx in self.lanes:
            ctx.state.disconnected(str(exc))
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
