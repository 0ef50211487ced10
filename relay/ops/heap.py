"""The start-up heap, set aside from the garbage collector while the relay runs.

By the time the outboxes start, the process holds every module it will use (pydantic,
the broker clients, asyncpg): tens of thousands of objects that live as long as it does.
Each full collection walked them all again, about a twentieth of a second every few
seconds of a backlog drain, to find nothing; the batches' own garbage dies by reference
counting. `gc.freeze()` moves what exists now into a generation that is never collected
(as CPython's documentation suggests for long-lived servers); newer objects are collected
as before. A cycle among the frozen objects that later becomes garbage is not reclaimed:
start-up objects, once, never per event.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_holders = [0]  # relays running in this process: the collector's state is process-wide


@contextlib.contextmanager
def start_up_heap_frozen() -> Iterator[None]:
    """Freeze what start-up built, after collecting its garbage; thaw it when the last relay
    of the process stops, so that a relay run inside another program (a test, the benchmark)
    leaves it as it was."""
    if _holders[0] == 0:
        gc.collect()
        gc.freeze()
    _holders[0] += 1
    try:
        yield
    finally:
        _holders[0] -= 1
        if _holders[0] == 0:
            gc.unfreeze()
