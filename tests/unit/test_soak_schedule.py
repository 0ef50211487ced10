"""The soak's fault schedule: every seed gives the short soaks the faults they assert.

The short soaks judge a change by at least 10 faults in 50 s (one outbox) and 8 in 40 s
(a split outbox). A seed whose pauses and faults ran long drew fewer (785633: 9 in 50 s),
and the soak refused a correct change. The schedule is a pure function of the seed, so
every seed can be checked here without running a soak.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from tests.soak.run import Settings, schedule
from tests.soak.schedule import EVERY, KINDS, LOSE, plan
from tests.soak.test_soak import dead_paths, failovers, short, split

SEEDS = range(1, 3001)
SHORT_KINDS = (*KINDS, LOSE)  # the short soak runs the audit: the broker loses messages too


def test_the_seed_that_drew_nine_faults_in_fifty_seconds_now_gets_ten() -> None:
    assert len(plan(785633, 50, KINDS)) == 9  # what its 50 s hold
    assert len(schedule(short(785633))) >= 10


@pytest.mark.parametrize("soak", [short, split, failovers, dead_paths])
def test_every_seed_gets_the_faults_its_short_soak_asserts(
    soak: Callable[[int], Settings],
) -> None:
    for seed in SEEDS:
        settings = soak(seed)
        faults = schedule(settings)
        assert len(faults) >= settings.faults_at_least, seed
        assert set(settings.faults_including) <= {f.kind for f in faults}, seed


def test_the_same_seed_gives_the_same_schedule_and_a_longer_one_starts_with_it() -> None:
    for seed in (1, 785633, 999_999):
        faults = schedule(short(seed))
        assert schedule(short(seed)) == faults
        assert plan(seed, 600, SHORT_KINDS)[: len(faults)] == faults


def test_without_a_minimum_every_fault_starts_within_the_seconds() -> None:
    for seed in SEEDS:
        faults = plan(seed, 50, KINDS)
        last = faults[-1]
        assert sum(f.pause + f.length for f in faults) - last.length < 50


def test_the_faults_past_the_seconds_keep_the_pacing_and_the_mix() -> None:
    """They are drawn like the others: every pause in range, every kind among them."""
    extra = [
        fault
        for seed in SEEDS
        for fault in schedule(short(seed))[len(plan(seed, 50, SHORT_KINDS)) :]
    ]
    assert extra, "some seeds needed more faults"
    assert all(EVERY[0] <= f.pause <= EVERY[1] for f in extra)
    assert set(Counter(f.kind for f in extra)) == set(SHORT_KINDS)
