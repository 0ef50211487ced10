"""Watching every lane's holder while a fleet changes, sample after sample, from Postgres.

`relay status` at the end says who holds a lane now; it cannot say that two replicas never
relayed one lane at the same moment. A `LaneWatch` samples, as fast as the database answers,
the two things that decide it: which session holds which advisory lock (pg_locks, joined to
the replica's name in pg_stat_activity), and each lane's checkpoint row (holder, epoch and
the head message's failure count). It records every breach of the rules:

- each held lock is the lock of a known lane, as this release computes it (a release that
  computed another key for a lane would let two replicas hold it at once);
- no lock has two holders;
- a lane's epoch never goes back, and its holder never changes without a new epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from relay.core.lanes import lanes_of
from relay.postgres.lease import lock_key
from tests.support.db import connect

_LOCKS = """
SELECT (l.classid::bigint << 32) | l.objid::bigint AS key, l.pid,
       coalesce(a.application_name, '') AS name
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND coalesce(a.application_name, '') LIKE 'relay:%:lease'
"""
_ROWS = "SELECT outbox, epoch, holder, rejections FROM relay.checkpoints"


@dataclass(frozen=True)
class Seen:
    """One lane in one sample: who its row names, at which epoch, in which phase."""

    phase: str
    holder: str | None
    epoch: int
    rejections: int


@dataclass
class LaneWatch:
    """Samples the lanes of `outboxes` (name -> partitions) in `dsn` until stopped."""

    dsn: str
    outboxes: dict[str, int]
    namespace: str = "relay"
    phase: str = "start"
    breaches: list[str] = field(default_factory=list)
    samples: Counter[str] = field(default_factory=Counter)  # per phase
    history: dict[str, list[Seen]] = field(default_factory=lambda: defaultdict(list))
    holders_seen: set[str] = field(default_factory=set)  # lock holders' names, ever
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def keys(self) -> dict[int, str]:
        """Each lane's lock key, by this release's lock_key: key -> lane name."""
        return {
            lock_key(self.namespace, lane.name): lane.name
            for outbox, count in self.outboxes.items()
            for lane in lanes_of(outbox, count)
        }

    async def __aenter__(self) -> LaneWatch:
        self._task = asyncio.create_task(self._run(), name="lane-watch")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        keys = self.keys()
        async with connect(self.dsn) as conn:
            while not self._stop.is_set():
                locks = await conn.fetch(_LOCKS)
                rows = await conn.fetch(_ROWS)
                self._judge_locks(keys, [(r["key"], r["pid"], r["name"]) for r in locks])
                for row in rows:
                    self._judge_row(row["outbox"], row["holder"], row["epoch"], row["rejections"])
                self.samples[self.phase] += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.005)

    def _judge_locks(self, keys: dict[int, str], locks: Iterable[tuple[int, int, str]]) -> None:
        holders: dict[int, set[int]] = defaultdict(set)
        for key, pid, name in locks:
            holders[key].add(pid)
            self.holders_seen.add(name.removesuffix(":lease"))
            if key not in keys:
                self._breach(f"{name} holds lock {key}, the lock of no lane of {self.outboxes}")
        for key, pids in holders.items():
            if len(pids) > 1:
                self._breach(f"lane {keys.get(key, key)} held by sessions {sorted(pids)} at once")

    def _judge_row(self, lane: str, holder: str | None, epoch: int, rejections: int) -> None:
        seen = self.history[lane]
        if seen:
            last = seen[-1]
            if epoch < last.epoch:
                self._breach(f"{lane}: epoch went back from {last.epoch} to {epoch}")
            elif (
                epoch == last.epoch and None not in (holder, last.holder) and holder != last.holder
            ):
                self._breach(f"{lane}: holder {last.holder} -> {holder} within epoch {epoch}")
            if (last.holder, last.epoch, last.rejections) == (holder, epoch, rejections):
                return  # nothing new: keep the history short
        seen.append(Seen(self.phase, holder, epoch, rejections))

    def _breach(self, what: str) -> None:
        """Each breach once (a held lock is seen in every sample), in the phase first seen."""
        if not any(seen.endswith(f"] {what}") for seen in self.breaches):
            self.breaches.append(f"[{self.phase}] {what}")
