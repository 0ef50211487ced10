"""Exponential backoff with jitter, for retrying a failed batch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from relay.config import RetryConfig


@dataclass
class Backoff:
    """Delays of initial, initial*multiplier, ... capped at max, each jittered.

    Jitter spreads replicas and outboxes apart so that a recovering broker is
    not hit by every client in the same instant.
    """

    config: RetryConfig
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number `attempt` (1-based).

        The count survives restarts and takeovers, so an outage of a weekend reaches
        thousands of attempts: past the one that reaches `max`, the growth is not computed
        (a float's power overflows near 2 ** 1024, which would stop the relay).
        """
        c = self.config
        try:
            grown = c.initial * c.multiplier ** max(attempt - 1, 0)
        except OverflowError:
            grown = c.max
        base = min(c.max, grown)
        spread = base * c.jitter
        return max(0.0, min(c.max, base + self.rng.uniform(-spread, spread)))
