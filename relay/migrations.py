"""The relay's own schema: versioned, idempotent migrations.

`relay migrate` is the only thing that creates tables. `relay run` checks the
version and refuses to start against an unmigrated database, naming the
command to run, so nothing is created behind an operator's back.
"""

from __future__ import annotations

import asyncpg

from relay.config import RelayConfig, SourceConfig
from relay.errors import NotMigratedError
from relay.sql import qualified, quote

# Each entry is applied once, in order, in its own transaction. Never edit a
# released step: append a new one.
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
)

LATEST = len(STEPS)
_MIGRATE_LOCK = 0x72656C61_796D6967  # "relaymig": one migrator at a time


async def schema_version(conn: asyncpg.Connection, schema: str) -> int:
    """0 when the relay's schema has never been migrated."""
    table = f"{quote(schema)}.schema_version"
    if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
        return 0
    return int(await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {table}"))


async def ensure_migrated(conn: asyncpg.Connection, schema: str) -> None:
    version = await schema_version(conn, schema)
    if version < LATEST:
        raise NotMigratedError(
            f"the relay's tables in schema {schema!r} are at version {version}, this relay needs "
            f"{LATEST}: run `relay migrate --config FILE` first"
        )
    if version > LATEST:
        raise NotMigratedError(
            f"schema {schema!r} is at version {version}, newer than this relay ({LATEST}): "
            "upgrade the relay"
        )


async def migrate(conn: asyncpg.Connection, config: RelayConfig) -> list[int]:
    """Apply the missing steps; return the versions applied (empty when up to date)."""
    schema = quote(config.database.schema_)
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATE_LOCK)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {schema}.schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = await schema_version(conn, config.database.schema_)
        for version, step in enumerate(STEPS, start=1):
            if version <= current:
                continue
            await conn.execute(step.format(schema=schema))
            await conn.execute(
                f"INSERT INTO {schema}.schema_version (version) VALUES ($1)", version
            )
            applied.append(version)
        await _sync_notify_trigger(conn, schema, config.source)
    return applied


async def _sync_notify_trigger(conn: asyncpg.Connection, schema: str, source: SourceConfig) -> None:
    """Install the optional NOTIFY trigger, or remove ours when the option is off."""
    table = qualified(source.table)
    trigger = quote(f"relay_notify_{source.notify_channel}")
    function = f"{schema}.{quote('notify_' + source.notify_channel)}"
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
    if not exists:
        return
    if not source.notify_trigger:
        await conn.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
        return
    channel = source.notify_channel.replace("'", "''")
    await conn.execute(
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$"
    )
    await conn.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
    await conn.execute(
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    )
