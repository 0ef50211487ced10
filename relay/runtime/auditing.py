"""The continuous audit inside `relay run` (`audit.enabled`; docs/delivery.md, Proving delivery).

The holder of an outbox's first lane runs it beside its loop: every `audit.every`, it reads
the broker back for the events every lane's checkpoint had passed at least `audit.delay`
ago (the time the broker needs to settle), from the outbox's audit position on, with the
same audit as `relay audit` (relay/fleet/audit.py). The position, and what each round
found, is kept in `relay.audits` with writes fenced by the first lane's lock, so that a
restart or a takeover resumes where the last round stopped and a replica that lost the lane
cannot move it. Each missing message is logged, counted by destination and shown by
`relay status`; with `audit.repair` it is parked (reason `missing`) and published again by
retry-parked on its lane, and the position stays before it until a round finds it there.

Nothing here stops the lane: a broker that cannot be read back, or a round that fails, is
logged and tried again at the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from relay.brokers import create_prober, create_reader
from relay.config.audit import AuditConfig
from relay.core.audit import Finding
from relay.core.lane_state import OutboxState
from relay.core.readback import Reader
from relay.core.waiting import sleep_unless
from relay.errors import CannotReadBack, RelayError
from relay.fleet.audit import Auditor, AuditReport, Outbox
from relay.postgres.audits import AuditLog
from relay.postgres.command_queue import CommandKind, CommandQueue, CommandRequest
from relay.postgres.database import Database
from relay.postgres.lease import Lease
from relay.runtime.context import OutboxContext

T = TypeVar("T")
SHOWN = 5  # findings a round keeps in relay.audits for `relay status`
SHARE = 0.1  # of the event loop the audit takes while the first lane relays
MAX_REST = 1.0  # seconds it rests after one step, at most
REPORTED_KEPT = 100_000  # missing ids remembered while a repair is verified
LISTED = 10_000  # missing messages a round lists (and repairs); the rest only counted
REPAIR_AGAIN = 60.0  # seconds before a repair not landed yet is asked for again


class ContinuousAudit:
    """One outbox's continuous audit, on the holder of its first lane."""

    def __init__(self, context: OutboxContext, lease: Lease, db: Database) -> None:
        self.ctx = context
        self.lease = lease
        self.db = db
        self.outbox = context.lane.outbox
        self.settings: AuditConfig = context.config.audit
        self.audits = AuditLog(context.relay_config.database.schema_)
        self.commands = CommandQueue(context.relay_config.database.schema_)
        self.log = structlog.get_logger("relay.audit").bind(outbox=self.outbox)
        self._seen: deque[tuple[float, int]] = deque()  # (monotonic time, lowest checkpoint)
        self._first: int | None = None  # the lowest checkpoint this holder saw first
        self._reported: set[str] = set()  # missing ids counted already (a repair pending)
        self._repaired_at: dict[str, float] = {}  # missing id -> when its repair was asked
        self._behind_since: float | None = None  # when it last fell behind the checkpoints
        self._failing = False
        self._pace = _Pacer(context.state)

    async def run(self, stop: asyncio.Event, claimed_at: int) -> None:
        """Audit round after round until `stop` is set (or the task is cancelled).

        `claimed_at`: the first lane's checkpoint when this holder claimed it. An outbox
        audited for the first time is audited from there (or from a lower lane's
        checkpoint): what this holder relays is audited, the history before it is not
        (`relay audit` reads that)."""
        self._first = claimed_at
        config = self.ctx.relay_config
        try:
            reader = create_reader(self.ctx.config.broker, config.brokers[self.ctx.config.broker])
        except (CannotReadBack, RelayError) as exc:
            self.log.error(
                "audit.enabled, but the outbox's broker cannot be read back: no audit",
                reason=str(exc),
            )
            return
        refusal = create_prober(self.ctx.config.broker, config.brokers[self.ctx.config.broker])
        auditor = Auditor(
            config,
            self.outbox,
            reader,
            skew=self.settings.clock_skew,
            listed=LISTED,
            refusal=refusal.refusal,
        )
        metrics = self.ctx.metrics
        metrics.audit_checked.labels(self.outbox)
        for rules in self.ctx.config.rules(self.outbox).values():  # at 0: alerts see them
            for rule in rules:
                metrics.audit_missing.labels(self.outbox, rule.config.destination)
        try:
            while True:
                await self._round_or_say_why(auditor, reader)
                if not await sleep_unless(stop, self.settings.every):
                    return
        finally:
            await reader.close()
            for gauge in (metrics.audit_position, metrics.audit_lag):
                with contextlib.suppress(KeyError):
                    gauge.remove(self.outbox)

    async def _round_or_say_why(self, auditor: Auditor, reader: Reader) -> None:
        """One round; one that fails is said (the log, relay status) and tried again at the
        next, whatever the error: a round that met a bug must not end the audit for good."""
        try:
            await self._round(auditor, reader)
        except Exception as exc:  # any: the audit goes on, and says why
            why = str(exc) if isinstance(exc, RelayError) else f"{type(exc).__name__}: {exc}"
            if not self._failing:
                self.log.warning(
                    "audit round failed; tried again next round",
                    reason=why,
                    exc_info=None if isinstance(exc, RelayError) else exc,
                )
            self._failing = True
            await self._fenced(
                lambda conn: self.audits.failed(
                    conn, self.outbox, why, self.lease.identity, self.lease.key
                ),
                quiet=True,
            )
        else:
            if self._failing:
                self.log.info("audit rounds succeed again")
            self._failing = False

    async def _round(self, auditor: Auditor, reader: Reader) -> None:
        """Audit what settled since the last round; at most `max_events` events of it."""
        await reader.connect()
        async with self.db.one_shot("audit") as conn:
            running = await auditor.outbox_as_it_runs(conn)
            lowest = min(
                running.checkpoints.get(lane.name, running.start) for lane in running.lanes
            )
            settled = self._settled(lowest)
            row = await self.audits.read(conn, self.outbox)
            if row is None:
                start = self._first if self._first is not None else lowest
                await self._fenced(
                    lambda c: self.audits.begin(
                        c, self.outbox, start, self.lease.identity, self.lease.key
                    )
                )
                row = await self.audits.read(conn, self.outbox)
                if row is None:
                    return  # the lane's lock is gone: the next holder begins
            position = row.position
            if settled is not None and settled > position:
                upto = await auditor.source.nth_after(
                    conn,
                    position,
                    settled,
                    self.settings.max_events,
                    aggregates=auditor.outbox_config.aggregates,
                    types=list(auditor.outbox_config.messages),
                )
                upto = settled if upto is None else upto
                report = await auditor.audit(conn, position, upto, running, pace=self._pace)
                position = await self._settle(conn, auditor, report, running, (position, upto))
            await self._measure(conn, auditor, lowest, position)

    def _settled(self, lowest: int) -> int | None:
        """The lowest checkpoint seen at least `delay` ago: what the audit may read back."""
        now = time.monotonic()
        self._first = lowest if self._first is None else min(self._first, lowest)
        self._seen.append((now, lowest))
        delay = self.settings.delay
        while len(self._seen) > 1 and now - self._seen[1][0] >= delay:
            self._seen.popleft()
        first_time, first = self._seen[0]
        return first if now - first_time >= delay else None

    async def _settle(
        self,
        conn: Any,
        auditor: Auditor,
        report: AuditReport,
        running: Outbox,
        audited: tuple[int, int],
    ) -> int:
        """Say what the round found, repair it if asked, and move the audit's place past
        `audited`, (after, upto]."""
        position, upto = audited
        metrics = self.ctx.metrics
        missing = report.tally.missing
        # Found before (in memory), or by an earlier holder (parked for its repair): logged
        # and counted once.
        new = [f for f in missing if not f.known and f.id not in self._reported]
        for finding in new:
            self.log.error(
                "audit: message missing from the broker",
                position=finding.position,
                message_id=finding.id,
                destination=finding.destination,
                partition=finding.lane,
                reason=finding.reason,
            )
            metrics.audit_missing.labels(self.outbox, finding.template).inc()
        beyond = report.missing - len(missing)  # counted, not listed (more than `listed`)
        if beyond > 0:
            self.log.error("audit: more messages missing than listed", count=beyond)
        metrics.audit_checked.labels(self.outbox).inc(report.tally.total.expected)
        reach = upto
        if report.repair_pending is not None:  # a repair not landed yet: come back to it
            reach = report.repair_pending - 1
        if missing:
            if self.settings.repair:
                due = await self._due(auditor.reader, missing)
                if due:
                    await self._repair(conn, auditor, due, running)
                reach = min(reach, min(f.position for f in missing) - 1)  # to see it landed
            if len(self._reported) < REPORTED_KEPT:
                self._reported.update(f.id for f in new)
        elif report.repair_pending is None:
            self._reported.clear()
            self._repaired_at.clear()
        reach = max(reach, position)
        shown = [f.as_json() for f in new[:SHOWN]]
        await self._fenced(
            lambda c: self.audits.record(
                c,
                self.outbox,
                reach,
                checked=report.tally.total.expected,
                missing=len(new) + max(beyond, 0),
                examples=shown,
                auditor=self.lease.identity,
                key=self.lease.key,
            )
        )
        return reach

    async def _due(self, reader: Reader, missing: list[Finding]) -> list[Finding]:
        """The missing messages to repair this round: each once per `REPAIR_AGAIN`, or per
        its destination's duplicate window if longer (a re-send within it is dropped), so
        that a repair still waiting is not asked for again each round."""
        now, windows = time.monotonic(), {}
        due = []
        for finding in missing:
            if finding.destination not in windows:
                window = await reader.duplicate_window(finding.destination)
                windows[finding.destination] = max(REPAIR_AGAIN, window or 0.0)
            if now - self._repaired_at.get(finding.id, -math.inf) >= windows[finding.destination]:
                due.append(finding)
        if len(self._repaired_at) < REPORTED_KEPT:
            self._repaired_at.update((f.id, now) for f in due)
        return due

    async def _repair(
        self, conn: Any, auditor: Auditor, missing: list[Finding], running: Outbox
    ) -> None:
        """Park them (reason `missing`) and ask each lane's holder to retry them."""
        by_lane = await auditor.park_missing(conn, missing)
        lanes = {lane.name: lane for lane in running.lanes}
        for name, ids in by_lane.items():
            if name in lanes and ids:
                request = CommandRequest(
                    lanes[name], CommandKind.RETRY_PARKED, {"ids": ids}, self.lease.identity
                )
                await self.commands.submit(conn, request)
        self.log.warning(
            "audit: missing messages parked and handed to retry-parked",
            count=sum(len(ids) for ids in by_lane.values()),
        )

    async def _measure(self, conn: Any, auditor: Auditor, lowest: int, position: int) -> None:
        metrics = self.ctx.metrics
        metrics.audit_position.labels(self.outbox).set(position)
        now = time.monotonic()
        if position >= lowest:
            self._behind_since = None
            lag = 0.0
        elif auditor.source.queries.pending_age is not None:
            lag = await auditor.source.pending_age(conn, position)
        else:  # without created_at: how long it has been behind the checkpoints
            self._behind_since = self._behind_since or now
            lag = now - self._behind_since
        metrics.audit_lag.labels(self.outbox).set(lag)

    async def _fenced(
        self, write: Callable[[Any], Awaitable[T]], *, quiet: bool = False
    ) -> T | None:
        """One write on the lease connection, shielded: cancelling the audit (the lane
        stopping) must not cut a statement there, which would drop every lane's lock."""

        async def statement() -> T:
            async with self.lease.statement() as conn:
                return await write(conn)

        task = asyncio.ensure_future(statement())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.gather(task, return_exceptions=True)  # it ends before the audit does
            raise
        except RelayError:
            if quiet:
                return None
            raise


class _Pacer:
    """While the first lane relays (a backlog, a retry), the audit rests after each step
    for nine times as long as the step took, so that it takes about a tenth of the event
    loop the relay runs on; once the lane is idle, it runs free. A step's time counts
    whatever else the loop ran meanwhile, so under load it rests more, never less."""

    def __init__(self, state: OutboxState) -> None:
        self.state = state
        self.mark = time.monotonic()

    async def __call__(self) -> None:
        busy = time.monotonic() - self.mark
        rest = busy * (1 - SHARE) / SHARE if self.state.activity != "idle" else 0.0
        await asyncio.sleep(min(rest, MAX_REST))
        self.mark = time.monotonic()
