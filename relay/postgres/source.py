"""Reading the event table in position order, behind a drain barrier.

Positions are taken at insert but transactions commit in any order, so
`position > checkpoint` alone skips late commits for ever. The barrier makes
a prefix of the log final before it is read:

1. take the sequence's last value L;
2. then collect the transactions holding a lock on the sequence: nextval takes
   RowExclusiveLock on it and keeps it until the transaction ends, so these are
   all the transactions that may hold an uncommitted position;
3. wait until those transactions have ended.

Every position up to L is then committed or rolled back for good, and reading
`position <= L` in position order also keeps each aggregate's versions in
order. Because the lock is on the sequence, not the table, the barrier sees
writers that insert into a partition or an inheritance child directly, into
partitions attached later, and transactions prepared for two-phase commit
(whose locks stay behind with no session). No writer change, no extra column,
no replication privilege, and no wall-clock timeout: a session idle in its
transaction holds the relay back, and the relay names it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import asyncpg
import orjson

from relay.config import ColumnsConfig, SourceConfig
from relay.core.event import Event, ExactNumber
from relay.core.lanes import Lane
from relay.core.nesting import MAX_DEPTH, TooDeep, headroom, text_depth
from relay.errors import SourceError
from relay.postgres import event_table
from relay.postgres.queries import SourceQueries
from relay.postgres.skipping import Skip


@dataclass(frozen=True, slots=True)
class Blocker:
    """A transaction the barrier is waiting for, as an operator needs to see it.

    A session is named by its pid; a transaction prepared for two-phase commit has no
    session any more, and is named by its gid and owner.
    """

    pid: int | None
    application_name: str
    state: str
    transaction_age: float
    waited: float
    gid: str | None = None
    owner: str | None = None

    def describe(self) -> str:
        if self.gid is not None:
            return (
                f"prepared transaction {self.gid!r} (owner {self.owner}, prepared "
                f"{self.transaction_age:.1f}s ago; COMMIT PREPARED or ROLLBACK PREPARED ends it)"
            )
        # Quoted: the client chose its application_name, and could make it look like more
        # fields of this line (`x, idle, transaction open 0.0s`).
        name = repr(self.application_name) if self.application_name else "no application_name"
        age = f"transaction open {self.transaction_age:.1f}s"
        return f"pid {self.pid} ({name}, {self.state}, {age})"

    def fields(self) -> dict[str, object]:
        """What status shows and the log says about it."""
        if self.gid is not None:
            return {"gid": self.gid, "owner": self.owner, "state": "prepared"}
        return {"pid": self.pid, "application_name": self.application_name, "state": self.state}


OnBlocked = Callable[[Blocker | None], Awaitable[None]]


class EventSource:
    """The event table, seen through the config's table and column names; with a split
    lane, only that lane's rows."""

    def __init__(
        self, config: SourceConfig, lane: Lane | None = None, *, metadata: bool = True
    ) -> None:
        """`metadata=False` reads NULL for it: the outbox's expressions never read it."""
        self.config = config
        self.lane = lane
        self.queries = SourceQueries(config, lane, metadata=metadata)
        self.table = self.queries.table
        self._sequence: str | None = None
        self.clock_offset = 0.0  # database clock minus this host's, from the last head()

    async def check(self, conn: asyncpg.Connection) -> None:
        """Fail at start-up on what would silently break the gap-free read."""
        self._sequence = await event_table.verify(conn, self.config, self.table)

    async def warnings(self, conn: asyncpg.Connection) -> list[str]:
        """What the table allows that would take a row out of the relay's reads (after
        `check`): a name column that allows NULL."""
        return await event_table.nullable_names(conn, self.config, self.table)

    async def _last_value(self, conn: asyncpg.Connection, statement: str) -> asyncpg.Record:
        """The sequence's last value, and what else `statement` reads with it."""
        if self._sequence is None:
            await self.check(conn)
        row = await conn.fetchrow(statement, self._sequence)
        if row[0] is None and not await conn.fetchval(
            self.queries.can_read_sequence, self._sequence
        ):
            # PostgreSQL 18 answers NULL, as for a sequence never used, instead of an error:
            # the relay would see an empty log for ever and publish nothing, silently.
            raise SourceError(
                f"permission denied for sequence {self._sequence}: without SELECT (or USAGE) on"
                " it the relay cannot see how far the log goes; GRANT SELECT ON SEQUENCE"
                f" {self._sequence} TO the relay's role (`relay check` lists every right)"
            )
        return row

    async def head(self, conn: asyncpg.Connection) -> int:
        """The last position handed out (committed or not), 0 for an empty log."""
        row = await self._last_value(conn, self.queries.head)
        # Latency and lag are measured by the database's clock, never this host's.
        self.clock_offset = row[1] - time.time()
        return int(row[0] or 0)

    async def start_point(self, conn: asyncpg.Connection, start: str) -> tuple[int, int | None]:
        """Where a new checkpoint starts: (position, start_xmin).

        `beginning` is position 0. `end` is the head now, with the oldest transaction id
        that may still commit a position up to it: the oldest top-level xid among the
        transactions holding the sequence's lock, or the next xid to be handed out when
        they have none yet. Their events (savepoints included: a subtransaction's xid is
        newer than its parent's) are all written by transactions at least that new, so
        once they have ended `first_open_position` finds the first one, and nothing that
        commits after the relay started is skipped.
        """
        if start == "beginning":
            return 0, None
        row = await self._last_value(conn, self.queries.head_and_next_xid)
        head, next_xid = int(row[0] or 0), int(row[1])
        # Then the holders, as the barrier does: one that took a position up to the head
        # and has not ended is among them.
        oldest = await conn.fetchval(self.queries.oldest_holder, self._sequence, next_xid)
        return head, int(oldest)

    async def first_open_position(
        self, conn: asyncpg.Connection, upto: int, start_xmin: int
    ) -> tuple[int | None, int | None]:
        """The lowest position up to `upto` written by a transaction at least as new as
        `start_xmin` (compared by age, so xid wraparound is harmless): in this lane, and in
        the whole table (where every lane of the outbox may start). One scan of the table,
        once in a lane's life."""
        row = await conn.fetchrow(self.queries.first_open, upto, start_xmin)
        return (
            None if row[0] is None else int(row[0]),
            None if row[1] is None else int(row[1]),
        )

    async def barrier(
        self, conn: asyncpg.Connection, on_blocked: OnBlocked, stop: asyncio.Event
    ) -> int | None:
        """Return L once every position up to it is final; None if `stop` was set first."""
        last = await self.head(conn)
        # Only now: a transaction that takes a position after L was read need not be waited for.
        waiting = [r[0] for r in await conn.fetch(self.queries.holders, self._sequence)]
        started = time.monotonic()
        pause, reported = 0.0005, False
        while waiting:
            still = await conn.fetch(self.queries.still_holding, self._sequence, waiting)
            waiting = [r[0] for r in still]
            if not waiting:
                break
            waited = time.monotonic() - started
            if waited >= self.config.barrier_report_after:
                await on_blocked(await self._blocker(conn, waiting, waited))
                reported = True
            if stop.is_set():
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05 if waited < 1 else 0.25)
        if reported:
            await on_blocked(None)
        return last

    async def _blocker(
        self, conn: asyncpg.Connection, waiting: list[str], waited: float
    ) -> Blocker:
        """The oldest of the transactions waited for: a session, or a prepared transaction."""
        found = [
            Blocker(r["pid"], r["application_name"], r["state"], r["xact_age"] or 0.0, waited)
            for r in await conn.fetch(self.queries.sessions, waiting)
        ]
        found += [
            Blocker(None, "", "prepared", r["xact_age"] or 0.0, waited, r["gid"], r["owner"])
            for r in await conn.fetch(self.queries.prepared, waiting)
        ]
        if not found:  # it ended between the two queries
            return Blocker(None, "", "ended", 0.0, waited)
        return max(found, key=lambda b: b.transaction_age)

    async def read(
        self,
        conn: asyncpg.Connection,
        *,
        after: int,
        upto: int,
        limit: int,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
        max_bytes: int | None = None,
        skip: Skip | None = None,
    ) -> tuple[list[Event], bool]:
        """Events in (after, upto] that the outbox maps, in position order; with `max_bytes`,
        only as many as their stored payloads fit in (at least one). True with them if more
        of the page was left for the next read because of `max_bytes`. With `skip`, less
        what the lanes before a repartition had published."""
        args = (after, upto, limit, aggregates, list(types))
        names = self.config.columns
        skipping = None if skip is None else skip.past(after)
        queries = self.queries
        if max_bytes is None:
            if skipping is None:
                rows = await conn.fetch(queries.read, *args)
            else:
                sql = queries.skipping(False, len(skipping.layers))
                rows = await conn.fetch(sql, *args, *skipping.arguments())
            return [_event(r, names) for r in rows], False
        if skipping is None:
            rows = await conn.fetch(queries.read_bounded, *args, max_bytes)
        else:
            sql = queries.skipping(True, len(skipping.layers))
            rows = await conn.fetch(sql, *args, max_bytes, *skipping.arguments())
        cut = bool(rows) and len(rows) < rows[0][event_table.READ_COLUMNS[-1]]
        return [_event(r, names) for r in rows], cut

    async def read_lanes(
        self,
        conn: asyncpg.Connection,
        *,
        after: int,
        upto: int,
        limit: int,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
        count: int,
    ) -> list[tuple[Event, int]]:
        """Events in (after, upto] that the outbox maps, in every lane, each with its lane of
        `count`, in position order: an audit's read of a whole outbox (no barrier: it reads
        only what the lanes' checkpoints have passed)."""
        sql = self.queries.with_lanes(count)
        rows = await conn.fetch(sql, after, upto, limit, aggregates, list(types))
        names = self.config.columns
        return [(_event(r, names), r[9]) for r in rows]

    async def pending_age(self, conn: asyncpg.Connection, after: int) -> float:
        """Seconds since the oldest event after `after` was written (database clock)."""
        if self.queries.pending_age is None:
            return 0.0
        age = await conn.fetchval(self.queries.pending_age, after)
        return max(float(age or 0.0), 0.0)

    async def events_at(self, conn: asyncpg.Connection, positions: Sequence[int]) -> list[Event]:
        """The events at these positions that still exist, in position order."""
        rows = await conn.fetch(self.queries.at_positions, list(positions))
        return sorted((_event(r, self.config.columns) for r in rows), key=lambda e: e.position)

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
        count = await conn.fetchval(self.queries.count, after, upto, aggregates, list(types))
        return int(count)

    async def nth_back(
        self,
        conn: asyncpg.Connection,
        upto: int,
        count: int,
        *,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
    ) -> int | None:
        """The position of the `count`-th event the outbox maps at or below `upto`, counting
        back (1: the last one); None when there are fewer."""
        value = await conn.fetchval(
            self.queries.nth_back, upto, aggregates, list(types), max(count - 1, 0)
        )
        return None if value is None else int(value)

    async def nth_after(
        self,
        conn: asyncpg.Connection,
        after: int,
        upto: int,
        count: int,
        *,
        aggregates: Sequence[str] | None,
        types: Sequence[str],
    ) -> int | None:
        """The position of the `count`-th event the outbox maps in (after, upto]; None when
        there are fewer."""
        value = await conn.fetchval(
            self.queries.nth_after, after, upto, aggregates, list(types), max(count - 1, 0)
        )
        return None if value is None else int(value)

    async def first_position_since(self, conn: asyncpg.Connection, when: datetime) -> int | None:
        """The first position written at or after `when` (needs a created_at column)."""
        if self.queries.first_since is None:
            raise SourceError(
                "source.columns.created_at is not set: --from-time needs a created_at column"
            )
        value = await conn.fetchval(self.queries.first_since, when)
        return None if value is None else int(value)

    async def latest(self, conn: asyncpg.Connection, count: int) -> list[Event]:
        """The last `count` events, oldest first; for `relay check`."""
        rows = await conn.fetch(self.queries.latest, count)
        return [_event(r, self.config.columns) for r in reversed(rows)]


# orjson is several times faster than json and as strict, but reads an integer beyond
# 64 bits as a float, silently rounding it, and a float reads at most 17 significant digits
# (`1.123456789012345678` became 1.1234567890123457). So a result that holds a float is
# checked: if the text has a number of 16 digits or more, or an exponent of 3 digits (1e-400
# reads as 0.0), or anything that looks like them, that a float does not read back the same,
# the standard decoder reads it again: integers exactly, and a number a float would change
# as an ExactNumber, which is written out again as the event wrote it. What orjson refuses
# goes to the standard decoder too, so that the error is worded the same.
# (Searching every text instead cost two thirds of the CPU with 64 KiB payloads.)
# orjson also refuses JSON nested deeper than MAX_DEPTH; the standard decoder is given
# room for as deep as orjson reads and no deeper, so that both read the same texts.
# A run of 16 digits (and dots) or more; a negative exponent of 3 digits.
_LONG_RUN = re.compile(r"[0-9.]{16,}")
_TINY = re.compile(r"[eE]-[0-9]{3}")
_INT64_MAX = 2**63 - 1  # -(2**63) counts as beyond it: the exact decoder reads it the same


def decode_json(text: str) -> Any:
    """Strict JSON: no NaN, no Infinity, no number out of range; exact integers; at most
    MAX_DEPTH levels deep (TooDeep, a ValueError, says how deep it is)."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return _decode_standard(text)
    try:
        floats = _holds_float(value)
    except RecursionError:  # as deep as orjson reads, deeper than this stack allows:
        floats = True  # maybe, then; what counts is whether the text has a long number
    if floats and _inexact(text):
        return _decode_standard(text)
    return value


def _inexact(text: str) -> bool:
    """Whether a number in `text` may be one orjson did not read exactly: an integer beyond
    64 bits, a number of 16 digits or more that a float changes, or one too small for a float
    (1e-400 reads as 0.0; jsonb writes such a number out in full, a json column may not).

    A float's own shortest text (what programs write for a computed float,
    `0.8444218515250481`) reads back the same, and costs a look each; what only looks like a
    number (in a string) costs a look too. Two plain scans: an alternation in one regex cost
    twice as much."""
    for run in _LONG_RUN.findall(text):
        if "." not in run:
            if int(run) > _INT64_MAX:
                return True
            continue
        try:
            value = float(run)  # a mantissa: its exponent, if any, scales it
        except ValueError:
            continue  # dots in a string, or a version number
        if _changed_by_float(run, value):
            return True
    return ("e-" in text or "E-" in text) and _TINY.search(text) is not None


def _changed_by_float(text: str, value: float) -> bool:
    return repr(value) != text and Decimal(repr(value)) != Decimal(text)


def _decode_standard(text: str) -> Any:
    """The standard decoder, given stack room for the depth orjson reads; deeper is refused
    before it starts (without room it raised RecursionError, which ended the relay)."""
    if (depth := text_depth(text)) > MAX_DEPTH:
        raise TooDeep(depth)
    try:
        with headroom():
            return _DECODER.decode(text)
    except RecursionError:  # only if the caller was already deep in the stack: still refused
        raise TooDeep(depth) from None


def _holds_float(value: Any) -> bool:
    """Whether a decoded value holds a float at any depth.

    Recursive, and so it can run out of stack on a value as deep as orjson reads (which
    decode_json catches): a loop with a stack of its own cost half as much again per call.
    """
    kind = type(value)
    if kind is dict:
        value = value.values()
    elif kind is not list:
        return kind is float
    for item in value:
        kind = type(item)
        if kind is float or ((kind is dict or kind is list) and _holds_float(item)):
            return True
    return False


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed in JSON")


def _finite(text: str) -> float:
    """A float, or an ExactNumber where a float would not be the number the text says."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text} is out of range")
    if (len(text) > _SAFE_DIGITS or "e" in text or "E" in text) and Decimal(repr(value)) != Decimal(
        text
    ):
        return ExactNumber(text)
    return value


# A text this short has at most 15 digits, which a float always keeps, unless an exponent
# takes it past a float's range (1e-400 reads as 0.0).
_SAFE_DIGITS = 15


# Python's json accepts NaN and Infinity, and turns 1e999 into infinity, which no other
# JSON parser does and no JSON text can carry: refuse them.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite)
_REQUIRED = ((1, "aggregate_type"), (2, "aggregate_id"), (3, "version"), (5, "payload"))


def _event(row: asyncpg.Record, names: ColumnsConfig) -> Event:
    """Decode one row; a malformed one carries the problem, naming its column (the read
    names a version or created_at it cannot convert: see SourceQueries)."""
    problem = data = metadata_problem = None
    if row[8] is not None:
        problem = row[8]
    elif row[1] is None or row[2] is None or row[3] is None or row[5] is None:
        problem = next(
            f"column {getattr(names, k)!r} is NULL" for i, k in _REQUIRED if row[i] is None
        )
    else:
        data, problem = _json(row[5], names.payload)
    metadata: Any = {}
    if row[6] is not None:
        metadata, metadata_problem = _json(row[6], names.metadata)
        if metadata is None:
            metadata = {}
    # Positional: keywords cost a tenth of the decoding, once per event.
    return Event(
        row[0], row[1], row[2], row[3], row[4], data, metadata, row[7], problem, metadata_problem
    )


def _json(text: str, column: str | None) -> tuple[Any, str | None]:
    try:
        return decode_json(text), None
    except TooDeep as exc:
        return None, f"column {column!r} is JSON {exc}"
    except ValueError as exc:
        return None, f"column {column!r} is not valid JSON: {exc}"
