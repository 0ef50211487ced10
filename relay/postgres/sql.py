"""SQL pieces: quoting names from the config, and how an advisory lock shows in pg_locks."""

from __future__ import annotations


def quote(identifier: str) -> str:
    """Quote one identifier; the config already restricts names to safe characters."""
    return '"' + identifier.replace('"', '""') + '"'


def _advisory(key_param: str, alias: str = "") -> str:
    """Rows of pg_locks for advisory lock `key_param` (a bigint), granted.

    A bigint key shows in pg_locks as classid (high 32 bits) and objid (low 32 bits)
    with objsubid = 1; this is the one place that knows it.
    """
    return (
        f"{alias}locktype = 'advisory' AND {alias}granted AND {alias}objsubid = 1"
        f" AND (({alias}classid::bigint << 32) | {alias}objid::bigint) = {key_param}::bigint"
    )


def holds_lock(key_param: str) -> str:
    """SQL that is true only on the connection holding advisory lock `key_param`."""
    return (
        f"EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND {_advisory(key_param)})"
    )


def held_keys() -> str:
    """SQL for the keys of every advisory lock this connection holds, one scan of pg_locks."""
    return (
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks WHERE pid = pg_backend_pid()"
        " AND locktype = 'advisory' AND granted AND objsubid = 1"
    )


def advisory_locks() -> str:
    """SQL for every advisory lock granted in this database, as rows (pid, key)."""
    return (
        "SELECT pid, (classid::bigint << 32) | objid::bigint AS key FROM pg_locks"
        " WHERE locktype = 'advisory' AND granted AND objsubid = 1"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )


def lane_key(namespace: str, lane: str) -> str:
    """SQL for lease.lock_key(namespace, lane), of two text expressions: the first 8 bytes
    of SHA-256 of `namespace/lane`, as a signed bigint."""
    digest = f"sha256(convert_to({namespace} || '/' || {lane}, 'UTF8'))"
    return f"('x' || left(encode({digest}, 'hex'), 16))::bit(64)::bigint"


def lock_holder(key_param: str, *, columns: str = "", join: str = "") -> str:
    """A query for the session holding advisory lock `key_param` in this database.

    It selects `pid` and `application_name`, then `columns`; `join` may add tables.
    """
    return (
        f"SELECT l.pid, coalesce(a.application_name, '') AS application_name{columns}"
        f" FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid{join}"
        f" WHERE {_advisory(key_param, 'l.')}"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " LIMIT 1"
    )


def qualified(name: str) -> str:
    """Quote `table` or `schema.table`."""
    return ".".join(quote(part) for part in name.split("."))


def literal(text: str) -> str:
    """A string literal; for text the relay writes, not for values (those are $n parameters)."""
    return "'" + text.replace("'", "''") + "'"


def excerpt(value: str) -> str:
    """SQL for the text `value`, cut after 80 characters with its length said (a numeric
    may have 131,072 digits): as printable.excerpt does, without the quotes."""
    return (
        f"CASE WHEN length({value}) <= 80 THEN {value}"
        f" ELSE left({value}, 80) || '... (' || length({value}) || ' characters)' END"
    )
