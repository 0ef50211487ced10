"""What a lane made by a repartition must not send again: the old lanes' checkpoints.

A change of partitions starts every new lane where the slowest old lane stood. Between
there and the fastest old lane, some events were already published: an event was, if
its position is at or below the checkpoint of the lane that owned it by the old count.
That is one layer: (old count, each old lane's checkpoint). A new lane leaves out every
event some layer says was published, until its checkpoint passes the layer's highest
position; then the layer is dropped. A change made before the lanes had passed an older
layer keeps that layer too (its lanes would have left those events out as well), so
changes in quick succession still send nothing twice. The layers kept are bounded: past
`MAX_LAYERS`, the oldest are dropped and what they covered is sent again (a duplicate,
never a loss).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_LAYERS = 16


@dataclass(frozen=True, slots=True)
class Layer:
    partitions: int  # the old count
    positions: tuple[int, ...]  # each old lane's checkpoint, by its index

    @property
    def upto(self) -> int:
        return max(self.positions)


@dataclass(frozen=True, slots=True)
class Skip:
    layers: tuple[Layer, ...]  # newest first

    @property
    def upto(self) -> int:
        """The highest position any layer covers: past it, nothing is left out."""
        return max(layer.upto for layer in self.layers)

    def past(self, position: int) -> Skip | None:
        """The layers still to apply for a lane whose checkpoint is `position`."""
        kept = tuple(layer for layer in self.layers if layer.upto > position)
        return Skip(kept) if kept else None

    def arguments(self) -> tuple[object, ...]:
        """The query parameters of `predicate`: each layer's checkpoints and count."""
        return tuple(v for layer in self.layers for v in (list(layer.positions), layer.partitions))

    def as_json(self) -> str:
        return json.dumps([[layer.partitions, list(layer.positions)] for layer in self.layers])

    @classmethod
    def from_json(cls, text: str | None) -> Skip | None:
        """As `as_json` writes it; raises UnreadableSkip for any other shape."""
        if not text:
            return None
        value = json.loads(text)
        if not isinstance(value, list) or not all(_is_layer(layer) for layer in value):
            raise UnreadableSkip(text)
        layers = tuple(Layer(k, tuple(ps)) for k, ps in value)
        return cls(layers) if layers else None


class UnreadableSkip(ValueError):
    """A checkpoint's skip in a shape this release does not write: a newer release's."""


def skip_of(text: str | None) -> tuple[Skip | None, bool]:
    """A checkpoint row's skip, and whether it held one this release cannot read (a newer
    release's shape, docs/upgrading.md). That one is read as none: what it covers is sent
    again, a duplicate, never a loss."""
    try:
        return Skip.from_json(text), False
    except UnreadableSkip:
        return None, True


def _is_layer(layer: object) -> bool:
    """`[count, [position, ...]]`, every number an integer (not a bool nor a float)."""
    if not (isinstance(layer, list) and len(layer) == 2 and isinstance(layer[1], list)):
        return False
    count, positions = layer
    return (
        _integer(count)
        and count >= 1
        and len(positions) == count
        and all(_integer(p) for p in positions)
    )


def _integer(value: object) -> bool:
    return type(value) is int


def stacked(new: Layer, older: Iterable[Skip | None], start: int) -> Skip | None:
    """The layers for the lanes of a change: its own first, then every older one the old
    lanes still applied (each once), those past `start` only, at most MAX_LAYERS."""
    layers = [new]
    for skip in older:
        for layer in skip.layers if skip else ():
            if layer not in layers:
                layers.append(layer)
    kept = tuple(layer for layer in layers if layer.upto > start)[:MAX_LAYERS]
    return Skip(kept) if kept else None


def predicate(position: str, lane_of: Callable[[str], str], first: int, layers: int) -> str:
    """SQL that is true for an event some layer says was published.

    `lane_of(count)` is the lane expression for a count given as SQL; the parameters from
    `$first` are each layer's checkpoints (int8[]) and count, in turn.
    """
    terms = []
    for n in range(layers):
        positions, count = f"${first + 2 * n}", f"${first + 2 * n + 1}::int4"
        terms.append(f"{position} <= ({positions}::int8[])[({lane_of(count)})::int + 1]")
    return "(" + " OR ".join(terms) + ")"
