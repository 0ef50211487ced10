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
        """The pause after failed attempt number `attempt` (1-based)."""
        c = self.config
        base = min(c.max, c.initial * c.multiplier ** max(attempt - 1, 0))
        spread = base * c.jitter
        return max(0.0, min(c.max, base + self.rng.uniform(-spread, spread)))
