"""`relay check --history`: every stored event of a range through the config, as `relay run`
would map it, before the config is deployed.

One read of the event table for every outbox (in pages, in position order, on a read-only
connection: a replica database will do); each event through each outbox's mapper (its
types, aggregates, `when`, JSON Schemas), each message through its broker's `refusal`
(names, header values and sizes the adapter knows before sending). What comes out is
counted per outbox: published, skipped, or would park by reason, with the first examples.

Ids two events would share are found with bounded memory: a Bloom filter of every id
(16 MiB, whatever the range) names the ids it may have seen before; only if there are any,
a second pass, up to the last of them, counts those ids exactly. Two outboxes on one broker
share a second filter: an id both publish into one scope where the broker keeps only the
first message of an id (a JetStream stream, a FIFO queue: `Probing.dedup_scope`) loses the
other outbox's message.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from relay.brokers import Probing, probe_broker
from relay.config import RelayConfig
from relay.core.event import Event
from relay.errors import MalformedEventError, MappingError, SchemaViolation
from relay.mapping.expressions import static_text
from relay.mapping.mapper import Mapper
from relay.postgres.partitions import Partitions
from relay.postgres.source import EventSource

PAGE = 5_000  # events read at a time
EXAMPLES = 3  # per outcome
BLOOM_BITS = 1 << 27  # 16 MiB: about one false "seen before" in ten million ids at a million
BLOOM_HASHES = 5
SHARED_LISTED = 20  # shared ids named in a report
DESTINATIONS_PROBED = 1_000  # destinations made by the events, asked of the broker

OnProgress = Callable[[int, int], None]  # (events done, events in the range)


@dataclass
class OutboxHistory:
    """One outbox's outcomes over the range."""

    outbox: str
    events: int = 0  # events of the range the outbox maps (its types and aggregates)
    published: int = 0  # messages it would publish
    skipped: int = 0  # messages a rule's `when` rejects
    parked: Counter[str] = field(default_factory=Counter)  # messages it would park, by reason
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    shared: list[dict[str, Any]] = field(default_factory=list)  # ids two events would share
    shared_count: int = 0  # ids shared, all of them
    # ids it shares with another outbox in one of the broker's dedup scopes
    shared_across: list[dict[str, Any]] = field(default_factory=list)
    shared_across_count: int = 0
    before_start: int = 0  # events at or before a `start: end` outbox's recorded start
    # What the broker says of the destinations the events make (a template's): a subject no
    # stream captures holds the outbox back for ever; a key of another type refuses it.
    destinations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def note(self, outcome: str, example: dict[str, Any]) -> None:
        listed = self.examples.setdefault(outcome, [])
        if len(listed) < EXAMPLES:
            listed.append(example)

    @property
    def failing(self) -> bool:
        return (
            bool(self.parked)
            or self.shared_count > 0
            or self.shared_across_count > 0
            or bool(self.destinations)
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "outbox": self.outbox,
            "events": self.events,
            "published": self.published,
            "skipped": self.skipped,
            "would_park": dict(sorted(self.parked.items())),
            "shared_ids": self.shared_count,
            "shared": self.shared,
            "shared_across_outboxes": self.shared_across_count,
            "shared_across": self.shared_across,
            "examples": self.examples,
            "before_start": self.before_start,
            "destinations": self.destinations,
            "notes": self.notes,
        }


class _Bloom:
    """A set that may say "seen" of an id it has not seen (rarely), never the other way."""

    def __init__(self, bits: int = BLOOM_BITS) -> None:
        self.bits = bits
        self.array = bytearray(bits // 8)

    def seen_then_add(self, key: str) -> bool:
        h = hash(key)  # stable within this process, which is all a pass needs
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        seen = True
        array, bits = self.array, self.bits
        for i in range(BLOOM_HASHES):
            bit = (h1 + i * h2) % bits
            byte, mask = bit >> 3, 1 << (bit & 7)
            if not array[byte] & mask:
                seen = False
                array[byte] |= mask
        return seen


@dataclass
class _Walk:
    """One outbox's part in a pass."""

    history: OutboxHistory
    mapper: Mapper
    refusal: Callable[[Any], str | None] | None
    bloom: _Bloom = field(default_factory=_Bloom)
    maybe: set[str] = field(default_factory=set)  # ids the filter said it had seen
    last_maybe: int = 0  # the position where the filter said so last
    start: int = 0  # a `start: end` outbox's recorded start: events up to it are never read
    templated: bool = False  # some rule's destination is made from the event
    made: set[str] = field(default_factory=set)  # the destinations its events make
    # The broker's dedup scope of a destination, when another outbox uses the same broker
    # (None: not looked for); cached per destination, up to DESTINATIONS_PROBED of them.
    dedup_scope: Callable[[str], str | None] | None = None
    scopes: dict[str, str | None] = field(default_factory=dict)

    def scope(self, destination: str) -> str | None:
        if destination in self.scopes:
            return self.scopes[destination]
        assert self.dedup_scope is not None
        scope = self.dedup_scope(destination)
        if len(self.scopes) < DESTINATIONS_PROBED:
            self.scopes[destination] = scope
        return scope


@dataclass
class _Across:
    """Ids that outboxes on one broker may share: a filter keyed by broker and id, made at
    its first use (16 MiB that a config of one outbox a broker never needs)."""

    bloom: _Bloom | None = None
    maybe: set[str] = field(default_factory=set)
    last_maybe: int = 0

    def seen_then_add(self, key: str) -> bool:
        if self.bloom is None:
            self.bloom = _Bloom()
        return self.bloom.seen_then_add(key)


class HistoryCheck:
    """Walks (after, upto] of the event table through every outbox of the config."""

    def __init__(
        self, config: RelayConfig, publishers: dict[str, Probing], *, probe: bool = True
    ) -> None:
        self.config = config
        self.publishers = publishers
        self.probe = probe  # ask the broker about the destinations the events make
        self.walks = [
            _Walk(
                OutboxHistory(name),
                Mapper(name, outbox),
                publishers[outbox.broker].refusal if outbox.broker in publishers else None,
                templated=any(
                    static_text(rule.config.destination) is None
                    for rules in outbox.rules(name).values()
                    for rule in rules
                ),
            )
            for name, outbox in config.outboxes.items()
        ]
        brokers = Counter(outbox.broker for outbox in config.outboxes.values())
        for walk in self.walks:
            broker = config.outboxes[walk.history.outbox].broker
            if brokers[broker] > 1 and broker in publishers:
                walk.dedup_scope = publishers[broker].dedup_scope
        self.across = _Across()
        reads_metadata = any(w.mapper.reads_metadata for w in self.walks)
        self.source = EventSource(config.source, metadata=reads_metadata)
        self._types = sorted({t for o in config.outboxes.values() for t in o.messages})

    async def run(
        self,
        conn: asyncpg.Connection,
        after: int,
        upto: int,
        on_progress: OnProgress | None = None,
    ) -> tuple[list[OutboxHistory], float]:
        """Every outbox's outcomes, and the seconds the walk took."""
        began = time.monotonic()
        await self._starts(conn)
        total = await self.source.count(
            conn, after=after, upto=upto, aggregates=None, types=self._types
        )
        done = 0
        async for page in self._pages(conn, after, upto):
            for event in page:
                for walk in self.walks:
                    self._map(walk, event)
            done += len(page)
            if on_progress is not None:
                on_progress(done, max(done, total))
        for walk in self.walks:
            if walk.maybe:
                await self._count_shared(conn, walk, after)
            if self.probe and walk.made:
                await self._probe_made(walk)
        if self.across.maybe:
            await self._count_across(conn, after)
        return [w.history for w in self.walks], time.monotonic() - began

    async def _starts(self, conn: asyncpg.Connection) -> None:
        """Where each `start: end` outbox started, as its record says (relay.outboxes, when
        the relay's tables are in this database): `relay run` never reads before it."""
        partitions = Partitions(self.config.database.schema_)
        for walk in self.walks:
            if self.config.outboxes[walk.history.outbox].start != "end":
                continue
            try:
                record = await partitions.read(conn, walk.history.outbox)
            except asyncpg.UndefinedTableError:
                record = None
            if record is not None and record.start_position is not None:
                walk.start = record.start_position
            else:
                walk.history.notes.append(
                    "start: end, and no start recorded here (it has not run, or the relay's"
                    " tables are elsewhere): every event of the range is checked"
                )

    async def _probe_made(self, walk: _Walk) -> None:
        """The destinations the events made, each asked of the broker as `relay check` asks
        the fixed ones: a subject no stream captures would hold the outbox back for ever."""
        publisher = self.publishers.get(self.config.outboxes[walk.history.outbox].broker)
        if publisher is None:
            return
        walk.history.destinations = await probe_broker(publisher, sorted(walk.made))
        if len(walk.made) >= DESTINATIONS_PROBED:
            walk.history.notes.append(
                f"the events make more than {DESTINATIONS_PROBED} destinations: the first"
                f" {DESTINATIONS_PROBED} were asked of the broker"
            )

    async def _pages(self, conn: asyncpg.Connection, after: int, upto: int) -> Any:
        position = after
        while position < upto:
            page, _ = await self.source.read(
                conn, after=position, upto=upto, limit=PAGE, aggregates=None, types=self._types
            )
            if not page:
                return
            yield page
            position = page[-1].position

    def _map(self, walk: _Walk, event: Event) -> None:
        rules = walk.mapper.rules_for(event)
        if not rules:
            return
        history = walk.history
        if event.position <= walk.start:
            history.before_start += 1
            return
        history.events += 1
        for rule in rules:
            try:
                message = walk.mapper.message(event, rule)
            except MappingError as exc:
                history.parked[exc.reason] += 1
                history.note(exc.reason, _example(event, rule.name, _error_of(exc)))
                continue
            if message is None:
                history.skipped += 1
                continue
            refused = walk.refusal(message) if walk.refusal is not None else None
            if refused is not None:
                history.parked["rejected"] += 1
                history.note("rejected", _example(event, rule.name, refused))
                continue
            history.published += 1
            if walk.templated and len(walk.made) < DESTINATIONS_PROBED:
                walk.made.add(message.destination)
            if walk.bloom.seen_then_add(message.id):
                walk.maybe.add(message.id)
                walk.last_maybe = event.position
            if walk.dedup_scope is not None and walk.scope(message.destination) is not None:
                key = _across_key(self.config.outboxes[history.outbox].broker, message.id)
                if self.across.seen_then_add(key):
                    self.across.maybe.add(key)
                    self.across.last_maybe = event.position

    async def _count_shared(self, conn: asyncpg.Connection, walk: _Walk, after: int) -> None:
        """The second pass: each id the filter named, counted exactly, with its events."""
        seen: dict[str, list[int]] = {}
        async for page in self._pages(conn, after, walk.last_maybe):
            for event in page:
                for rule in walk.mapper.rules_for(event):
                    try:
                        message = walk.mapper.message(event, rule)
                    except MappingError:
                        continue
                    if message is not None and message.id in walk.maybe:
                        seen.setdefault(message.id, []).append(event.position)
        shared = {i: p for i, p in seen.items() if len(p) > 1}
        walk.history.shared_count = len(shared)
        walk.history.shared = [
            {"id": i, "events": len(p), "positions": p[:5]}
            for i, p in sorted(shared.items(), key=lambda item: item[1][0])[:SHARED_LISTED]
        ]

    async def _count_across(self, conn: asyncpg.Connection, after: int) -> None:
        """The second pass for ids outboxes share: each candidate's messages, grouped by the
        broker's dedup scope of their destinations (asked after `_probe_made`, so a
        template's subjects have their streams); a scope two outboxes publish one id into
        keeps one of them."""
        seen: dict[tuple[str, str], dict[str, list[int]]] = {}  # (id, scope) -> outboxes
        async for page in self._pages(conn, after, self.across.last_maybe):
            for event in page:
                for walk in self.walks:
                    if walk.dedup_scope is not None and event.position > walk.start:
                        self._note_across(walk, event, seen)
        for (message_id, scope), outboxes in sorted(
            seen.items(), key=lambda item: min(min(p) for p in item[1].values())
        ):
            if len(outboxes) < 2:
                continue
            for walk in self.walks:
                mine = outboxes.get(walk.history.outbox)
                if mine is None:
                    continue
                walk.history.shared_across_count += 1
                if len(walk.history.shared_across) < SHARED_LISTED:
                    walk.history.shared_across.append(
                        {
                            "id": message_id,
                            "scope": scope,
                            "with": sorted(o for o in outboxes if o != walk.history.outbox),
                            "positions": mine[:5],
                        }
                    )

    def _note_across(
        self, walk: _Walk, event: Event, seen: dict[tuple[str, str], dict[str, list[int]]]
    ) -> None:
        broker = self.config.outboxes[walk.history.outbox].broker
        assert walk.dedup_scope is not None
        for rule in walk.mapper.rules_for(event):
            try:
                message = walk.mapper.message(event, rule)
            except MappingError:
                continue
            if message is None or _across_key(broker, message.id) not in self.across.maybe:
                continue
            scope = walk.dedup_scope(message.destination)
            if scope is not None:
                positions = seen.setdefault((message.id, scope), {})
                positions.setdefault(walk.history.outbox, []).append(event.position)


def _across_key(broker: str, message_id: str) -> str:
    return f"{broker}\0{message_id}"


def _error_of(exc: MappingError) -> str:
    if isinstance(exc, MalformedEventError):
        return exc.problem
    if isinstance(exc, SchemaViolation):
        return "; ".join(exc.violations[:3])
    return str(exc)


def _example(event: Event, rule: str, error: str) -> dict[str, Any]:
    return {
        "position": event.position,
        "event": f"{event.aggregate_type}/{event.aggregate_id}@{event.version} {event.type}",
        "rule": rule,
        "error": error,
    }
