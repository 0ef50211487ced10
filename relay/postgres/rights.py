"""The database rights the relay needs, checked as the role it connects as, each with its GRANT.

A right that is missing would otherwise show up late: as a task dying in `relay run`
(a permission error on the first read) or as a takeover that never happens (a
standby that may not end a silent holder's session). `relay check` lists them all,
and `relay run` refuses to start while a required one is missing.

Every question is asked of the catalogs by object id (has_table_privilege(oid, ...)),
so that a missing USAGE on a schema does not hide the rights on what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import asyncpg

from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.errors import DatabaseError
from relay.postgres.event_table import default_sequence
from relay.postgres.lease import lock_key

# What `relay run` and the one-shot commands do on the relay's own tables (never DDL:
# that is `relay migrate`'s). DELETE on checkpoints is only `relay repartition`'s.
OWN_TABLES: dict[str, tuple[str, ...]] = {
    "schema_version": ("SELECT",),
    "checkpoints": ("SELECT", "INSERT", "UPDATE"),
    "parked": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "commands": ("SELECT", "INSERT", "UPDATE"),
    "outboxes": ("SELECT", "INSERT", "UPDATE"),
    "replicas": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "audits": ("SELECT", "INSERT", "UPDATE"),
}
_REPARTITION_ONLY = {"checkpoints": ("DELETE",)}

_ROLE = """
SELECT current_user AS name, quote_ident(current_user) AS quoted, current_database() AS db,
  quote_ident(current_database()) AS db_quoted,
  (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser,
  pg_has_role('pg_read_all_stats', 'USAGE') AS read_all_stats,
  pg_has_role('pg_signal_backend', 'USAGE') AS signal_backend,
  has_database_privilege(current_database(), 'CREATE') AS create_schema
"""
_POSITION_ATTNUM = "(SELECT attnum FROM pg_attribute WHERE attrelid = c.oid AND attname = $3)"
# The event table as the relay names it (schema-qualified or found on the search path),
# and the sequence its position column's default takes values from (as event_table finds
# it: the default's own link first, then an owned or identity sequence).
_EVENT_TABLE = (
    """
SELECT c.oid, format('%I.%I', n.nspname, c.relname) AS name, n.oid AS schema_oid,
  quote_ident(n.nspname) AS schema_name, has_schema_privilege(n.oid, 'USAGE') AS schema_usage,
  has_table_privilege(c.oid, 'SELECT') AS can_select,
  coalesce(
    """
    + default_sequence("c.oid", _POSITION_ATTNUM)
    + """,
    (SELECT s.oid FROM pg_depend d JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
     JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
     WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
       AND d.refobjid = c.oid AND a.attname = $3 AND d.deptype IN ('a', 'i') LIMIT 1)
  ) AS seq
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = $2 AND c.relkind IN ('r', 'p')
  AND CASE WHEN $1::text IS NULL THEN n.nspname = ANY(current_schemas(false))
      ELSE n.nspname = $1 END
ORDER BY array_position(current_schemas(false), n.nspname::text) NULLS LAST LIMIT 1
"""
)
_SEQUENCE = """
SELECT format('%I.%I', n.nspname, c.relname) AS name,
  has_sequence_privilege(c.oid, 'SELECT') OR has_sequence_privilege(c.oid, 'USAGE') AS can_read
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1
"""
_OWN_SCHEMA = """
SELECT n.oid, has_schema_privilege(n.oid, 'USAGE') AS usage FROM pg_namespace n
WHERE n.nspname = $1
"""
_OWN_OBJECTS = """
SELECT c.relname, c.relkind::text AS kind, format('%I.%I', n.nspname, c.relname) AS name,
  has_table_privilege(c.oid, 'SELECT') AS "SELECT",
  has_table_privilege(c.oid, 'INSERT') AS "INSERT",
  has_table_privilege(c.oid, 'UPDATE') AS "UPDATE",
  has_table_privilege(c.oid, 'DELETE') AS "DELETE",
  CASE WHEN c.relkind = 'S' THEN has_sequence_privilege(c.oid, 'USAGE') END AS "USAGE"
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relnamespace = $1 AND c.relkind IN ('r', 'p', 'S') ORDER BY c.relname
"""
# Sessions holding one of this config's lease locks that this role may not end: only
# superusers end a superuser's session; otherwise membership in the session's role, or
# in pg_signal_backend, is needed (the rules of pg_terminate_backend).
_UNENDABLE_HOLDERS = """
SELECT DISTINCT r.rolname AS role, coalesce(a.application_name, '') AS application_name,
  r.rolsuper AS superuser
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid JOIN pg_roles r ON r.oid = a.usesysid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY($1::bigint[])
  AND l.pid <> pg_backend_pid()
  AND NOT CASE WHEN r.rolsuper
      THEN (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
      ELSE pg_has_role(current_user, r.oid, 'USAGE')
        OR pg_has_role(current_user, 'pg_signal_backend', 'USAGE') END
ORDER BY 1, 2
"""


@dataclass(frozen=True, slots=True)
class Missing:
    """One right the role lacks: on what, why the relay needs it, and the GRANT that fixes it.

    `required` rights stop `relay run` at its preflight and make `relay check` fail; the
    others leave the relay running with a feature lost, which the text names.
    """

    what: str
    why: str
    fix: str
    required: bool = True

    def describe(self) -> str:
        return f"{self.what}: {self.why}; fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class Rights:
    """What the role the relay connects as may do, as far as the relay is concerned."""

    role: str
    missing: list[Missing] = field(default_factory=list)

    @property
    def required(self) -> list[Missing]:
        return [m for m in self.missing if m.required]

    @property
    def degraded(self) -> list[Missing]:
        return [m for m in self.missing if not m.required]

    def raise_if_required_missing(self) -> None:
        """A MissingRightsError listing every required right that is missing."""
        if self.required:
            raise MissingRightsError(self.role, self.required)


class MissingRightsError(DatabaseError):
    """The role lacks rights the relay cannot run without; the message lists each and its fix."""

    def __init__(self, role: str, missing: list[Missing]) -> None:
        lines = "".join(f"\n  - {m.describe()}" for m in missing)
        super().__init__(
            f"the database role {role!r} lacks {len(missing)} right(s) the relay needs:{lines}"
        )
        self.missing = missing


async def check_rights(conn: asyncpg.Connection, config: RelayConfig) -> Rights:
    """Every right the relay needs on `conn`'s database, as the role `conn` logged in as."""
    role = await conn.fetchrow(_ROLE)
    to = role["quoted"]
    found: list[Missing] = []
    found += await _event_table(conn, config, to)
    found += await _own_schema(conn, config, role)
    if not role["read_all_stats"] and config.source.survive_failover is not None:
        found.append(
            Missing(
                "membership in pg_read_all_stats (seeing how far the standbys are)",
                "source.survive_failover holds events back until standbys have flushed them,"
                " and pg_stat_replication shows their positions only to that role's members:"
                " without it no standby would ever seem to have them, and nothing would be"
                " published",
                f"GRANT pg_read_all_stats TO {to};",
            )
        )
    elif not role["read_all_stats"]:
        found.append(
            Missing(
                "membership in pg_read_all_stats (seeing other roles' sessions)",
                "pg_stat_activity hides the state and transaction start of sessions of other"
                " roles (the application's): a transaction that holds the relay back is then"
                " named by pid and application_name only, without its state or age, in"
                " `relay status` (blocking_transaction) and in the log; nothing else changes",
                f"GRANT pg_read_all_stats TO {to};",
                required=False,
            )
        )
    found += await _ending_holders(conn, config, role)
    return Rights(role["name"], found)


async def _event_table(conn: asyncpg.Connection, config: RelayConfig, to: str) -> list[Missing]:
    """SELECT on the table; SELECT (or USAGE) on its position sequence, for the drain barrier."""
    schema, _, name = config.source.table.rpartition(".")
    row = await conn.fetchrow(_EVENT_TABLE, schema or None, name, config.source.columns.position)
    if row is None:
        return []  # not found: the event table's own check says so, with the key at fault
    found = []
    if not row["schema_usage"]:
        found.append(
            Missing(
                f"USAGE on schema {row['schema_name']}",
                f"the relay cannot name the event table {row['name']} without it",
                f"GRANT USAGE ON SCHEMA {row['schema_name']} TO {to};",
            )
        )
    if not row["can_select"]:
        found.append(
            Missing(
                f"SELECT on table {row['name']}",
                "the relay reads the events from it",
                f"GRANT SELECT ON {row['name']} TO {to};",
            )
        )
    if row["seq"] is not None:
        sequence = await conn.fetchrow(_SEQUENCE, row["seq"])
        if not sequence["can_read"]:
            found.append(
                Missing(
                    f"SELECT on sequence {sequence['name']}",
                    "the drain barrier reads the last position handed out"
                    " (pg_sequence_last_value) before each read; USAGE would also do, but"
                    " would let the role take positions",
                    f"GRANT SELECT ON SEQUENCE {sequence['name']} TO {to};",
                )
            )
    return found


async def _own_schema(
    conn: asyncpg.Connection, config: RelayConfig, role: asyncpg.Record
) -> list[Missing]:
    """USAGE on the relay's schema, and reading and writing each of its tables."""
    to, schema = role["quoted"], config.database.schema_
    quoted = await conn.fetchval("SELECT quote_ident($1)", schema)
    row = await conn.fetchrow(_OWN_SCHEMA, schema)
    if row is None:
        return [] if role["create_schema"] else [_migrate_right(role, quoted)]
    found = []
    if not row["usage"]:
        found.append(
            Missing(
                f"USAGE on schema {quoted}",
                "the relay's checkpoints, parked messages and commands are there",
                f"GRANT USAGE ON SCHEMA {quoted} TO {to};",
            )
        )
    for obj in await conn.fetch(_OWN_OBJECTS, row["oid"]):
        if obj["kind"] == "S":
            if not obj["USAGE"]:
                found.append(
                    Missing(
                        f"USAGE on sequence {obj['name']}",
                        "the relay numbers its parked messages and commands with it",
                        f"GRANT USAGE ON SEQUENCE {obj['name']} TO {to};",
                    )
                )
            continue
        for needs, why, required in (
            (OWN_TABLES, "the relay keeps its own state there", True),
            (_REPARTITION_ONLY, "only `relay repartition` needs it (it rewrites lanes)", False),
        ):
            if lacking := [p for p in needs.get(obj["relname"], ()) if not obj[p]]:
                privileges = ", ".join(lacking)
                found.append(
                    Missing(
                        f"{privileges} on table {obj['name']}",
                        why,
                        f"GRANT {privileges} ON {obj['name']} TO {to};",
                        required,
                    )
                )
    return found


def _migrate_right(role: asyncpg.Record, schema: str) -> Missing:
    """The schema does not exist yet: `relay migrate` will create it, if its role may."""
    return Missing(
        f"CREATE on database {role['db_quoted']}",
        f"schema {schema} does not exist yet, and `relay migrate` run as this role could not"
        " create it (no need if it runs as another role, such as the application's"
        " migration role)",
        f"GRANT CREATE ON DATABASE {role['db_quoted']} TO {role['quoted']};",
        required=False,
    )


async def _ending_holders(
    conn: asyncpg.Connection, config: RelayConfig, role: asyncpg.Record
) -> list[Missing]:
    """Heartbeat takeover ends a silent holder's session: can this role end the others'?"""
    to = role["quoted"]
    if role["superuser"]:
        return []
    found = []
    keys = [
        lock_key(config.lease.namespace, lane.name)
        for name, outbox in config.outboxes.items()
        for lane in lanes_of(name, outbox.partitions)
    ]
    for holder in await conn.fetch(_UNENDABLE_HOLDERS, keys):
        found.append(
            Missing(
                f"ending the sessions of role {holder['role']!r}",
                "a lease of this config is held now by the session"
                f" {holder['application_name'] or '(no application_name)'} of role"
                f" {holder['role']!r}, which this role may not end: if that"
                " holder goes silent, heartbeat takeover cannot work and its outboxes stop"
                " until it is stopped by hand; run every replica as the same role",
                "run every replica as one role that is not a superuser (only a superuser may"
                " end a superuser's session)"
                if holder["superuser"]
                else f"GRANT pg_signal_backend TO {to};",
                required=False,
            )
        )
    if not role["signal_backend"]:
        found.append(
            Missing(
                "membership in pg_signal_backend (ending a silent holder's session)",
                f"this role may end only sessions of its own role {role['name']!r}: heartbeat"
                " takeover, which ends the session of a holder that went silent, works only"
                " while every replica connects as this same role (not with a role per pod,"
                " as dynamic database credentials give)",
                f"GRANT pg_signal_backend TO {to};",
                required=False,
            )
        )
    return found
