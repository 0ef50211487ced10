"""The statements that read the application's event table (in the config's table and column
names) and the catalogs the drain barrier reads: `SourceQueries`, `ReplicationQueries`, and
the lane of an aggregate as SQL."""

from __future__ import annotations

from typing import Final

from relay.config import ColumnsConfig, SourceConfig
from relay.core.lanes import Lane
from relay.postgres import event_table
from relay.postgres.skipping import predicate
from relay.postgres.sql import qualified, quote


def lane_of(columns: ColumnsConfig, count: int | str) -> str:
    """SQL for the lane (0 to count - 1) of a row of the event table; `count` may be SQL."""
    return lane_expression(quote(columns.aggregate_type), quote(columns.aggregate_id), count)


def lane_expression(aggregate_type: str, aggregate_id: str, count: int | str) -> str:
    """A stable hash of the aggregate, into `count` lanes.

    `hashtextextended` is what PostgreSQL's hash partitioning uses, so it gives the same
    value on every release and architecture. Type and id are hashed together, so that
    two aggregate types sharing an id are spread on their own; a NULL counts as empty,
    so that every row, even a malformed one, belongs to exactly one lane.
    """
    key = f"coalesce({aggregate_type}::text, '') || '/' || coalesce({aggregate_id}::text, '')"
    return f"((hashtextextended({key}, 0) % {count}) + {count}) % {count}"


def names_as_text(columns: ColumnsConfig) -> tuple[str, str]:
    """The aggregate type and event type columns as text, as the filters compare them with
    the config's names: an application may keep them in an enum, a domain or varchar, and
    an enum has no `=` with text (every read failed, and the relay exited)."""
    return quote(columns.aggregate_type) + "::text", quote(columns.type) + "::text"


class ReplicationQueries:
    """Where the primary's WAL is, and how far its streaming standbys have flushed it."""

    # In bytes: every commit the caller's reads could see has its commit record before this
    # point (the insert position: an asynchronous commit may be visible before its record
    # is written). Right after a page header (24 bytes, 40 at a segment's start) nothing of
    # that page is written yet: the last record ended at the page's start, which is as far
    # as a standby of an idle primary ever flushes.
    wal_position: Final = """
SELECT CASE WHEN b % s IN (24, 40) THEN b - b % s ELSE b END FROM (
  SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn AS b,
    current_setting('wal_block_size')::numeric AS s) AS w
"""
    # $1 a WAL position in bytes: standbys streaming and how many have flushed it. A standby
    # is a physical walsender (no database: a logical one, such as a CDC slot's, serves a
    # database) whose client replays the WAL: a WAL archiver (pg_receivewal, pg_basebackup's
    # stream) reports no replay position, and nothing can fail over to it.
    standbys: Final = """
SELECT count(*) AS streaming,
  count(*) FILTER (WHERE r.flush_lsn - '0/0'::pg_lsn >= $1::numeric) AS flushed
FROM pg_stat_replication r JOIN pg_stat_activity a ON a.pid = r.pid
WHERE r.state = 'streaming' AND a.datid IS NULL AND r.replay_lsn IS NOT NULL
"""


class SourceQueries:
    """The statements of one lane's EventSource (a split lane's reads see its rows only).

    A page of events ($1 after, $2 upto, $3 limit, $4 aggregate types or NULL for all, $5
    event types) selects, in position order: position, aggregate_type, aggregate_id,
    version, type, payload, metadata and created_at (NULL when the config has none, or
    when metadata is not read), then why the row cannot be read (`event_table.unreadable`; version
    and created_at are NULL then, as they cannot be read).
    """

    # Every transaction that takes a position holds RowExclusiveLock on the sequence from
    # its first nextval until it ends (Postgres takes it in nextval and keeps it for the
    # whole transaction): whichever table, partition or inheritance child it inserts into,
    # and also once it is prepared for two-phase commit, when the lock moves to a row with
    # no pid. $1 the sequence (as regclass text).
    holders: Final = """
SELECT DISTINCT virtualtransaction FROM pg_locks
WHERE locktype = 'relation' AND relation = $1::regclass AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND pid IS DISTINCT FROM pg_backend_pid()
"""
    # Those of them among $2 (virtual transaction ids).
    still_holding: Final = holders + " AND virtualtransaction = ANY($2::text[])"
    # The oldest top-level transaction id among the sequence's lock holders, or $2 (the next
    # xid) when none has one yet; compared by age, so xid wraparound is harmless.
    oldest_holder: Final = """
SELECT x::text::int8 FROM (
  SELECT t.transactionid AS x FROM pg_locks s
  JOIN pg_locks t ON t.virtualtransaction = s.virtualtransaction
    AND t.locktype = 'transactionid' AND t.granted
  WHERE s.locktype = 'relation' AND s.relation = $1::regclass AND s.granted
    AND s.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND s.pid IS DISTINCT FROM pg_backend_pid()
  UNION ALL SELECT $2::xid
) holders ORDER BY age(x) DESC LIMIT 1
"""
    can_read_sequence: Final = (
        "SELECT has_sequence_privilege($1::regclass, 'SELECT')"
        " OR has_sequence_privilege($1::regclass, 'USAGE')"
    )
    # The sessions, and the prepared transactions, of the virtual transactions $1.
    sessions: Final = """
SELECT DISTINCT a.pid, coalesce(a.application_name, '') AS application_name,
       coalesce(a.state, '') AS state,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_age
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'virtualxid' AND l.virtualtransaction = ANY($1::text[])
"""
    prepared: Final = """
SELECT p.gid, p.owner, extract(epoch FROM now() - p.prepared)::float8 AS xact_age
FROM pg_locks l JOIN pg_prepared_xacts p ON p.transaction = l.transactionid
WHERE l.locktype = 'transactionid' AND l.pid IS NULL AND l.virtualtransaction = ANY($1::text[])
"""
    # The sequence $1's last value (NULL: never used, or not readable), in one statement
    # with the database's clock, or with the next xid to be handed out.
    head: Final = (
        "SELECT pg_sequence_last_value($1::regclass), extract(epoch FROM clock_timestamp())::float8"
    )
    head_and_next_xid: Final = (
        "SELECT pg_sequence_last_value($1::regclass),"
        " pg_snapshot_xmax(pg_current_snapshot())::text::int8 % 4294967296"
    )

    def __init__(
        self, config: SourceConfig, lane: Lane | None = None, *, metadata: bool = True
    ) -> None:
        """`metadata=False` selects NULL for it."""
        cols = self._columns = config.columns
        self.table: Final = qualified(config.table)
        in_lane = f"{lane_of(cols, lane.count)} = {lane.index}" if lane and lane.split else None
        self._only: Final = f" AND {in_lane}" if in_lane else ""
        version, fits = quote(cols.version), event_table.readable_version(quote(cols.version))
        readable = event_table.readable_time(quote(cols.created_at)) if cols.created_at else None
        optional = [
            quote(cols.metadata) + "::text" if cols.metadata and metadata else "NULL::text",
            f"CASE WHEN {readable} THEN {event_table.as_time(quote(cols.created_at))} END"
            if cols.created_at
            else "NULL::timestamptz",
        ]
        self._select: Final = ", ".join(
            [
                quote(cols.position),
                quote(cols.aggregate_type) + "::text",
                quote(cols.aggregate_id) + "::text",
                f"CASE WHEN {fits} THEN {version}::int8 END",
                quote(cols.type) + "::text",
                quote(cols.payload) + "::text",
                *optional,
                event_table.unreadable(cols),
            ]
        )
        pos, table, only = quote(cols.position), self.table, self._only
        aggregate_type, event_type = names_as_text(cols)
        # The page.
        self.read: Final = f"SELECT {self._select} {self._page()}"
        # The page, and $6 the most bytes of stored payload: see `_bounded`.
        self.read_bounded: Final = self._bounded(self._page())
        # By `skipping`: the page of a lane made by a repartition, by the number of layers.
        self._skipping: Final[dict[tuple[bool, int], str]] = {}
        # The last $1 events, newest first.
        self.latest: Final = f"SELECT {self._select} FROM {table} ORDER BY {pos} DESC LIMIT $1"
        # The events at the positions $1 (int8[]).
        self.at_positions: Final = (
            f"SELECT {self._select} FROM {table} WHERE {pos} = ANY($1::bigint[])"
        )
        # How many events the page would hold without its limit: $1 after, $2 upto, $3
        # aggregate types (NULL: all), $4 event types.
        self.count: Final = (
            f"SELECT count(*) FROM {table} WHERE {pos} > $1 AND {pos} <= $2{only}"
            f" AND ($3::text[] IS NULL OR {aggregate_type} = ANY($3::text[]))"
            f" AND {event_type} = ANY($4::text[])"
        )
        # The position of the event the outbox maps ($2 aggregate types or NULL, $3 event
        # types) that is the $4-th (from 0) at or below $1, counting back: where an audit of
        # the last $4 + 1 events starts.
        self.nth_back: Final = (
            f"SELECT {pos} FROM {table} WHERE {pos} <= $1{only}"
            f" AND ($2::text[] IS NULL OR {aggregate_type} = ANY($2::text[]))"
            f" AND {event_type} = ANY($3::text[]) ORDER BY {pos} DESC OFFSET $4 LIMIT 1"
        )
        # The same, counting forward: the $5-th (from 0) after $1, up to $2.
        self.nth_after: Final = (
            f"SELECT {pos} FROM {table} WHERE {pos} > $1 AND {pos} <= $2{only}"
            f" AND ($3::text[] IS NULL OR {aggregate_type} = ANY($3::text[]))"
            f" AND {event_type} = ANY($4::text[]) ORDER BY {pos} OFFSET $5 LIMIT 1"
        )
        # Seconds since the lane's first event after $1 was written (database clock); None
        # without a created_at column.
        # Not for a time the relay cannot read: infinity cannot be subtracted at all.
        written = event_table.as_time(quote(cols.created_at)) if cols.created_at else None
        self.pending_age: Final = (
            f"SELECT CASE WHEN {readable} THEN"
            f" extract(epoch FROM clock_timestamp() - {written})::float8 END"
            f" FROM {table} WHERE {pos} > $1{only} ORDER BY {pos} LIMIT 1"
            if cols.created_at
            else None
        )
        # The first position written at or after $1 (timestamptz); None without created_at.
        self.first_since: Final = (
            f"SELECT min({pos}) FROM {table} WHERE {quote(cols.created_at)} >= $1"
            if cols.created_at
            else None
        )
        # The lowest position up to $1 written by a transaction at least as new as xid $2
        # (int8, its epoch cut off), in the lane and in the whole table.
        first = f"min({pos}) FILTER (WHERE {in_lane})" if in_lane else f"min({pos})"
        self.first_open: Final = (
            f"SELECT {first}, min({pos}) FROM {table} WHERE {pos} <= $1"
            " AND age(xmin) <= age(($2::int8 % 4294967296)::text::xid)"
        )

    def with_lanes(self, count: int) -> str:
        """Every lane's page ($1 after, $2 upto, $3 limit, $4 aggregate types or NULL, $5 event
        types), each row followed by its lane of `count` (0 when the outbox has one): what an
        audit reads, across every lane of an outbox."""
        lane = f"({lane_of(self._columns, count)})::int" if count > 1 else "0"
        return f"SELECT {self._select}, {lane} {self._page()}"

    def skipping(self, bounded: bool, layers: int) -> str:
        """The page (`read`, or `read_bounded` when `bounded`) of a lane made by a
        repartition, before it passes `Skip.upto`: less what the old lanes had published
        (skipping.py), `layers` layers of parameters from $6 ($7 when bounded) on."""
        key = (bounded, layers)
        if key not in self._skipping:
            pos = quote(self._columns.position)
            left_out = predicate(pos, self._lane_by, 7 if bounded else 6, layers)
            page = self._page(f" AND NOT {left_out}")
            self._skipping[key] = (
                self._bounded(page) if bounded else f"SELECT {self._select} {page}"
            )
        return self._skipping[key]

    def _lane_by(self, count: str) -> str:
        return lane_of(self._columns, count)

    def _page(self, skip: str = "") -> str:
        cols = self._columns
        pos = quote(cols.position)
        aggregate_type, event_type = names_as_text(cols)
        return (
            f"FROM {self.table} WHERE {pos} > $1 AND {pos} <= $2{self._only}{skip} "
            f"AND ($4::text[] IS NULL OR {aggregate_type} = ANY($4::text[])) "
            f"AND {event_type} = ANY($5::text[]) ORDER BY {pos} LIMIT $3"
        )

    def _bounded(self, rows: str) -> str:
        """The page `rows`, cut before the stored payloads pass $6 bytes (the first row always
        stays, however large): rows beyond it never reach the relay's memory. The size is
        pg_column_size, as stored (compressed, not detoasted), and the columns are cast to
        text only in the outer query, for the rows kept: the page's other rows cost an index
        entry each, not a conversion of their payload. Its own columns' names are
        event_table.READ_COLUMNS, which a table may not use; the last, the page's row count
        before the cut, follows the selected ones."""
        row_pos, row_size, row_before, page_rows = event_table.READ_COLUMNS
        pos, payload = quote(self._columns.position), quote(self._columns.payload)
        return (
            f"SELECT {self._select}, {page_rows} FROM (SELECT *, sum({row_size}) OVER"
            f" (ORDER BY {row_pos} ROWS UNBOUNDED PRECEDING) - {row_size} AS {row_before},"
            f" count(*) OVER () AS {page_rows} FROM (SELECT *, {pos} AS {row_pos},"
            f" coalesce(pg_column_size({payload}), 0) AS {row_size} {rows}) page)"
            f" sized WHERE {row_before} + {row_size} <= $6 OR {row_before} = 0"
            f" ORDER BY {row_pos}"
        )


def lane_at(table: str, columns: ColumnsConfig, count: int) -> str:
    """The lane, of `count`, of the event at position $1 (no row if it is gone)."""
    return (
        f"SELECT ({lane_of(columns, count)})::int FROM {qualified(table)}"
        f" WHERE {quote(columns.position)} = $1"
    )


def published(table: str, columns: ColumnsConfig, layers: int) -> str:
    """How many events in ($1, $2] some of `layers` layers says were published (their
    parameters from $3 on: Skip.arguments)."""
    pos = quote(columns.position)

    def lane_by(count: str) -> str:
        return lane_of(columns, count)

    return (
        f"SELECT count(*) FROM {qualified(table)} WHERE {pos} > $1 AND {pos} <= $2"
        f" AND {predicate(pos, lane_by, 3, layers)}"
    )
