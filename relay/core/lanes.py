"""An outbox split into lanes: each aggregate always travels in the same one.

With `partitions: K`, every event belongs to lane `hash(aggregate) mod K`, computed in
SQL by PostgreSQL's `hashtextextended` (stable across releases: hash partitioning relies
on it). A lane is the unit of leases, checkpoints and parked messages. With K = 1 the
one lane is named after the outbox itself, so nothing changes for existing outboxes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Lane:
    outbox: str
    index: int
    count: int

    @property
    def name(self) -> str:
        """`loans` for the only lane of an outbox; `loans/2` for the third of several."""
        return self.outbox if self.count == 1 else f"{self.outbox}/{self.index}"

    @property
    def split(self) -> bool:
        return self.count > 1

    @property
    def labels(self) -> tuple[str, str]:
        return metric_labels(self.name)


def metric_labels(name: str) -> tuple[str, str]:
    """The `outbox` and `partition` labels of a lane: `loans/2` gives (`loans`, `2`).

    An outbox with one lane gets an empty partition, which Prometheus treats as no
    label at all, so its series are the ones it exported before it could be split.
    """
    outbox, _, partition = name.partition("/")
    return outbox, partition


def lanes_of(outbox: str, count: int) -> list[Lane]:
    return [Lane(outbox, index, count) for index in range(count)]


def fair_share(count: int, replicas: int) -> int:
    """The most lanes of one outbox a replica holds: ceil(K / R), at least 1."""
    return max(1, -(-count // max(replicas, 1)))


@dataclass(frozen=True, slots=True)
class Balance:
    """What one replica should do with one outbox's lanes on this pass."""

    give: int  # lanes to hand over, at their next batch boundary
    take: int  # free lanes to try to take


def balance(*, lanes: int, live: int, me: str, holding: dict[str, int], patient: bool) -> Balance:
    """Spread K lanes over R replicas as floor(K/R) or ceil(K/R) each.

    `holding` counts the lanes each replica holds now (`me` included); `live` is how
    many replicas are alive, some perhaps holding nothing yet. A replica above ceil
    gives the excess back. When one is below floor (a newcomer), one of the replicas
    at ceil (the last by name, so that only one moves) gives one lane back, and the
    others leave free lanes to the newcomer for a few passes (`patient`), after which
    anyone below ceil may take them, so that no lane stays unheld for long.
    """
    others = {who: n for who, n in holding.items() if who != me and n > 0}
    replicas = max(live, len(others) + 1)
    floor, ceil = lanes // replicas, -(-lanes // replicas)
    mine = holding.get(me, 0)
    idle = replicas - 1 - len(others)  # alive, holding nothing of this outbox (me aside)
    below = (idle if floor > 0 else 0) + sum(1 for n in others.values() if n < floor)
    if mine > ceil:
        return Balance(give=mine - ceil, take=0)
    at_ceil = sorted(
        [who for who, n in others.items() if n == ceil] + ([me] if mine == ceil else [])
    )
    if ceil > floor and below > 0 and at_ceil and at_ceil[-1] == me:
        return Balance(give=1, take=0)
    if below > 0 and mine >= floor and patient:
        return Balance(give=0, take=0)
    return Balance(give=0, take=ceil - mine)
