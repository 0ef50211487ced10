"""Writing to the application's event table the way an event-sourced app would."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import asyncpg


class NewEvent(NamedTuple):
    """One row to append; plain tuples in this order work too."""

    aggregate_type: str
    aggregate_id: str
    version: int
    type: str
    payload: Mapping[str, Any]
    metadata: Mapping[str, Any] | None = None


@asynccontextmanager
async def connect(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """An asyncpg connection that is always closed (unclosed ones warn, and warnings fail)."""
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


def _insert(table: str) -> str:
    return (
        f"INSERT INTO {table} (aggregate_type, aggregate_id, version, type, payload, metadata)"
        " VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb) RETURNING position"
    )


async def append(  # noqa: PLR0917 - mirrors the table's columns
    conn: asyncpg.Connection,
    aggregate_type: str,
    aggregate_id: str,
    version: int,
    type: str,
    payload: Mapping[str, Any],
    table: str = "events",
    metadata: Mapping[str, Any] | None = None,
) -> int:
    """Append one event and return its position."""
    position: int = await conn.fetchval(
        _insert(table),
        aggregate_type,
        aggregate_id,
        version,
        type,
        json.dumps(payload),
        json.dumps(metadata or {}),
    )
    return position


async def append_many(
    conn: asyncpg.Connection, events: Iterable[NewEvent | tuple[Any, ...]], table: str = "events"
) -> list[int]:
    """Append events in order, in one transaction; return their positions in the same order."""
    rows = [NewEvent(*event) for event in events]
    positions = []
    async with conn.transaction():
        for row in rows:
            kind, key, version, type_, payload, metadata = row
            positions.append(
                await append(conn, kind, key, version, type_, payload, table, metadata)
            )
    return positions
