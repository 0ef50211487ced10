"""Rollout faults: the transitions an operator puts a fleet through, under load.

Only for a split outbox. Each ends with the fleet configured alike again (the outbox's
partitions may have changed), so that once the schedule is over every lane must drain.

- A rolling deploy that changes `partitions`: each replica in turn is stopped (SIGTERM)
  and started again with the new count, as a Deployment rolls its pods; the fleet
  changes the outbox over by itself when the last old replica has gone.
- `relay repartition` the way the docs tell operators to run it: every replica stopped,
  the command, then the replicas started with the new count.
- A mixed fleet for a while: one replica restarted with an outbox added (it also runs an
  outbox of nothing) or with the soak outbox removed, then restarted as it was.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

from tests.soak.cluster import OUTBOX, Replica, Replicas
from tests.soak.schedule import RECONFIGURE, ROLLOUT, mixed_for
from tests.support.relay_process import run_cli

COUNTS = (1, 2, 3, 4, 5)


class Rollouts:
    def __init__(self, rng: random.Random, replicas: Replicas) -> None:
        self.rng = rng
        self.replicas = replicas

    async def inject(self, kind: str, lasting: float) -> str:
        if kind == RECONFIGURE:
            return await self._mixed_fleet(lasting)
        count = self.rng.choice([k for k in COUNTS if k != self.replicas.lanes])
        if kind == ROLLOUT:
            return await self._rolling(count)
        return await self._repartition(count)

    async def _rolling(self, count: int) -> str:
        before = self.replicas.lanes
        for replica in self.replicas.members:
            replica.reconfigure(self.replicas.config_file(replica.index, count))
            await _restarted(replica)
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))  # as a pod turns Ready
        self.replicas.lanes = count
        return f"{before} -> {count}, replicas restarted one by one"

    async def _repartition(self, count: int) -> str:
        before = self.replicas.lanes
        members = self.replicas.members
        for replica in members:
            replica.hold_out(3600.0)
            replica.signal(signal.SIGTERM)
        await _all_stopped(members)
        config = self.replicas.config_file(0, count)
        args = ["repartition", OUTBOX, "--partitions", str(count), "--config", str(config)]
        result = await asyncio.to_thread(run_cli, args)
        outcome = "done" if result.returncode == 0 else f"exit {result.returncode}"
        if result.returncode == 0:
            self.replicas.lanes = count
        for replica in members:
            replica.reconfigure(self.replicas.config_file(replica.index, self.replicas.lanes))
            replica.hold_out(0.0)
        return f"{before} -> {count}: {outcome} {result.stderr.strip()[:120]}".rstrip()

    async def _mixed_fleet(self, lasting: float) -> str:
        replica = self.rng.choice(self.replicas.members)
        outboxes = self.rng.choice(["both", "side"])
        lanes = self.replicas.lanes
        replica.reconfigure(self.replicas.config_file(replica.index, lanes, outboxes))
        await _restarted(replica)
        away = mixed_for(lasting)
        await asyncio.sleep(away)
        replica.reconfigure(self.replicas.config_file(replica.index, lanes))
        await _restarted(replica)
        what = "outbox added" if outboxes == "both" else "soak outbox removed"
        return f"replica {replica.index}: {what} for {away:.1f}s"


async def _restarted(replica: Replica, timeout: float = 15.0) -> None:  # noqa: ASYNC109
    """SIGTERM it and wait until the supervisor has started it again (with its new config)."""
    starts = replica.starts
    replica.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if replica.starts > starts and replica.running:
            return
        await asyncio.sleep(0.05)


async def _all_stopped(replicas: list[Replica], timeout: float = 15.0) -> None:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(r.running for r in replicas):
            break
        await asyncio.sleep(0.05)
    for replica in replicas:  # a replica that would not stop in time: as a pod is, killed
        replica.signal(signal.SIGKILL)
