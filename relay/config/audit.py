"""An outbox's continuous audit: `audit:` (docs/delivery.md, Proving delivery)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from relay.config.base import Duration, Model, PositiveDuration


class AuditConfig(Model):
    """The holder of the outbox's first lane reads the broker back behind the checkpoints,
    window after window, and reports every message it does not hold."""

    enabled: bool = Field(False, description="Audit the outbox continuously inside `relay run`.")
    delay: PositiveDuration = Field(
        60.0,
        description="How old a window must be before it is audited: the time the broker needs"
        " to settle (replication, a mirror) after it acknowledged.",
    )
    every: PositiveDuration = Field(60.0, description="How often an audit round starts.")
    repair: bool = Field(
        False,
        description="Publish missing messages again by itself, as `relay audit --repair` does."
        " Off by default: a consumer or an operator may have removed a message on purpose.",
    )
    clock_skew: Duration = Field(
        60.0,
        description="How far the broker's clock may be from the database's: the broker is read"
        " from this long before a window's first event was written.",
    )
    max_events: Annotated[int, Field(ge=1)] = Field(
        100_000, description="The most events one round audits; the next round goes on."
    )
