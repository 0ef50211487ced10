"""The relay's own schema: versioned, idempotent migrations.

`relay migrate` is the only thing that creates tables. `relay run` checks the
version and refuses to start against an unmigrated database, naming the
command to run, so nothing is created behind an operator's back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import asyncpg

from relay.config import RelayConfig, SourceConfig
from relay.errors import DatabaseError, NotMigratedError
from relay.postgres.database import Database
from relay.postgres.source import Blocker
from relay.postgres.sql import qualified, quote

# Each entry is applied once, in order; one `relay migrate` applies all it lacks in one
# transaction (all or none). Never edit a released step: append a new one.
STEPS: tuple[str, ...] = (
    """
    CREATE TABLE {schema}.checkpoints (
      outbox       text        PRIMARY KEY,
      position     bigint      NOT NULL CHECK (position >= 0),
      epoch        bigint      NOT NULL DEFAULT 0,
      holder       text,
      held_since   timestamptz,
      state        text        NOT NULL DEFAULT 'starting',
      attempts     integer     NOT NULL DEFAULT 0,
      last_error   text,
      blocking     jsonb,
      updated_at   timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE {schema}.parked (
      id             bigserial   PRIMARY KEY,
      outbox         text        NOT NULL,
      position       bigint      NOT NULL,
      event_type     text        NOT NULL,
      aggregate_type text        NOT NULL,
      aggregate_id   text        NOT NULL,
      version        bigint      NOT NULL,
      message_id     text,
      message_type   text,
      destination    text,
      message_key    text,
      body           bytea,
      reason         text        NOT NULL,
      error          text        NOT NULL,
      attempts       integer     NOT NULL,
      parked_at      timestamptz NOT NULL DEFAULT now(),
      UNIQUE (outbox, position)
    );
    """,
    """
    ALTER TABLE {schema}.checkpoints ADD COLUMN heartbeat timestamptz;
    """,
    """
    CREATE TABLE {schema}.commands (
      id            bigserial   PRIMARY KEY,
      outbox        text        NOT NULL,
      kind          text        NOT NULL CHECK (kind IN ('replay', 'retry-parked')),
      args          jsonb       NOT NULL DEFAULT '{{}}',
      requested_by  text        NOT NULL,
      requested_at  timestamptz NOT NULL DEFAULT now(),
      state         text        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'running', 'done', 'failed', 'expired')),
      executed_by   text,
      finished_at   timestamptz,
      outcome       jsonb
    );
    CREATE INDEX ON {schema}.commands (outbox, id) WHERE state = 'pending';
    """,
    # A malformed row (a NULL aggregate id, say) must still be parkable; an outbox can be
    # halted (its head went below the checkpoint); the head message's retry count survives
    # restarts and takeovers; `start: end` settles its first position after writers in flight.
    """
    ALTER TABLE {schema}.parked
      ALTER COLUMN event_type DROP NOT NULL,
      ALTER COLUMN aggregate_type DROP NOT NULL,
      ALTER COLUMN aggregate_id DROP NOT NULL,
      ALTER COLUMN version DROP NOT NULL;
    ALTER TABLE {schema}.checkpoints
      ADD COLUMN halted text,
      ADD COLUMN retry_position bigint,
      ADD COLUMN rejections integer NOT NULL DEFAULT 0,
      ADD COLUMN start_xmin bigint;
    """,
    # Partitioned outboxes: how many lanes each outbox was started with (a replica refuses
    # another count until `relay repartition`), and the replicas alive, for the fair share.
    """
    CREATE TABLE {schema}.outboxes (
      outbox      text        PRIMARY KEY,
      partitions  integer     NOT NULL CHECK (partitions >= 1),
      updated_at  timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE {schema}.replicas (
      identity    text        PRIMARY KEY,
      namespace   text        NOT NULL,
      pid         integer     NOT NULL,
      seen_at     timestamptz NOT NULL DEFAULT now()
    );
    """,
    # The broker each checkpoint was last written for (type and hosts, no credentials), so
    # that an outbox pointed at another broker says so at start-up.
    """
    ALTER TABLE {schema}.checkpoints ADD COLUMN broker text;
    """,
    # Several messages per event (a list of rules): each is parked, and its failures
    # counted, on its own; `rule` names it ('' for an event type's single rule).
    """
    ALTER TABLE {schema}.parked ADD COLUMN rule text NOT NULL DEFAULT '';
    ALTER TABLE {schema}.parked DROP CONSTRAINT parked_outbox_position_key;
    ALTER TABLE {schema}.parked ADD CONSTRAINT parked_outbox_position_rule_key
      UNIQUE (outbox, position, rule);
    ALTER TABLE {schema}.checkpoints ADD COLUMN retry_rule text NOT NULL DEFAULT '';
    """,
    # The partition set as one record per outbox, checked in every claim: where a new lane
    # starts (`start: end` decided once, at the outbox's first claim), whether the count was
    # set by `relay repartition` (replicas then never change it back on their own), and who
    # changed it. A lane made by a repartition skips what the old lanes had already published
    # (their checkpoints, by the old count) until it passes the furthest of them. An outbox
    # relayed before gets its record, without a start: a lane of it that never ran takes its
    # start at its first claim, as it did. A replica's
    # heartbeat says which outboxes it runs with which count, and how many more lanes it may
    # take, so that lanes are shared among the replicas that can relay them.
    """
    ALTER TABLE {schema}.outboxes
      ADD COLUMN start_position bigint,
      ADD COLUMN start_xmin bigint,
      ADD COLUMN pinned boolean NOT NULL DEFAULT false,
      ADD COLUMN changed_by text;
    INSERT INTO {schema}.outboxes (outbox, partitions)
      SELECT outbox, 1 FROM {schema}.checkpoints WHERE strpos(outbox, '/') = 0
      ON CONFLICT (outbox) DO NOTHING;
    ALTER TABLE {schema}.checkpoints ADD COLUMN skip jsonb;
    ALTER TABLE {schema}.replicas
      ADD COLUMN outboxes jsonb NOT NULL DEFAULT '{{}}',
      ADD COLUMN room integer;
    """,
    # Who asked for a command is the session that wrote it, not the text it wrote: anyone
    # who may INSERT a command could otherwise sign it with any name. An UPDATE keeps it.
    """
    CREATE FUNCTION {schema}.command_requested_by() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
      IF TG_OP = 'UPDATE' THEN
        NEW.requested_by := OLD.requested_by;
      ELSE
        NEW.requested_by := session_user::text || coalesce(
          ' (' || nullif(current_setting('application_name', true), '') || ')', '');
      END IF;
      RETURN NEW;
    END $$;
    CREATE TRIGGER requested_by BEFORE INSERT OR UPDATE OF requested_by
      ON {schema}.commands FOR EACH ROW EXECUTE FUNCTION {schema}.command_requested_by();
    """,
    # Each replica's release in its heartbeat, for the status page (NULL: a release before it).
    """
    ALTER TABLE {schema}.replicas ADD COLUMN version text;
    """,
    # The continuous audit's place per outbox (docs/delivery.md, Proving delivery): where it
    # has read the broker back to, so that a restart or a takeover resumes there; and what
    # it found, for `relay status` and the status page. A new table: releases before it run on.
    # Every role gets on it the rights it has on the checkpoints (the relay's role writes both,
    # a reader reads both), so that no GRANT stands between the upgrade and the new replicas.
    """
    CREATE TABLE {schema}.audits (
      outbox           text        PRIMARY KEY,
      position         bigint      NOT NULL CHECK (position >= 0),
      audited_at       timestamptz NOT NULL DEFAULT now(),
      checked          bigint      NOT NULL DEFAULT 0,
      missing          bigint      NOT NULL DEFAULT 0,
      last_missing     jsonb,
      last_missing_at  timestamptz,
      last_error       text,
      auditor          text
    );
    DO $grant$ DECLARE r record; BEGIN
      FOR r IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
          AS grantee, a.privilege_type
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{schema}.checkpoints'::regclass AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE')
      LOOP
        EXECUTE format('GRANT %s ON {schema}.audits TO %s', r.privilege_type, r.grantee);
      END LOOP;
    END $grant$;
    """,
)

LATEST = len(STEPS)
# The steps that contract (docs/upgrading.md): each drops or changes something an older
# relay uses, so relays built before it must refuse the schema. Step version -> the oldest
# LATEST that still runs after it. Every other step expands (adds nullable or defaulted
# columns, new tables): the previous release keeps running against it.
CONTRACTS: Mapping[int, int] = MappingProxyType({})
_MIGRATE_LOCK = 0x72656C61_796D6967  # "relaymig": one migrator at a time


async def schema_version(conn: asyncpg.Connection, schema: str) -> int:
    """0 when the relay's schema has never been migrated."""
    table = f"{quote(schema)}.schema_version"
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        return 0
    return int(await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {table}"))


async def readers_from(conn: asyncpg.Connection, schema: str) -> int:
    """The oldest LATEST that may run against the schema: 0 unless a step contracted.

    Recorded by `relay migrate` beside each version (a schema migrated before this was
    recorded has none, and every relay since knows its steps).
    """
    table = f"{quote(schema)}.schema_version"
    if not await _records_readers(conn, table):
        return 0
    return int(await conn.fetchval(f"SELECT coalesce(max(readers_from), 0) FROM {table}"))


async def _records_readers(conn: asyncpg.Connection, table: str) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT count(*) FROM pg_attribute"
            " WHERE attrelid = $1::regclass AND attname = 'readers_from' AND NOT attisdropped",
            table,
        )
    )


async def ensure_migrated(conn: asyncpg.Connection, schema: str) -> int:
    """The schema's version, when this relay can run against it; else NotMigratedError.

    A newer schema is accepted while its newer steps only expand it (`CONTRACTS`): the
    previous release's replicas keep starting during a rolling upgrade, and after a rollback.
    """
    version = await schema_version(conn, schema)
    if version < LATEST:
        raise NotMigratedError(
            f"the relay's tables in schema {schema!r} are at version {version}, this relay needs "
            f"{LATEST}: run `relay migrate --config FILE` first"
        )
    if version > LATEST and (oldest := await readers_from(conn, schema)) > LATEST:
        raise NotMigratedError(
            f"schema {schema!r} is at version {version}, newer than this relay ({LATEST}), and"
            f" one of its steps removed what this relay uses (it needs a relay of schema"
            f" version {oldest} or later): upgrade the relay"
        )
    return version


def newer_schema(schema: str, version: int) -> str | None:
    """What a relay says when it runs against a schema newer than itself, or None."""
    if version <= LATEST:
        return None
    return (
        f"schema {schema!r} is at version {version}, newer than this relay ({LATEST}); its newer"
        " steps only add to it, so this relay runs: finish upgrading the replicas"
    )


@dataclass(frozen=True, slots=True)
class Migrated:
    """What `relay migrate` did: the schema versions applied, and the NOTIFY trigger."""

    applied: list[int]
    trigger: str  # installed, removed, replaced, unchanged, absent, or no table


OnWait = Callable[[str], None]


async def migrate(
    conn: asyncpg.Connection,
    config: RelayConfig,
    on_wait: OnWait | None = None,
    steps: tuple[str, ...] = STEPS,
    contracts: Mapping[int, int] | None = None,
) -> Migrated:
    """Apply the missing steps, then bring the NOTIFY trigger in line with the config.

    The relay's own tables are changed in one transaction; the application's event
    table is touched only when its trigger must change, and then politely (see
    `_sync_notify_trigger`). Each version applied records the oldest relay that may still
    run against the schema (`readers_from`); `steps` and `contracts` are parameters so that
    a test can play a later release's migration.
    """
    schema = quote(config.database.schema_)
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATE_LOCK)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {schema}.schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        # Added beside the table, not by a step: a step would make the previous release
        # refuse the schema, and the column is what lets later steps avoid that. Altered
        # only when missing, so that an up-to-date schema is not locked by each deploy.
        if not await _records_readers(conn, f"{schema}.schema_version"):
            await conn.execute(
                f"ALTER TABLE {schema}.schema_version ADD COLUMN readers_from integer"
            )
        current = await schema_version(conn, config.database.schema_)
        oldest = await readers_from(conn, config.database.schema_)
        contracting = CONTRACTS if contracts is None else contracts
        for version, step in enumerate(steps, start=1):
            if version <= current:
                continue
            await conn.execute(step.format(schema=schema))
            oldest = max(oldest, contracting.get(version, 0))
            await conn.execute(
                f"INSERT INTO {schema}.schema_version (version, readers_from) VALUES ($1, $2)",
                version,
                oldest,
            )
            applied.append(version)
    trigger = await _sync_notify_trigger(conn, schema, config.source, on_wait or _quiet)
    return Migrated(applied, trigger)


async def migrate_database(
    db: Database, config: RelayConfig, on_wait: OnWait | None = None
) -> Migrated:
    """`migrate` on a connection of its own, for `relay migrate` and the tests."""
    async with db.one_shot("migrate") as conn:
        return await migrate(conn, config, on_wait)


def _quiet(_: str) -> None:
    """No one to tell."""


# CREATE/DROP TRIGGER take ShareRowExclusiveLock on the table: while that request waits
# for an open writer, every new writer queues behind it. So ask briefly, let go, and ask
# again, saying who holds the table meanwhile.
_LOCK_TIMEOUT = "500ms"
_GIVE_UP_AFTER = 600.0
_HOLDERS = """
SELECT DISTINCT a.pid, coalesce(a.application_name, '') AS application_name,
       coalesce(a.state, '') AS state,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_age
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = $1::regclass AND l.granted
  AND l.pid <> pg_backend_pid()
ORDER BY xact_age DESC NULLS LAST
"""


async def _sync_notify_trigger(
    conn: asyncpg.Connection, schema: str, source: SourceConfig, on_wait: OnWait
) -> str:
    """Install the optional NOTIFY trigger, or remove ours when the option is off.

    Nothing on the event table is locked when it already matches the config.
    """
    table = qualified(source.table)
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        return "no table"
    name = f"relay_notify_{source.notify_channel}"
    function = f"{schema}.{quote('notify_' + source.notify_channel)}"
    channel = source.notify_channel.replace("'", "''")
    body = f" BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END "
    present = await conn.fetchrow(
        "SELECT t.tgfoid, p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid"
        " WHERE t.tgrelid = $1::regclass AND t.tgname = $2 AND NOT t.tgisinternal",
        table,
        name,
    )
    create = (
        f"CREATE TRIGGER {quote(name)} AFTER INSERT ON {table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )
    drop = f"DROP TRIGGER IF EXISTS {quote(name)} ON {table}"
    if not source.notify_trigger:
        if present is None:
            return "absent"
        await _on_table(conn, table, [drop], on_wait)
        return "removed"
    wanted = await conn.fetchval("SELECT to_regprocedure($1)::oid", f"{function}()")
    if present is not None and present["prosrc"] == body and present["tgfoid"] == wanted:
        return "unchanged"
    # Replacing a function locks no table.
    quoted = dollar_quote(body)
    await conn.execute(
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS {quoted}"
    )
    await _on_table(conn, table, [drop, create], on_wait)
    return "installed" if present is None else "replaced"


def dollar_quote(body: str) -> str:
    """`body` between dollar quotes whose tag it does not contain (a channel may hold `$$`)."""
    tag = "$relay$"
    while (body + tag).find(tag) != len(body):  # the first tag after the opening one ends it
        tag = tag[:-1] + "_$"
    return f"{tag}{body}{tag}"


async def _on_table(
    conn: asyncpg.Connection, table: str, statements: list[str], on_wait: OnWait
) -> None:
    """Run DDL on the event table with a short lock_timeout, retrying until it gets through."""
    started, pause = time.monotonic(), 0.5
    while True:
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
                for statement in statements:
                    await conn.execute(statement)
            return
        except asyncpg.LockNotAvailableError:
            waited = time.monotonic() - started
            if waited > _GIVE_UP_AFTER:
                raise DatabaseError(
                    f"gave up changing the NOTIFY trigger on {table} after {waited:.0f}s: "
                    f"{await _who_holds(conn, table)}; run `relay migrate` again later"
                ) from None
            on_wait(
                f"waiting to change the NOTIFY trigger on {table} (writers are not held up"
                f" meanwhile): {await _who_holds(conn, table)}; retrying in {pause:g}s"
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


async def _who_holds(conn: asyncpg.Connection, table: str) -> str:
    rows = await conn.fetch(_HOLDERS, table)
    if not rows:
        return "another session held a lock on it"
    named = [
        Blocker(r["pid"], r["application_name"], r["state"], r["xact_age"] or 0.0, 0.0).describe()
        for r in rows[:3]
    ]
    return "held by " + ", ".join(named)
