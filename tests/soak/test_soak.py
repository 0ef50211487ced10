"""The short soaks, part of every test run: three replicas, six writers, random faults.

The seed is random unless RELAY_SOAK_SEED is set; a failure prints it with the faults in
order, and `RELAY_SOAK_SEED=<seed>` (or `python -m tests.soak --seed <seed>`) replays the
same choices. Odd seeds use a partitioned table whose writers also insert into a partition.
The first two also run the continuous audit in every replica while the broker loses
messages: it must report each one (and, in the second, put it back), and nothing else.
The second soak splits the outbox into four lanes and also scales replicas away and back.
The third gives Postgres a streaming standby and fails over to it.
Each asks for the faults it asserts: the schedule goes on past its seconds until it has
them (tests/unit/test_soak_schedule.py checks that over many seeds).
"""

from __future__ import annotations

import os
import random

import pytest

from tests.soak.run import Settings, soak
from tests.soak.schedule import (
    BLACK_HOLE,
    DEAD_PATH,
    FAILOVER,
    KILL,
    LOSE,
    POSTGRES,
    TERM,
    TERMINATE,
)

pytestmark = pytest.mark.integration  # it starts its own Postgres, broker and replicas


def short(seed: int) -> Settings:
    """One outbox, 50 s of faults, at least 10 of them, the broker losing a message among
    them: the continuous audit in every replica must report exactly the messages lost."""
    return Settings(
        seed=seed,
        seconds=50,
        faults_at_least=10,
        faults_including=(LOSE,),
        broker="nats",
        partitioned=seed % 2 == 1,
        audit="report",
    )


def split(seed: int) -> Settings:
    """`partitions: 4` over three replicas: 40 s of faults, at least 8 of them; the audit
    of every lane by the first one's holder puts back what the broker lost."""
    return Settings(
        seed=seed,
        seconds=40,
        faults_at_least=8,
        faults_including=(LOSE,),
        broker="nats",
        lanes=4,
        audit="repair",
    )


def failovers(seed: int) -> Settings:
    """A streaming standby; the primary killed and the standby promoted, at least once,
    among crashes, kills and cut sessions: 40 s of faults, at least 8 of them."""
    return Settings(
        seed=seed,
        seconds=40,
        faults_at_least=8,
        faults_including=(FAILOVER, POSTGRES),
        broker="nats",
        kinds=(KILL, TERM, BLACK_HOLE, TERMINATE, POSTGRES),
        failover=True,
    )


def dead_paths(seed: int) -> Settings:
    """Replicas on paths where one connection at a time dies in the kernel (its reader,
    lease or listener), among kills and cut sessions: 30 s of faults, at least 6 of them."""
    return Settings(
        seed=seed,
        seconds=30,
        faults_at_least=6,
        faults_including=(DEAD_PATH,),
        broker="nats",
        kinds=(KILL, TERM, TERMINATE),
        dead_paths=True,
    )


def _seed() -> int:
    return int(os.environ.get("RELAY_SOAK_SEED") or random.SystemRandom().randrange(1, 10**6))


async def _judged(settings: Settings) -> None:
    verdict, origin = await soak(settings)
    report = verdict.report(origin)
    print(report)
    assert verdict.ok, f"replay with RELAY_SOAK_SEED={settings.seed}\n{report}"
    assert verdict.committed > 1000, report  # the writers really wrote through the faults
    assert len(verdict.faults) >= settings.faults_at_least, report
    assert set(settings.faults_including) <= {f.kind for f in verdict.faults}, report


async def test_short_soak_with_nats_loses_nothing_under_random_faults() -> None:
    await _judged(short(_seed()))


async def test_short_soak_through_postgres_failovers_publishes_nothing_taken_back() -> None:
    """With `survive_failover`, what the dead primary's standby never got is never published:
    no phantom, though the writers had those commits acknowledged."""
    await _judged(failovers(_seed()))


async def test_short_soak_of_a_split_outbox_with_replicas_leaving_and_rejoining() -> None:
    """Lanes move on every fault and on every rejoin."""
    await _judged(split(_seed()))


async def test_short_soak_with_connections_whose_paths_die() -> None:
    """A dead path under one connection ends in a reconnect (or a takeover, for a lease):
    nothing lost, nothing out of order, and the outbox drains."""
    await _judged(dead_paths(_seed()))
