"""What this process knows about each outbox, kept in one place.

The CLI's `status`, the metrics and the health endpoints all read from here
(or from the same facts in the checkpoints table), never from the loop's
locals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["starting", "holder", "standby", "stopped"]
Activity = Literal["idle", "relaying", "retrying", "waiting", "halted", "disconnected", "stopped"]


@dataclass
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

    def set(self, **changes: object) -> None:
        for key, value in changes.items():
            setattr(self, key, value)
