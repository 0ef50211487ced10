"""Quoting identifiers that come from the config (table, column, schema names)."""

from __future__ import annotations


def quote(identifier: str) -> str:
    """Quote one identifier; the config already restricts names to safe characters."""
    return '"' + identifier.replace('"', '""') + '"'


def holds_lock(key_param: str) -> str:
    """SQL that is true only on the connection holding advisory lock `key_param` (a bigint).

    A bigint key shows in pg_locks as classid (high 32 bits) and objid (low 32 bits)
    with objsubid = 1.
    """
    return (
        "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND pid = pg_backend_pid() AND objsubid = 1"
        f" AND ((classid::bigint << 32) | objid::bigint) = {key_param}::bigint)"
    )


def qualified(name: str) -> str:
    """Quote `table` or `schema.table`."""
    return ".".join(quote(part) for part in name.split("."))
