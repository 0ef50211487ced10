"""The soak's fault schedule, a pure function of the seed, checked without running a soak."""

from __future__ import annotations

from tests.soak.schedule import KINDS, plan

SEEDS = range(1, 3001)


def test_the_same_seed_gives_the_same_schedule_and_a_longer_one_starts_with_it() -> None:
    for seed in (1, 785633, 999_999):
        faults = plan(seed, 50, KINDS)
        assert plan(seed, 50, KINDS) == faults
        assert plan(seed, 600, KINDS)[: len(faults)] == faults


def test_every_fault_starts_within_the_seconds() -> None:
    for seed in SEEDS:
        faults = plan(seed, 50, KINDS)
        last = faults[-1]
        assert sum(f.pause + f.length for f in faults) - last.length < 50
