"""The fault schedule, a pure function of the seed: what a soak will inject, known before it runs.

Drawing it up front keeps the seed's promise (same seed, same faults) whatever the run's
timing, and lets a unit test check every seed's schedule in milliseconds. The timeline
counts each fault's own length (a pause, a silence, a server down), not the time servers
take to come back, so a run lasts a little longer than its nominal seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tests.soak.cluster import TAKEOVER_AFTER

KILL = "kill -9 holder"
TERM = "SIGTERM holder"
STOP = "SIGSTOP holder"
BLACK_HOLE = "black-holed link"
TERMINATE = "terminate relay sessions"
BROKER = "broker crash"
POSTGRES = "postgres crash"
KINDS = (KILL, TERM, STOP, BLACK_HOLE, TERMINATE, BROKER, POSTGRES)
# A replica scaled away for a few seconds, then back: the others take its lanes, and give
# some back when it rejoins. Only for split outboxes, so that older seeds replay as before.
LEAVE = "replica leaves, rejoins"
# Rollouts (rollouts.py), for split outboxes too: a rolling deploy that changes the
# outbox's partitions, `relay repartition` with every replica stopped, and one replica
# restarted with an outbox added or removed for a while. They changed the split soak's
# draws: a split seed of before them replays other faults.
ROLLOUT = "rolling deploy, new K"
REPARTITION = "repartition, all stopped"
RECONFIGURE = "outbox set changed a while"
ROLLOUT_KINDS = (ROLLOUT, REPARTITION, RECONFIGURE)
SPLIT_KINDS = (*KINDS, LEAVE, *ROLLOUT_KINDS)
# The primary killed after its standby's link froze for a while, the standby promoted, the old
# primary rebuilt as the new one's standby. Only with a standby (`--failover`), so that older
# seeds replay as before.
FAILOVER = "postgres failover"
# One connection of the holder (its reader, lease or listener) loses its network path in
# the kernel for a while, then gets it back: shorter or longer than the keepalives allow.
# Only with `--dead-paths` (it needs root), so that older seeds replay as before.
DEAD_PATH = "one connection's path dies"
# The broker loses a message it acknowledged (one is deleted from the stream behind the
# relay's back): the continuous audit must find it, and put it back when it repairs. Only
# with `--audit`, so that older seeds replay as before.
LOSE = "broker loses a message"
ALL_KINDS = (*SPLIT_KINDS, FAILOVER, DEAD_PATH, LOSE)
EVERY = (1.5, 4.0)  # the pause before each fault, in seconds


def paused_for(lasting: float) -> float:
    """How long SIGSTOP keeps the holder paused: past takeover_after, so a standby acts."""
    return TAKEOVER_AFTER + lasting


def silent_for(lasting: float) -> float:
    """How long a black-holed link swallows packets before it is cut."""
    return 1.5 + lasting


def away_for(lasting: float) -> float:
    """How long a leaving replica stays away: enough for the others to rebalance."""
    return 3.0 + 2 * lasting


def frozen_for(lasting: float) -> float:
    """How long a failover keeps the standby's link frozen before the primary dies: past
    the relay's usual lag behind the writers (a prepared or long transaction holds its
    barrier for up to 3 s), so that without `survive_failover` it publishes commits the
    standby never gets."""
    return 2.0 + lasting


def dead_for(lasting: float) -> float:
    """How long a connection's path drops its packets: 2-6 s, around the soak's keepalives
    (idle 1 s + interval 1 s x count 2 = 3 s), so that some paths come back in time and
    the others are given up by the replica's kernel."""
    return 1.0 + 2 * lasting


def mixed_for(lasting: float) -> float:
    """How long a replica runs another outbox set before it is restarted as it was."""
    return 2.0 + 2 * lasting


@dataclass(frozen=True)
class Planned:
    """One fault to come: the pause before it, its kind, and its drawn length."""

    pause: float
    kind: str
    lasting: float  # drawn for every fault: same seed, same draws

    @property
    def length(self) -> float:
        """How long injecting it takes, not counting servers' restarts."""
        if self.kind == STOP:
            return paused_for(self.lasting)
        if self.kind == BLACK_HOLE:
            return silent_for(self.lasting)
        if self.kind in (BROKER, POSTGRES):
            return self.lasting
        if self.kind == FAILOVER:
            return frozen_for(self.lasting)
        if self.kind == DEAD_PATH:
            return dead_for(self.lasting)  # rebuilding the standby afterwards is extra
        if self.kind == RECONFIGURE:
            return mixed_for(self.lasting) + 2 * _RESTART
        if self.kind == ROLLOUT:
            return 3 * (_RESTART + 1.0)  # each replica in turn, then a moment to turn Ready
        if self.kind == REPARTITION:
            return 2 * _RESTART  # every replica stopped, the command, every one started
        return 0.0  # a signal, a terminate, a replica told to stay away: at once


_RESTART = 1.5  # a replica's graceful stop, the supervisor's pause and its start, roughly


def plan(
    seed: int,
    seconds: float,
    kinds: tuple[str, ...] = KINDS,
    *,
    at_least: int = 0,
    including: tuple[str, ...] = (),
) -> list[Planned]:
    """The faults for `seconds`, and more past them until there are `at_least` and every
    kind in `including` is among them.

    Pauses and kinds keep their one distribution throughout, so the mix and the pacing
    stay those of any other stretch of a soak; only the run gets longer. A longer soak
    of the same seed starts with the same faults.
    """
    rng = random.Random(seed)
    faults: list[Planned] = []
    missing = set(including)  # kinds still to come
    elapsed = 0.0
    while True:
        pause = rng.uniform(*EVERY)
        if elapsed + pause >= seconds and len(faults) >= at_least and not missing:
            return faults
        fault = Planned(pause, rng.choice(kinds), rng.uniform(0.5, 2.5))
        faults.append(fault)
        missing.discard(fault.kind)
        elapsed += pause + fault.length
