"""What the relay requires of the application's event table, checked before it reads.

Each rule here guards the gap-free read or the decoding of rows: a table that
breaks one would lose events or crash the relay later, so it is refused at
start-up (and by `relay check`) with the key at fault and the fix. What a row's
version and created_at may hold is checked as each row is read (`unreadable`): a value
the relay cannot convert parks that row, naming the column, not the read.
"""

from __future__ import annotations

import asyncpg

from relay.config import ColumnsConfig, SourceConfig
from relay.errors import SourceError
from relay.postgres.sql import excerpt, literal, quote

# Names the bounded read (source.py) gives its own columns beside the table's.
READ_COLUMNS = ("relay_row_pos", "relay_row_size", "relay_row_before", "relay_page_rows")
_INTEGER = {"smallint", "integer", "bigint"}
_TYPES: dict[str, tuple[set[str], str]] = {
    # column key: (accepted types, what to say)
    "position": (_INTEGER, "an integer type"),
    "version": (_INTEGER | {"numeric"}, "an integer type"),
    "payload": ({"json", "jsonb", "text", "character varying"}, "json, jsonb or text"),
    "metadata": ({"json", "jsonb", "text", "character varying"}, "json, jsonb or text"),
    "created_at": (
        {"timestamp with time zone", "timestamp without time zone"},
        "timestamptz (or timestamp)",
    ),
}


def readable_version(version: str) -> str:
    """SQL true when `version` (of an integer type or numeric) is a whole number within
    bigint: a numeric one beyond it failed the whole read (`bigint out of range`), and 1.5
    was rounded to 2, another event's version. Cheap integer comparisons for integers."""
    return f"({_within_bigint(version)} AND {version} % 1 = 0)"


def _within_bigint(version: str) -> str:
    return f"({version} BETWEEN (-9223372036854775807 - 1) AND 9223372036854775807)"


def as_time(created_at: str) -> str:
    """SQL for `created_at` as a timestamptz: a timestamp (without time zone) is read in the
    session's time zone, as PostgreSQL casts it (asyncpg gave it without an offset, and a
    CloudEvents `time` without one is not RFC 3339); a timestamptz stays as it is."""
    return f"{created_at}::timestamptz"


def readable_time(created_at: str) -> str:
    """SQL true when `created_at` (timestamptz or timestamp), read `as_time`, is a time
    Python's datetime holds: the years 1 to 9999 in UTC (asyncpg's decoding fails for any
    other row, and the whole read with it); not infinity nor -infinity."""
    return (
        f"({as_time(created_at)} BETWEEN '0001-01-01 00:00:00+00'::timestamptz"
        " AND '9999-12-31 23:59:59.999999+00'::timestamptz)"
    )


def unreadable(cols: ColumnsConfig) -> str:
    """SQL for why a row's version or created_at cannot be read, naming the column; NULL for
    a row the relay reads (a NULL there is the decoder's to name)."""
    version, created_at = quote(cols.version), cols.created_at
    said = literal(f"column {cols.version!r} is ") + " || " + excerpt(version + "::text")
    cases = [
        f"WHEN NOT {_within_bigint(version)} THEN {said} || ', out of the range of bigint'",
        f"WHEN {version} % 1 <> 0 THEN {said} || ', not a whole number'",
    ]
    if created_at is not None:
        cases.append(
            f"WHEN NOT {readable_time(quote(created_at))} THEN"
            f" {literal(f'column {created_at!r} is ')} || {quote(created_at)}::text"
            " || ', out of the range the relay reads (the years 1 to 9999)'"
        )
    return f"CASE {' '.join(cases)} END"


def default_sequence(relation: str, attnum: str) -> str:
    """SQL for the oid of the sequence a column's default draws from (`nextval`), NULL if none.

    It follows the default's own dependency, so a sequence the column does not own counts
    too; `relation` and `attnum` are SQL expressions for the table's oid and the column.
    """
    return (
        "(SELECT d.refobjid FROM pg_attrdef ad"
        " JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid"
        " AND d.refclassid = 'pg_class'::regclass"
        " JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'"
        f" WHERE ad.adrelid = {relation} AND ad.adnum = {attnum} LIMIT 1)"
    )


# Every table of the inheritance or partition tree, and the sequence its position
# column's default takes values from (NULL when it has no nextval default).
_TREE = (
    """
WITH RECURSIVE tree(relid) AS (
  SELECT $1::regclass::oid
  UNION SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid
)
SELECT t.relid::regclass::text AS relation,
  coalesce(
    """
    + default_sequence("t.relid", "a.attnum")
    + """::regclass::text,
    pg_get_serial_sequence(t.relid::regclass::text, a.attname)
  ) AS sequence
FROM tree t JOIN pg_attribute a ON a.attrelid = t.relid AND a.attname = $2
  AND NOT a.attisdropped
"""
)


async def verify(conn: asyncpg.Connection, config: SourceConfig, table: str) -> str:
    """Check the table; return its position sequence (regclass text)."""
    name = config.table
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        raise SourceError(f"source.table: table {name!r} does not exist")
    columns = {
        r["attname"]: (r["type"], r["attnotnull"])
        for r in await conn.fetch(
            "SELECT attname, format_type(atttypid, NULL) AS type, attnotnull FROM pg_attribute"
            " WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped",
            table,
        )
    }
    for key, column in config.columns.model_dump().items():
        if column is None:
            continue
        if column not in columns:
            hint = " (set it to null if the table has none)" if key in _OPTIONAL else ""
            raise SourceError(
                f"source.columns.{key}: column {column!r} not found in table {name!r}{hint}"
            )
        accepted, wanted = _TYPES.get(key, (None, ""))
        type_ = columns[column][0]
        if accepted is not None and type_ not in accepted:
            raise SourceError(
                f"source.columns.{key}: column {column!r} of table {name!r} is {type_};"
                f" the relay needs {wanted}"
            )
    taken = [column for column in READ_COLUMNS if column in columns]
    if taken:
        raise SourceError(
            f"source.table: table {name!r} has a column named {taken[0]!r}, a name the relay's"
            " read gives a column of its own; rename that column"
        )
    position = config.columns.position
    if not columns[position][1]:
        raise SourceError(
            f"source.columns.position: column {position!r} of table {name!r} allows NULL;"
            f" a row without a position would never be read: ALTER TABLE {table}"
            f" ALTER COLUMN {position} SET NOT NULL"
        )
    sequence = await conn.fetchval("SELECT pg_get_serial_sequence($1, $2)", table, position)
    if sequence is None:
        raise SourceError(
            f"source.columns.position: column {position!r} takes no value from a sequence; "
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
    await _children_share_the_sequence(conn, table, position, sequence)
    return str(sequence)


_OPTIONAL = ("metadata", "created_at")
# A NULL in one of these takes the row out of every outbox's reads (a NULL is no type and
# no aggregate an outbox names), or parks it: warned of, not refused (an older table may
# allow NULL and hold none).
_NULL_MEANS = {
    "type": "is no outbox's event: never published and never parked",
    "aggregate_type": (
        "is parked as malformed by an outbox that maps its type without `aggregates`,"
        " and never read by one with `aggregates`"
    ),
}


async def nullable_names(conn: asyncpg.Connection, config: SourceConfig, table: str) -> list[str]:
    """Warnings for the name columns that allow NULL, each with what such a row becomes and
    the statement that forbids it (docs/event-table.md)."""
    warnings = []
    for key, means in _NULL_MEANS.items():
        column = getattr(config.columns, key)
        nullable = await conn.fetchval(
            "SELECT NOT attnotnull FROM pg_attribute WHERE attrelid = $1::regclass"
            " AND attname = $2 AND NOT attisdropped",
            table,
            column,
        )
        if nullable:
            warnings.append(
                f"source.columns.{key}: column {column!r} of table {config.table!r} allows"
                f" NULL; a row with a NULL there {means}: ALTER TABLE {table}"
                f" ALTER COLUMN {quote(column)} SET NOT NULL"
            )
    return warnings


async def _children_share_the_sequence(
    conn: asyncpg.Connection, table: str, position: str, sequence: str
) -> None:
    """A partition or child with a sequence of its own would hand out positions unseen."""
    root = await conn.fetchval("SELECT $1::regclass::oid", sequence)
    for row in await conn.fetch(_TREE, table, position):
        own = row["sequence"]
        if own is None:
            continue
        if await conn.fetchval("SELECT $1::regclass::oid", own) != root:
            raise SourceError(
                f"source.table: {row['relation']} (part of {table}) takes its {position!r}"
                f" from sequence {own}, not {sequence}: writers inserting there directly would"
                f" take positions the relay cannot order; give it the parent's default:"
                f" ALTER TABLE {row['relation']} ALTER COLUMN {position}"
                f" SET DEFAULT nextval('{sequence}')"
            )
