"""An audit of one outbox: what should be in the broker, read back from it.

The range of stored events is mapped through the current config exactly as `relay run`
maps it, into the messages the relay should have published (each event up to its lane's
checkpoint, after the outbox's start). Parked messages are counted as parked, `when`
rejections as skipped. Each destination is then read back through the broker's `Reader`
and matched by id (relay/core/audit.py). The range is taken in chunks of
`chunk` expected messages, each read back on its own, so that memory stays bounded
whatever the range; the broker is read from the chunk's first event's time on.

Used by `relay audit` (the CLI) and by the continuous audit inside `relay run`; neither
holds a lease to audit: the checkpoints are read first, and every message up to them
was acknowledged before they were written.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg

from relay.config import RelayConfig
from relay.core.audit import Chunk, Expected, Finding, Tally
from relay.core.event import Event
from relay.core.lanes import Lane, lanes_of
from relay.core.publishing import Message
from relay.core.readback import Horizon, Reader
from relay.errors import MappingError, UsageError
from relay.mapping.mapper import Mapper
from relay.postgres.partitions import Partitions
from relay.postgres.source import EventSource
from relay.postgres.store import Store

PAGE = 2_000  # events read from the table at a time
MISSING = "missing"  # the reason a repair parks a missing message with (own_tables.sql)
EXAMPLES = 5  # unmappable events named in a report


@dataclass(frozen=True, slots=True)
class AuditRange:
    """Which events, as the CLI's options give them; none of them: the last 1,000."""

    start: int | None = None  # --from: the first position
    from_start: bool = False
    time: datetime | None = None  # --from-time
    last: int | None = None  # --last N
    to: int | None = None  # --to: the last position


@dataclass(frozen=True, slots=True)
class Outbox:
    """The outbox as it runs: its lanes (the recorded count), their checkpoints, its start."""

    lanes: list[Lane]
    checkpoints: dict[str, int]  # lanes that never ran have none
    start: int  # events at or before it were never to be published (`start: end`)

    @property
    def top(self) -> int:
        return max(self.checkpoints.values(), default=0)


@dataclass(slots=True)
class AuditReport:
    """What an audit found, per destination and in all."""

    outbox: str
    broker: str
    after: int  # the range is (after, upto]
    upto: int
    checkpoints: dict[str, int]
    events: int = 0  # events of the range the outbox maps
    skipped: int = 0  # messages a rule's `when` rejects
    parked: int = 0
    pending: int = 0  # messages of events past their lane's checkpoint: not relayed yet
    unmappable: int = 0  # the current config cannot map them, and nothing parked them
    unmappable_examples: list[str] = field(default_factory=list)
    refused: int = 0  # messages the broker's adapter refuses before sending: never stored
    # The first position an audit parked as missing that is still parked: its repair is
    # handed to retry-parked and has not landed (or failed again) yet.
    repair_pending: int | None = None
    tally: Tally = field(default_factory=Tally)
    chunks: int = 0
    seconds: float = 0.0

    @property
    def missing(self) -> int:
        return self.tally.total.missing

    def as_json(self) -> dict[str, Any]:
        total = self.tally.total
        return {
            "outbox": self.outbox,
            "broker": self.broker,
            "from": self.after + 1,
            "to": self.upto,
            "checkpoints": self.checkpoints,
            "events": self.events,
            "expected": total.expected,
            "found": total.found,
            "parked": self.parked,
            "skipped": self.skipped,
            "pending": self.pending,
            "duplicates": total.duplicates,
            "order_breaks": total.order_breaks,
            "unexplained": total.unexplained,
            "missing_count": total.missing,
            "missing": [f.as_json() for f in self.tally.missing],
            "expired_count": total.expired,
            "expired": [f.as_json() for f in self.tally.expired],
            "shared_ids": self.tally.shared_ids,
            "unmappable": self.unmappable,
            "unmappable_examples": self.unmappable_examples,
            "refused": self.refused,
            "repair_pending": self.repair_pending,
            "destinations": {
                name: counts.as_json() for name, counts in sorted(self.tally.by_destination.items())
            },
            "chunks": self.chunks,
            "seconds": round(self.seconds, 3),
        }


OnProgress = Callable[[int, int], None]  # (events done, events in the range)
Pace = Callable[[], Awaitable[None]]
"""Awaited after each step of an audit (a page of events, a thousand stored messages): where
the continuous audit rests, so that it leaves the relay's event loop to the relay."""
STEP = 1_000  # stored messages seen between two calls of `pace`


class Auditor:
    """Audits one outbox against its broker, through `reader`."""

    def __init__(
        self,
        config: RelayConfig,
        outbox: str,
        reader: Reader,
        *,
        skew: float = 60.0,
        chunk: int = 50_000,
        listed: int = 1_000,
        refusal: Callable[[Message], str | None] | None = None,
    ) -> None:
        self.config = config
        self.outbox = outbox
        self.outbox_config = config.outbox(outbox)  # unknown: a ConfigError
        self.reader = reader
        self.skew = skew
        self.chunk = chunk
        self.listed = listed
        self.mapper = Mapper(outbox, self.outbox_config)
        self.source = EventSource(config.source, metadata=self.mapper.reads_metadata)
        self.store = Store(config.database.schema_)
        self.partitions = Partitions(config.database.schema_)
        # What the broker's adapter refuses before sending (names, headers, sizes it knows).
        self.refusal = refusal
        self._pace: Pace | None = None
        self._types = list(self.outbox_config.messages)
        self._aggregates = self.outbox_config.aggregates
        self._templates = {  # (event type, rule) -> its destination as the config writes it
            (event_type, rule.name): rule.config.destination
            for event_type, rules in self.outbox_config.rules(outbox).items()
            for rule in rules
        }

    async def outbox_as_it_runs(self, conn: asyncpg.Connection) -> Outbox:
        record = await self.partitions.read(conn, self.outbox)
        count = self.outbox_config.partitions if record is None else record.partitions
        lanes = lanes_of(self.outbox, count)
        checkpoints = {}
        for lane in lanes:
            position = await self.store.position(conn, lane.name)
            if position is not None:
                checkpoints[lane.name] = position
        start = 0 if record is None or record.start_position is None else record.start_position
        return Outbox(lanes, checkpoints, start)

    async def resolve(
        self, conn: asyncpg.Connection, chosen: AuditRange, outbox: Outbox
    ) -> tuple[int, int]:
        """The range (after, upto] the options name; UsageError when it makes no sense."""
        if not outbox.checkpoints:
            raise UsageError(f"outbox {self.outbox!r} has never relayed: nothing to audit")
        upto = outbox.top if chosen.to is None else chosen.to
        if chosen.start is not None:
            after = chosen.start - 1
        elif chosen.from_start:
            after = 0
        elif chosen.time is not None:
            first = await self.source.first_position_since(conn, chosen.time)
            after = upto if first is None else first - 1
        else:
            nth = await self.source.nth_back(
                conn, upto, chosen.last or 1_000, aggregates=self._aggregates, types=self._types
            )
            after = 0 if nth is None else nth - 1
        if after >= upto:
            raise UsageError(
                f"nothing to audit: the range starts at position {after + 1}, after its end"
                f" ({upto}{', the furthest checkpoint' if chosen.to is None else ''})"
            )
        return max(after, outbox.start), upto

    async def audit(
        self,
        conn: asyncpg.Connection,
        after: int,
        upto: int,
        outbox: Outbox,
        *,
        on_progress: OnProgress | None = None,
        pace: Pace | None = None,
    ) -> AuditReport:
        """Audit the events in (after, upto] of the outbox as it runs."""
        self._pace = pace
        began = time.monotonic()
        report = AuditReport(
            self.outbox, self.outbox_config.broker, after, upto, dict(outbox.checkpoints)
        )
        report.tally = Tally(listed=self.listed)
        total = await self.source.count(
            conn, after=after, upto=upto, aggregates=self._aggregates, types=self._types
        )
        previous: Chunk | None = None
        pending: list[Expected] = []
        position = after
        while position < upto:
            page = await self.source.read_lanes(
                conn,
                after=position,
                upto=upto,
                limit=PAGE,
                aggregates=self._aggregates,
                types=self._types,
                count=len(outbox.lanes),
            )
            if not page:
                break
            parked = await self.store.parked_keys(
                conn, [lane.name for lane in outbox.lanes], position, page[-1][0].position
            )
            for event, lane_index in page:
                lane = outbox.lanes[lane_index].name
                checkpoint = outbox.checkpoints.get(lane)
                self._expect(event, lane, checkpoint, parked=parked, report=report, out=pending)
                if len(pending) >= self.chunk:
                    previous = await self._next_chunk(previous, pending, report)
                    pending = []
            position = page[-1][0].position
            report.events += len(page)
            if on_progress is not None:
                on_progress(report.events, max(total, report.events))
            if pace is not None:
                await pace()
        if pending or previous is None:
            previous = await self._next_chunk(previous, pending, report)
        await self._settle(previous, report)
        report.seconds = time.monotonic() - began
        return report

    def _expect(
        self,
        event: Event,
        lane: str,
        checkpoint: int | None,
        *,
        parked: dict[tuple[str, int, str], str],
        report: AuditReport,
        out: list[Expected],
    ) -> None:
        """The event's messages, as `relay run` maps them, sorted into what they count as."""
        for rule in self.mapper.rules_for(event):
            reason = parked.get((lane, event.position, rule.name))
            repairing = reason == MISSING  # published once, lost, parked for its repair
            if repairing and report.repair_pending is None:
                report.repair_pending = event.position
            if reason is not None and not repairing:
                report.parked += 1
                continue
            if checkpoint is None or event.position > checkpoint:
                report.pending += 1
                continue
            try:
                message = self.mapper.message(event, rule)
            except MappingError as exc:
                report.unmappable += 1
                if len(report.unmappable_examples) < EXAMPLES:
                    report.unmappable_examples.append(str(exc))
                continue
            if message is None:
                report.skipped += 1
                continue
            if not repairing and self.refusal is not None and self.refusal(message):
                # Refused for good before it is sent (a name, a header, a size the adapter
                # knows): never in the broker, whether it is parked now or was dropped.
                report.refused += 1
                continue
            out.append(
                Expected(
                    message.id,
                    event.position,
                    message.destination,
                    message.key,
                    lane,
                    rule.name,
                    f"{event.aggregate_type}/{event.aggregate_id}@{event.version}",
                    event.created_at,
                    self._templates.get((event.type, rule.name), ""),
                    repairing,
                )
            )

    async def _next_chunk(
        self, previous: Chunk | None, expected: list[Expected], report: AuditReport
    ) -> Chunk:
        """Read the broker back for a new chunk, then settle the one before it (whose
        unexplained messages the new chunk's ids may explain, and the other way round)."""
        chunk = Chunk(expected, self.skew)
        report.chunks += 1
        if previous is not None:
            previous.explain(chunk.ids())
        if chunk.size:
            seen = 0
            async for stored in self.reader.read(chunk.destinations, chunk.since):
                chunk.see(stored)
                seen += 1
                if self._pace is not None and seen % STEP == 0:
                    await self._pace()
        if previous is not None:
            chunk.explain(previous.ids())
            await self._settle(previous, report)
        return chunk

    async def _settle(self, chunk: Chunk, report: AuditReport) -> None:
        horizons: dict[str, Horizon] = {}
        for destination in chunk.unfound_destinations():
            horizons[destination] = await self.reader.horizon(destination)
        report.tally.merge(chunk.settle(horizons, datetime.now(UTC), self.listed))

    async def park_missing(
        self, conn: asyncpg.Connection, found: list[Finding]
    ) -> dict[str, list[int]]:
        """Park each missing message (reason `missing`) so that retry-parked, carried out by
        its lane's holder, publishes it again with the same id; the parked ids, by lane."""
        events = {
            e.position: e for e in await self.source.events_at(conn, [f.position for f in found])
        }
        ids: dict[str, list[int]] = {}
        for finding in found:
            event = events.get(finding.position)
            rule = (
                next((r for r in self.mapper.rules_for(event) if r.name == finding.rule), None)
                if event is not None
                else None
            )
            if event is None or rule is None:
                continue  # gone since, or no longer mapped: the report said what it found
            message = self.mapper.message(event, rule)
            if message is None:
                continue
            ids.setdefault(finding.lane, []).append(
                await self.store.park_missing(
                    conn,
                    finding.lane,
                    event,
                    message,
                    rule=rule.name,
                    error=f"not in {finding.destination!r} when audited: {finding.reason}",
                )
            )
        return ids
