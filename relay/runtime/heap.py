"""The start-up heap, set aside from the garbage collector while the relay runs.

By the time the outboxes start, the process holds every module it will use (pydantic,
the broker clients, asyncpg): tens of thousands of objects that live as long as it does.
Each full collection walked them all again, about a twentieth of a second every few
seconds of a backlog drain, to find nothing; the batches' own garbage dies by reference
counting. `gc.freeze()` moves what exists now into a generation that is never collected
(as CPython's documentation suggests for long-lived servers); newer objects are collected
as before. A cycle among the frozen objects that later becomes garbage is not reclaimed:
start-up objects, once, never per event.

Only the young generations are collected before the freeze. Start-up's garbage is young
(the config read, the contexts built), and a full collection walked every module's objects
once more, 20 to 50 ms in a fresh relay process (by the broker clients it imports) and 80
to 110 ms in the benchmark's, on the way to every drain. After the young collection (about
1 ms) a full one found nothing more to free. What garbage the old generation still held
would be frozen with the rest: start-up objects again.

The young generation's threshold is raised for the same reason: a batch is a few thousand
short-lived containers (rows, events, payloads, messages) that die by reference counting,
and at CPython's default of 700 the collector ran several times per batch to find nothing
to free, promoting the batch on the way (about 2% of the relay's CPU).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

YOUNG_THRESHOLD = 10_000  # allocations minus frees of containers between young collections


class _Collector:
    """How many relays of this process hold the heap frozen, and the settings to restore:
    the collector's state is process-wide."""

    holders = 0
    thresholds: tuple[int, ...] = ()
    froze = False  # False when the host program had frozen objects of its own: left alone
    # What the interpreter froze itself before any program ran: 0 on CPython 3.11 and 3.13,
    # a few hundred start-up objects on 3.12. Only more than that is a host's doing; taking
    # 3.12's own for a host's left the relay's heap unfrozen there. The last relay's unfreeze
    # thaws those too (gc thaws all or nothing): the collector merely sees them again.
    interpreters_own = gc.get_freeze_count()


@contextlib.contextmanager
def start_up_heap_frozen() -> Iterator[None]:
    """Freeze what start-up built, after collecting its young garbage, and collect the young less
    often; undo both when the last relay of the process stops, so that a relay run inside
    another program (a test, the benchmark) leaves it as it was."""
    if _Collector.holders == 0:
        _Collector.froze = gc.get_freeze_count() <= _Collector.interpreters_own
        if _Collector.froze:
            gc.collect(1)  # the young generations: a full collection walks every module
            gc.freeze()
        _Collector.thresholds = thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], YOUNG_THRESHOLD), *thresholds[1:])
    _Collector.holders += 1
    try:
        yield
    finally:
        _Collector.holders -= 1
        if _Collector.holders == 0:
            if _Collector.froze:
                gc.unfreeze()
            gc.set_threshold(*_Collector.thresholds)
