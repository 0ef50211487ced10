"""What this process knows about each outbox, kept in one place.

The health endpoints and the tests read from here (the CLI's `status` reads the
same facts from the checkpoints table), never from the loop's locals. Each
change is a named transition, so that a typo is a type error, not a new field.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

Role = Literal["starting", "holder", "standby", "stopped"]
Activity = Literal["idle", "relaying", "retrying", "waiting", "halted", "disconnected", "stopped"]


@dataclass(slots=True)
class OutboxState:
    name: str
    role: Role = "starting"
    activity: Activity = "idle"
    holder: str | None = None
    held_since: float | None = None
    epoch: int | None = None
    checkpoint: int | None = None
    attempts: int = 0
    last_error: str | None = None
    blocked_by: str | None = None
    published: int = 0
    parked: int = 0

    # -- the lease -----------------------------------------------------------------------------

    def standing_by(self, holder: str | None) -> None:
        self.role, self.activity, self.holder = "standby", "idle", holder
        self.held_since = self.epoch = None

    def holding(self, identity: str, epoch: int, checkpoint: int) -> None:
        self.role, self.activity, self.holder = "holder", "relaying", identity
        self.held_since, self.epoch, self.checkpoint = time.time(), epoch, checkpoint
        self.last_error = None

    def lost(self, reason: str) -> None:
        self.role, self.activity, self.holder, self.last_error = "standby", "idle", None, reason

    def mismatched(self, reason: str) -> None:
        """Configured with another partition count than the outbox runs with: no lane."""
        self.role, self.activity, self.holder, self.last_error = "standby", "idle", None, reason
        self.held_since = self.epoch = None

    def disconnected(self, error: str) -> None:
        self.role, self.activity, self.last_error = "standby", "disconnected", error

    def stopped(self) -> None:
        self.role = self.activity = "stopped"

    # -- the holder's loop ---------------------------------------------------------------------

    def moved(self, checkpoint: int) -> None:
        """The checkpoint was written (forwards, or back by a replay)."""
        self.checkpoint = checkpoint

    def relaying(self) -> None:
        self.activity, self.attempts, self.blocked_by = "relaying", 0, None

    def idle(self) -> None:
        self.activity = "idle"

    def retrying(self, attempts: int, error: str) -> None:
        self.activity, self.attempts, self.last_error = "retrying", attempts, error

    def waiting(self, blocker: str) -> None:
        self.activity, self.blocked_by = "waiting", blocker

    def halted(self, reason: str) -> None:
        self.activity, self.last_error = "halted", reason

    def resumed(self) -> None:
        self.activity, self.last_error = "relaying", None
