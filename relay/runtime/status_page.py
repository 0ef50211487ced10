"""The status page (`GET /`) and its data (`GET /status.json`), served by every replica.

Any replica shows the whole fleet: it reads it from Postgres as `relay status` does
(`fleet/snapshot.py`). Viewers must not load the database, so one read is shared for a
second (`StatusCache`): ten open tabs, or a hundred, cost one read a second. The lag chart's
15 minutes come from a ring of samples this replica takes every few seconds
(`LagHistory`, filled by `StatusPage.sample`, a task the runner watches like the others):
its cost does not depend on viewers either.

The page's files are package data (`runtime/page/`): no framework, nothing loaded from
outside the pod, every value set as text by the script (never as markup).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from relay import __version__
from relay.core.waiting import sleep_unless
from relay.errors import RelayError
from relay.fleet.snapshot import FleetSnapshot
from relay.fleet.status import OutboxStatus
from relay.redaction import redact

CACHE_FOR = 1.0  # seconds one fleet read is shared among viewers
SAMPLE_EVERY = 5.0  # seconds between two lag samples
HISTORY = 900.0  # seconds of lag samples kept: the chart's 15 minutes
REFRESH = 2.0  # seconds between two refreshes of an open page

# Path -> (file of runtime/page/, content type). `/status.json` is built, not a file.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
    "/favicon.ico": ("favicon.svg", "image/svg+xml"),
    "/status.schema.json": ("status.schema.json", "application/schema+json"),
}


def page_file(name: str) -> bytes:
    """A file of the page, as shipped in the package."""
    return (resources.files("relay.runtime") / "page" / name).read_bytes()


@dataclass(frozen=True, slots=True)
class Cached:
    """The last good read (None before the first) and why the latest failed (None: it did
    not). A failed read keeps the last good one on the page, marked with its time."""

    snapshot: FleetSnapshot | None
    error: str | None


@dataclass(eq=False)
class StatusCache:
    """At most one fleet read per `max_age` seconds, however many ask: the first asker
    reads, the others wait for it and share the result. A failure is kept as long, so that a
    database in trouble is not asked once per viewer either."""

    read: Callable[[], Awaitable[FleetSnapshot]]
    timeout: float
    clock: Callable[[], float] = time.monotonic
    max_age: float = CACHE_FOR
    reads: int = field(default=0, init=False)  # how many reads were made, for the tests
    _cached: Cached = field(default=Cached(None, None), init=False)
    _at: float = field(default=-math.inf, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def get(self) -> Cached:
        if self._fresh():
            return self._cached
        async with self._lock:
            if not self._fresh():  # nobody refreshed it while this one waited
                self._cached = await self._read()
                self._at = self.clock()
        return self._cached

    def _fresh(self) -> bool:
        return self.clock() - self._at < self.max_age

    async def _read(self) -> Cached:
        self.reads += 1
        try:
            async with asyncio.timeout(self.timeout):
                return Cached(await self.read(), None)
        except TimeoutError:
            why = f"reading the fleet's status took longer than {self.timeout:g}s"
        except RelayError as exc:
            why = redact(str(exc))
        return Cached(self._cached.snapshot, why)


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # seconds since the epoch, by the database's clock
    lag_events: int  # the outbox's lanes summed
    lag_seconds: float  # its slowest lane


@dataclass(eq=False)
class LagHistory:
    """Each outbox's lag over the last `span` seconds, one sample per `every` seconds at
    most: a ring per outbox, bounded in time and in length."""

    span: float = HISTORY
    every: float = SAMPLE_EVERY
    _rings: dict[str, deque[Sample]] = field(default_factory=dict, init=False)
    revision: int = field(default=0, init=False)  # counts the calls of `add`

    def add(self, at: float, lanes: list[OutboxStatus]) -> None:
        """The lag of every outbox at `at`; a sample no later than the last one is dropped."""
        self.revision += 1
        by_outbox: dict[str, list[OutboxStatus]] = {}
        for lane in lanes:
            by_outbox.setdefault(lane.name.partition("/")[0], []).append(lane)
        for outbox, rows in by_outbox.items():
            ring = self._rings.setdefault(outbox, deque(maxlen=int(self.span / self.every) + 1))
            if ring and at <= ring[-1].at:
                continue
            ring.append(
                Sample(
                    at,
                    sum(r.lag_events for r in rows),
                    max(r.lag_seconds for r in rows),
                )
            )
        for outbox, ring in list(self._rings.items()):
            while ring and ring[0].at < at - self.span:
                ring.popleft()
            if not ring:
                del self._rings[outbox]

    def as_json(self) -> dict[str, list[dict[str, float]]]:
        return {
            outbox: [
                {"at": s.at, "lag_events": s.lag_events, "lag_seconds": s.lag_seconds} for s in ring
            ]
            for outbox, ring in self._rings.items()
        }


@dataclass(eq=False)
class StatusPage:
    """What the HTTP server asks for `/`, its files and `/status.json`."""

    cache: StatusCache
    served_by: str  # this replica's identity
    history: LagHistory = field(default_factory=LagHistory)
    _files: dict[str, tuple[str, bytes]] = field(default_factory=dict, init=False)
    # The last answer, and the read and history revision it was made of: the same bytes
    # serve every viewer until either changes, not a JSON encoding per request on the
    # event loop the relay delivers on.
    _answer: tuple[Cached, int, bytes] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # Read once at start-up: a file missing from the package fails here, not on a view.
        self._files = {path: (kind, page_file(name)) for path, (name, kind) in FILES.items()}

    def file(self, path: str) -> tuple[str, bytes] | None:
        """(content type, body) of one of the page's files, or None."""
        return self._files.get(path)

    async def status_json(self) -> bytes:
        cached = await self.cache.get()
        answer = self._answer
        if answer is not None and answer[0] is cached and answer[1] == self.history.revision:
            return answer[2]
        body: dict[str, Any] = {
            "served_by": self.served_by,
            "version": __version__,
            "refresh_seconds": REFRESH,
            "error": cached.error,
            # Unknown before the first good read: null, not an empty fleet.
            "taken_at": None,
            "lanes": None,
            "parked_total": None,
            "parked": None,
            "replicas": None,
        }
        if cached.snapshot is not None:
            body.update(cached.snapshot.as_json())
        body["history"] = self.history.as_json()
        encoded = json.dumps(body, default=str).encode()
        self._answer = (cached, self.history.revision, encoded)
        return encoded

    async def sample(self, stop: asyncio.Event) -> None:
        """Every SAMPLE_EVERY seconds, the fleet's lag into the history, through the cache
        (a viewer's read of the same second serves it too). Never fails: a failed read is
        shown on the page and the next sample tries again."""
        while not stop.is_set():
            cached = await self.cache.get()
            if cached.snapshot is not None:
                self.history.add(cached.snapshot.taken_at.timestamp(), cached.snapshot.lanes)
            await sleep_unless(stop, SAMPLE_EVERY)
