"""Reading the event table in position order, behind a drain barrier.

Positions are taken at insert but transactions commit in any order, so
`position > checkpoint` alone skips late commits for ever. The barrier makes
a prefix of the log final before it is read:

1. take the sequence's last value L;
2. then collect the virtual xids of the sessions holding RowExclusiveLock on
   the table (an INSERT takes that lock before its default calls nextval);
3. wait until those transactions have ended.

Every position up to L is then committed or rolled back for good, and reading
`position <= L` in position order also keeps each aggregate's versions in
order. No writer change, no extra column, no replication privilege, and no
wall-clock timeout: a session idle in its transaction holds the relay back,
and the relay names it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from relay.config import SourceConfig
from relay.errors import SourceError
from relay.mapping import Event
from relay.sql import qualified, quote

_LOCKERS = """
SELECT DISTINCT v.virtualxid, v.pid
FROM pg_locks r
JOIN pg_locks v ON v.pid = r.pid AND v.locktype = 'virtualxid' AND v.granted
WHERE r.locktype = 'relation' AND r.relation = $1::regclass
  AND r.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND r.mode = 'RowExclusiveLock' AND r.granted AND r.pid <> pg_backend_pid()
"""
_STILL_RUNNING = """
SELECT virtualxid, pid FROM pg_locks
WHERE locktype = 'virtualxid' AND granted AND virtualxid = ANY($1::text[])
"""
_BLOCKERS = """
SELECT pid, coalesce(application_name, '') AS application_name, coalesce(state, '') AS state,
       extract(epoch FROM now() - xact_start)::float8 AS xact_age
FROM pg_stat_activity WHERE pid = ANY($1::int[]) ORDER BY xact_start NULLS LAST
"""


@dataclass(frozen=True, slots=True)
class Blocker:
    """A transaction the barrier is waiting for, as an operator needs to see it."""

    pid: int
    application_name: str
    state: str
    transaction_age: float
    waited: float

    def describe(self) -> str:
        return (
            f"pid {self.pid} ({self.application_name or 'no application_name'}, {self.state}, "
            f"transaction open {self.transaction_age:.1f}s)"
        )


OnBlocked = Callable[[Blocker | None], Awaitable[None]]


class EventSource:
    """The event table, seen through the config's table and column names."""

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self.table = qualified(config.table)
        cols = config.columns
        optional = [
            quote(cols.metadata) + "::text" if cols.metadata else "NULL::text",
            quote(cols.created_at) if cols.created_at else "NULL::timestamptz",
        ]
        select = ", ".join(
            [
                quote(cols.position),
                quote(cols.aggregate_type) + "::text",
                quote(cols.aggregate_id) + "::text",
                quote(cols.version) + "::int8",
                quote(cols.type) + "::text",
                quote(cols.payload) + "::text",
                *optional,
            ]
        )
        pos = quote(cols.position)
        self._read_sql = (
            f"SELECT {select} FROM {self.table} WHERE {pos} > $1 AND {pos} <= $2 "
            f"AND ($4::text[] IS NULL OR {quote(cols.aggregate_type)} = ANY($4::text[])) "
            f"AND {quote(cols.type)} = ANY($5::text[]) ORDER BY {pos} LIMIT $3"
        )
        self._read_all_sql = f"SELECT {select} FROM {self.table} ORDER BY {pos} DESC LIMIT $1"
        self._read_at_sql = f"SELECT {select} FROM {self.table} WHERE {pos} = ANY($1::bigint[])"
        self._count_sql = (
            f"SELECT count(*) FROM {self.table} WHERE {pos} > $1 AND {pos} <= $2"
            f" AND ($3::text[] IS NULL OR {quote(cols.aggregate_type)} = ANY($3::text[]))"
            f" AND {quote(cols.type)} = ANY($4::text[])"
        )
        self._age_sql = (
            f"SELECT extract(epoch FROM clock_timestamp() - {quote(cols.created_at)})::float8"
            f" FROM {self.table} WHERE {pos} > $1 ORDER BY {pos} LIMIT 1"
            if cols.created_at
            else None
        )
        self._since_sql = (
            f"SELECT min({pos}) FROM {self.table} WHERE {quote(cols.created_at)} >= $1"
            if cols.created_at
            else None
        )
        self._sequence: str | None = None
        self.clock_offset = 0.0  # database clock minus this host's, from the last head()

    async def check(self, conn: asyncpg.Connection) -> None:
        """Fail at start-up on what would silently break the gap-free read."""
        cols = self.config.columns
        if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", self.table):
            raise SourceError(f"source.table: table {self.config.table!r} does not exist")
        present = {
            r["attname"]
            for r in await conn.fetch(
                "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass "
                "AND attnum > 0 AND NOT attisdropped",
                self.table,
            )
        }
        for key, name in cols.model_dump().items():
            if name is not None and name not in present:
                raise SourceError(
                    f"source.columns.{key}: column {name!r} not found"
                    f" in table {self.config.table!r}"
                    + (
                        " (set it to null if the table has none)"
                        if key in ("metadata", "created_at")
                        else ""
                    )
                )
        sequence = await conn.fetchval(
            "SELECT pg_get_serial_sequence($1, $2)", self.table, cols.position
        )
        if sequence is None:
            raise SourceError(
                f"source.columns.position: column {cols.position!r} takes no value"
                " from a sequence; "
                "the relay needs positions assigned by nextval at insert (identity or serial)"
            )
        cache = await conn.fetchval(
            "SELECT cache_size FROM pg_sequences"
            " WHERE format('%I.%I', schemaname, sequencename)::regclass = $1::regclass",
            sequence,
        )
        if cache is not None and cache > 1:
            raise SourceError(
                f"sequence {sequence} has CACHE {cache}: positions could be taken out of order "
                f"by different sessions; run ALTER SEQUENCE {sequence} CACHE 1"
            )
        self._sequence = sequence

    async def head(self, conn: asyncpg.Connection) -> int:
        """The last position handed out (committed or not), 0 for an empty log."""
        if self._sequence is None:
            await self.check(conn)
        row = await conn.fetchrow(
            "SELECT pg_sequence_last_value($1::regclass),"
            " extract(epoch FROM clock_timestamp())::float8",
            self._sequence,
        )
        # Latency and lag are measured by the database's clock, never this host's.
        self.clock_offset = row[1] - time.time()
        return int(row[0] or 0)

    async def barrier(
        self, conn: asyncpg.Connection, on_blocked: OnBlocked, stop: asyncio.Event
    ) -> int | None:
        """Return L once every position up to it is final; None if `stop` was set first."""
        last = await self.head(conn)
        rows = await conn.fetch(_LOCKERS, self.table)
        waiting = [r["virtualxid"] for r in rows]
        started = time.monotonic()
        pause, reported = 0.0005, False
        while waiting:
            running = await conn.fetch(_STILL_RUNNING, waiting)
            if not running:
                break
            waiting = [r["virtualxid"] for r in running]
            waited = time.monotonic() - started
            if waited >= self.config.barrier_report_after:
                await on_blocked(await self._blocker(conn, running, waited))
                reported = True
            if stop.is_set():
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05 if waited < 1 else 0.25)
        if reported:
            await on_blocked(None)
        return last

    async def _blocker(
        self, conn: asyncpg.Connection, running: Sequence[asyncpg.Record], waited: float
    ) -> Blocker:
        pids = [r["pid"] for r in running]
        rows = await conn.fetch(_BLOCKERS, pids)
        if not rows:
            return Blocker(pids[0], "", "unknown", 0.0, waited)
        first = rows[0]
        return Blocker(
            first["pid"],
            first["application_name"],
            first["state"],
            first["xact_age"] or 0.0,
            waited,
        )

    async def read(
        self,
        conn: asyncpg.Connection,
        *,
        after: int,
        upto: int,
        limit: int,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
    ) -> list[Event]:
        """Events in (after, upto] that the outbox maps, in position order."""
        rows = await conn.fetch(self._read_sql, after, upto, limit, aggregates, list(types))
        return [_event(r) for r in rows]

    async def pending_age(self, conn: asyncpg.Connection, after: int) -> float:
        """Seconds since the oldest event after `after` was written (database clock)."""
        if self._age_sql is None:
            return 0.0
        age = await conn.fetchval(self._age_sql, after)
        return max(float(age or 0.0), 0.0)

    async def events_at(self, conn: asyncpg.Connection, positions: Sequence[int]) -> list[Event]:
        """The events at these positions that still exist, in position order."""
        rows = await conn.fetch(self._read_at_sql, list(positions))
        return sorted((_event(r) for r in rows), key=lambda e: e.position)

    async def count(
        self,
        conn: asyncpg.Connection,
        *,
        after: int,
        upto: int,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
    ) -> int:
        """How many events in (after, upto] an outbox would publish."""
        return int(await conn.fetchval(self._count_sql, after, upto, aggregates, list(types)))

    async def first_position_since(self, conn: asyncpg.Connection, when: datetime) -> int | None:
        """The first position written at or after `when` (needs a created_at column)."""
        if self._since_sql is None:
            raise SourceError(
                "source.columns.created_at is not set: --from-time needs a created_at column"
            )
        value = await conn.fetchval(self._since_sql, when)
        return None if value is None else int(value)

    async def latest(self, conn: asyncpg.Connection, count: int) -> list[Event]:
        """The last `count` events, oldest first; for `relay check`."""
        rows = await conn.fetch(self._read_all_sql, count)
        return [_event(r) for r in reversed(rows)]


def _event(row: asyncpg.Record) -> Event:
    problem = None
    try:
        data = json.loads(row[5])
        metadata = json.loads(row[6]) if row[6] is not None else {}
    except ValueError as exc:
        data, metadata, problem = None, None, f"payload or metadata is not JSON: {exc}"
    return Event(
        position=row[0],
        aggregate_type=row[1],
        aggregate_id=row[2],
        version=row[3],
        type=row[4],
        data=data,
        metadata=metadata,
        created_at=row[7],
        problem=problem,
    )
