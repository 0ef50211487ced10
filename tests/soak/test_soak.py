"""The short soaks, part of every test run: three replicas, six writers, random faults.

The seed is random unless RELAY_SOAK_SEED is set; a failure prints it with the faults in
order, and `RELAY_SOAK_SEED=<seed>` (or `python -m tests.soak --seed <seed>`) replays the
same choices. Odd seeds use a partitioned table whose writers also insert into a partition.
The second soak splits the outbox into four lanes and also scales replicas away and back.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.soak.run import Settings, soak

pytestmark = pytest.mark.integration  # it starts its own Postgres, broker and replicas


async def test_short_soak_with_nats_loses_nothing_under_random_faults() -> None:
    seed = int(os.environ.get("RELAY_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
    settings = Settings(seed=seed, seconds=50, broker="nats", partitioned=seed % 2 == 1)
    verdict, origin = await soak(settings)
    report = verdict.report(origin)
    print(report)
    assert verdict.ok, f"replay with RELAY_SOAK_SEED={seed}\n{report}"
    assert verdict.committed > 1000, report  # the writers really wrote through the faults
    assert len(verdict.faults) >= 10, report


async def test_short_soak_of_a_split_outbox_with_replicas_leaving_and_rejoining() -> None:
    """`partitions: 4` over three replicas: lanes move on every fault and on every rejoin."""
    seed = int(os.environ.get("RELAY_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))
    settings = Settings(seed=seed, seconds=40, broker="nats", lanes=4)
    verdict, origin = await soak(settings)
    report = verdict.report(origin)
    print(report)
    assert verdict.ok, f"replay with RELAY_SOAK_SEED={seed}\n{report}"
    assert verdict.committed > 1000, report
    assert len(verdict.faults) >= 8, report
