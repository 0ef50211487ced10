"""Matching what the relay should have published against what the broker holds.

The audit maps a range of stored events through the config, as `relay run` would, into
the messages it expects (id, destination, key), and reads each destination back. This
module is the part in between, with no database and no broker: a `Chunk` of expected
messages sees each stored one, and then says which were found, stored more than once,
out of order, missing or expired. Memory is bounded by the chunk: the auditor splits a
long range into chunks and reads the broker again for each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from relay.core.readback import Horizon, Stored

AGE_SLACK = 60.0  # seconds the oldest held may be short of the age limit, and still be it
STRANGERS_KEPT = 10_000
"""Ids of unexplained messages a chunk keeps, to check against its neighbours; past this
many they are counted without a check."""


@dataclass(frozen=True, slots=True)
class Expected:
    """A message the relay should have published: its event's position, lane and rule."""

    id: str
    position: int
    destination: str
    key: str
    lane: str  # the lane that published it (the outbox, or `outbox/2`)
    rule: str  # the rule's name ("" for an event type's single rule)
    event: str  # `aggregate_type/aggregate_id@version`, for a report
    time: datetime | None  # the event's created_at; None without that column
    template: str = ""  # the rule's destination as the config writes it: a metric's label
    known: bool = False  # parked as missing already: its repair has not landed


@dataclass(frozen=True, slots=True)
class Finding:
    """A message the broker does not hold: missing, or expired by its retention."""

    position: int
    id: str
    destination: str
    lane: str
    rule: str
    event: str
    reason: str
    template: str = ""
    known: bool = False  # found missing before, and parked for its repair

    def as_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "id": self.id,
            "destination": self.destination,
            "lane": self.lane,
            "rule": self.rule,
            "event": self.event,
            "reason": self.reason,
            "parked_for_repair": self.known,
        }


@dataclass(slots=True)
class Counts:
    """One destination's figures (or the whole audit's)."""

    expected: int = 0
    found: int = 0
    duplicates: int = 0  # copies beyond the first
    order_breaks: int = 0  # first copies stored before an earlier event's of the same key
    unexplained: int = 0  # held in the range's time, with an id no event of the range has
    missing: int = 0
    expired: int = 0

    def add(self, other: Counts) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class Tally:
    """The whole audit's figures, per destination and in all; findings listed up to `listed`
    (every one is counted)."""

    listed: int = 1_000
    total: Counts = field(default_factory=Counts)
    by_destination: dict[str, Counts] = field(default_factory=dict)
    missing: list[Finding] = field(default_factory=list)
    expired: list[Finding] = field(default_factory=list)
    shared_ids: int = 0  # expected messages whose id another of the range shares

    def destination(self, name: str) -> Counts:
        counts = self.by_destination.get(name)
        if counts is None:
            counts = self.by_destination[name] = Counts()
        return counts

    def note(self, finding: Finding, *, expired: bool) -> None:
        chosen = self.expired if expired else self.missing
        if len(chosen) < self.listed:
            chosen.append(finding)

    def merge(self, chunk_tally: Tally) -> None:
        self.total.add(chunk_tally.total)
        for name, counts in chunk_tally.by_destination.items():
            self.destination(name).add(counts)
        self.shared_ids += chunk_tally.shared_ids
        for finding in chunk_tally.missing:
            self.note(finding, expired=False)
        for finding in chunk_tally.expired:
            self.note(finding, expired=True)


class Chunk:
    """The expected messages of a stretch of positions, matched against what is stored.

    Feed it every stored message of its destinations from `since` on (`see`), then
    `settle` it. Matching is by id: an id stored on another destination than the config's
    counts as missing there (a consumer of the right one never got it), with that reason.
    """

    def __init__(
        self, expected: Sequence[Expected], skew: float, now: datetime | None = None
    ) -> None:
        self._by_id: dict[str, Expected | list[Expected]] = {}
        self.shared_ids = 0
        for message in expected:
            held = self._by_id.get(message.id)
            if held is None:
                self._by_id[message.id] = message
            elif isinstance(held, list):
                held.append(message)
                self.shared_ids += 1
            else:
                self._by_id[message.id] = [held, message]
                self.shared_ids += 2
        self._copies: dict[str, int] = {}
        self._elsewhere: dict[str, str] = {}
        self._last: dict[tuple[str, str], int] = {}  # (destination, key) -> position
        self._order_breaks: dict[str, int] = {}
        self._unexplained: dict[str, int] = {}
        self.strangers: dict[str, str] = {}  # unexplained id -> destination, to check
        self.destinations = sorted({m.destination for m in expected})
        times = [m.time for m in expected if m.time is not None]
        self._skew = timedelta(seconds=skew)
        if times and len(times) == len(expected):
            self.since: datetime | None = _shifted(min(times), -self._skew)
            self._until: datetime | None = _shifted(max(times), self._skew)
            # An event written "in the future" (a clock, a zone, a value set by hand) says
            # nothing of when its message went out: from the oldest the destinations hold.
            future = _shifted(now or datetime.now(UTC), self._skew)
            if future is None or max(times) > future:
                self.since = self._until = None
        else:  # without every event's time, from the oldest the destinations hold
            self.since = self._until = None
        self.size = len(expected)

    def ids(self) -> Iterable[str]:
        return self._by_id.keys()

    def unfound_destinations(self) -> set[str]:
        """The destinations of the messages not found so far: whose horizon to ask for."""
        return {
            (held if isinstance(held, Expected) else held[0]).destination
            for id_, held in self._by_id.items()
            if id_ not in self._copies
        }

    def see(self, stored: Stored) -> None:
        """One stored message, in the broker's order for its destination."""
        held = self._by_id.get(stored.id) if stored.id is not None else None
        if held is None:
            if self._in_span(stored.time):
                if len(self.strangers) < STRANGERS_KEPT and stored.id is not None:
                    self.strangers[stored.id] = stored.destination
                else:
                    self._count(self._unexplained, stored.destination)
            return
        first = held if isinstance(held, Expected) else held[0]
        assert stored.id is not None
        if stored.destination != first.destination:
            self._elsewhere.setdefault(stored.id, stored.destination)
            return
        copies = self._copies.get(stored.id, 0) + 1
        self._copies[stored.id] = copies
        if copies == 1:
            for message in held if isinstance(held, list) else (held,):
                self._in_order(message)

    def explain(self, ids: Iterable[str]) -> None:
        """These ids belong to a neighbouring chunk's events: not strangers after all."""
        for id_ in ids:
            self.strangers.pop(id_, None)

    def settle(self, horizons: Mapping[str, Horizon], now: datetime, listed: int) -> Tally:
        """The chunk's figures, once every stored message has been seen."""
        tally = Tally(listed=listed)
        tally.shared_ids = self.shared_ids
        for destination, count in self._order_breaks.items():
            tally.destination(destination).order_breaks += count
        for destination in self.strangers.values():
            tally.destination(destination).unexplained += 1
        for destination, count in self._unexplained.items():
            tally.destination(destination).unexplained += count
        for id_, held in self._by_id.items():
            messages = held if isinstance(held, list) else (held,)
            copies = self._copies.get(id_, 0)
            for message in messages:
                counts = tally.destination(message.destination)
                counts.expected += 1
                if copies:
                    counts.found += 1
                    continue
                horizon = horizons.get(message.destination)
                reason, expired = self._why(message, horizon, now, self._elsewhere.get(id_))
                if message.known:
                    reason, expired = f"parked for its repair, not published again: {reason}", False
                finding = Finding(
                    message.position,
                    message.id,
                    message.destination,
                    message.lane,
                    message.rule,
                    message.event,
                    reason,
                    message.template,
                    message.known,
                )
                if expired:
                    counts.expired += 1
                else:
                    counts.missing += 1
                tally.note(finding, expired=expired)
            if copies > 1:
                tally.destination(messages[0].destination).duplicates += copies - 1
        for counts in tally.by_destination.values():
            tally.total.add(counts)
        return tally

    def _in_order(self, message: Expected) -> None:
        key = (message.destination, message.key)
        last = self._last.get(key)
        if last is not None and last > message.position:
            self._count(self._order_breaks, message.destination)
        else:
            self._last[key] = message.position

    def _in_span(self, time: datetime | None) -> bool:
        """Whether a message was stored within the chunk's time: one the broker gives no
        time for (RabbitMQ) cannot be told from a message of the events after the range,
        and is never counted as unexplained."""
        if time is None:
            return False
        if self.since is None or self._until is None:
            return True
        return self.since <= time <= self._until

    def _why(
        self,
        message: Expected,
        horizon: Horizon | None,
        now: datetime,
        elsewhere: str | None,
    ) -> tuple[str, bool]:
        """Why a message is not there, and whether the broker's retention explains it."""
        if elsewhere is not None:
            return f"stored on {elsewhere!r}, not on {message.destination!r}", False
        if horizon is None:
            return "not found", False
        if horizon.problem is not None:
            return f"not found: {horizon.problem}", False
        if not self._before(message, horizon):
            return "not found", False
        # Published before the oldest message the destination holds: its retention or its
        # limits may have removed it.
        oldest = f" (oldest held: {horizon.where})" if horizon.where else ""
        if self._aged_out(horizon, now):
            return f"expired: older than the destination's max age{oldest}", True
        if horizon.first is None:
            return "not found: the destination holds no message", False
        if horizon.limits:
            return f"discarded: before the oldest message held, by {horizon.limits}{oldest}", False
        return f"not found: before the oldest message held{oldest}", False

    def _aged_out(self, horizon: Horizon, now: datetime) -> bool:
        """Whether retention by age is what removes the destination's oldest messages now:
        the oldest it holds (or, holding none, the newest it had) is about as old as its
        age limit. A message published before that one is then older than the limit. Not
        judged by the event's time: an event written long before it was published (a
        backlog, a `created_at` set by hand) would pass for expired."""
        if horizon.max_age is None:
            return False
        edge = horizon.first if horizon.first is not None else horizon.last
        slack = self._skew + timedelta(seconds=max(AGE_SLACK, horizon.max_age * 0.1))
        limit = _shifted(now, -timedelta(seconds=horizon.max_age) + slack)
        return edge is not None and limit is not None and edge <= limit

    def _before(self, message: Expected, horizon: Horizon) -> bool:
        """Whether the message went out before the oldest one the destination holds: its
        position is below that one's (the relay publishes in position order), or its event
        was written before that one was stored, by more than the clocks' skew."""
        if horizon.first is None:
            return True
        if horizon.first_id is not None:
            oldest = self._by_id.get(horizon.first_id)
            if oldest is not None:
                first = oldest if isinstance(oldest, Expected) else oldest[0]
                return message.position < first.position
        later = _shifted(message.time, self._skew)
        return later is not None and later < horizon.first

    @staticmethod
    def _count(counts: dict[str, int], destination: str) -> None:
        counts[destination] = counts.get(destination, 0) + 1


def _shifted(when: datetime | None, by: timedelta) -> datetime | None:
    """`when` moved by `by`; None past a datetime's range (a `created_at` of year 1 or 9999,
    as applications write for "no time"), which then counts as not known."""
    if when is None:
        return None
    try:
        return when + by
    except OverflowError:
        return None
