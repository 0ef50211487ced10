"""The start-up heap is frozen while a relay runs, without keeping start-up garbage."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from relay.runtime.heap import YOUNG_THRESHOLD, start_up_heap_frozen


@pytest.fixture(autouse=True)
def heap_of_its_own() -> Iterator[None]:
    """Each test starts with nothing frozen, as in a relay's own process: the unit tier
    freezes its heap after collection (tests/conftest.py), and gets it back frozen."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_start_up_garbage_is_collected_before_the_rest_is_frozen() -> None:
    garbage = Node()
    dead = weakref.ref(garbage)
    del garbage
    with start_up_heap_frozen():
        assert dead() is None
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_the_heap_thaws_when_the_last_relay_of_the_process_stops() -> None:
    before = gc.get_threshold()
    with start_up_heap_frozen():
        with start_up_heap_frozen():
            frozen = gc.get_freeze_count()
            assert gc.get_threshold()[0] >= YOUNG_THRESHOLD
        assert gc.get_freeze_count() == frozen  # the other relay still runs
        assert gc.get_threshold()[0] >= YOUNG_THRESHOLD
        later = Node()
        dead = weakref.ref(later)
        del later
        gc.collect()
        assert dead() is None  # what the relay makes after start-up is still collected
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_relays_may_stop_in_any_order() -> None:
    before = gc.get_threshold()
    first, second = start_up_heap_frozen(), start_up_heap_frozen()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to start stops first
    assert gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_a_host_that_froze_its_own_heap_keeps_it_frozen() -> None:
    gc.freeze()
    try:
        host = gc.get_freeze_count()
        with start_up_heap_frozen():
            assert 0 < gc.get_freeze_count() <= host  # nothing more frozen (some may die)
        assert 0 < gc.get_freeze_count() <= host  # and not thawed by the relay
    finally:
        gc.unfreeze()
