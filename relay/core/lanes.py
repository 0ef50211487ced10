"""An outbox split into lanes: each aggregate always travels in the same one.

With `partitions: K`, every event belongs to lane `hash(aggregate) mod K`, computed in
SQL by PostgreSQL's `hashtextextended` (stable across releases: hash partitioning relies
on it). A lane is the unit of leases, checkpoints and parked messages. With K = 1 the
one lane is named after the outbox itself, so nothing changes for existing outboxes.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def balance(
    *,
    lanes: int,
    members: Mapping[str, int | None],
    me: str,
    holding: Mapping[str, int],
    patient: bool,
) -> Balance:
    """Spread K lanes over the R replicas that run the outbox: floor(K/R) or ceil(K/R) each.

    `members` are the live replicas that run this outbox with its count (`me` included),
    each with how many more lanes it may take (None: no `lease.max_per_replica`); a
    replica that runs other outboxes only is not among them. `holding` counts the lanes
    each holds now; a holder that is not a member (a CLI command, a replica going silent)
    counts as one that takes no more.

    A replica above ceil gives the excess back, but only what the others can take. When
    one is below floor (a newcomer), one of the replicas at ceil (the last by name, so
    that only one moves) gives one lane back, and the others leave free lanes to the
    newcomer for a few passes (`patient`). After that, anyone below ceil takes them, and
    when nobody else can (every other replica at ceil or at its cap), a replica with room
    takes more than its share: no lane stays unheld while a replica that runs it has room.
    """
    held = {who: 0 for who in members} | {who: n for who, n in holding.items() if n > 0}
    held[me] = holding.get(me, 0)
    replicas = len(held)
    floor, ceil = lanes // replicas, -(-lanes // replicas)
    mine, others = held[me], [who for who in held if who != me]
    free = max(lanes - sum(held.values()), 0)

    def takes(who: str, upto: int) -> int:
        """How many more lanes `who` would take, up to `upto` held."""
        room = members.get(who, 0) if who in members else 0
        return max(0, min(lanes if room is None else room, upto - held[who]))

    if mine > ceil:
        give = min(mine - ceil, sum(takes(who, ceil) for who in others) - free)
        if give > 0:
            return Balance(give=give, take=0)
    below = [who for who in others if held[who] < floor and takes(who, floor) > 0]
    at_ceil = sorted(who for who, n in held.items() if n == ceil)
    if ceil > floor and sum(takes(w, floor) for w in below) > free and at_ceil[-1:] == [me]:
        return Balance(give=1, take=0)
    share = max(ceil - mine, 0)
    if patient:
        return Balance(give=0, take=0 if below and mine >= floor else share)
    spare = free - share - sum(takes(who, ceil) for who in others)
    return Balance(give=0, take=share + max(spare, 0))
