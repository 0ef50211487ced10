"""The short soak, part of every test run: three replicas, six writers, 50 s of random faults.

The seed is random unless RELAY_SOAK_SEED is set; a failure prints it with the faults in
order, and `RELAY_SOAK_SEED=<seed>` (or `python -m tests.soak --seed <seed>`) replays the
same choices. Odd seeds use a partitioned table whose writers also insert into a partition.
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
