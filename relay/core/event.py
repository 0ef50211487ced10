"""An event as the relay reads it from the event table: what mapping turns into messages.

In a module of its own so that mapping and the rule code it writes out (rule_code.py)
both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


class ExactNumber(float):
    """A JSON number a 64-bit float cannot hold (`1.123456789012345678`, 19 digits): a float
    for every computation, and its text as the event wrote it wherever it is written out
    again (payloads, templates), so that a value passed through is published unchanged."""

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> ExactNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__


@dataclass(slots=True)
class Event:
    """One row of the event table, decoded; never changed once read.

    Not frozen: a frozen dataclass costs ten times as much to build, once per event.
    """

    position: int
    aggregate_type: str
    aggregate_id: str
    version: int
    type: str
    data: Any
    metadata: Any
    created_at: datetime | None
    problem: str | None = None  # a required column is NULL, the payload not JSON or too deep
    metadata_problem: str | None = None  # matters only to an outbox that reads metadata

    def envelope(self, created_at: str | None = None) -> dict[str, Any]:
        """What expressions read; `created_at` is the time already written in ISO 8601."""
        if created_at is None and self.created_at is not None:
            created_at = self.created_at.isoformat()
        return {
            "position": self.position,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "version": self.version,
            "type": self.type,
            "data": self.data,
            "metadata": self.metadata,
            "created_at": created_at,
        }
