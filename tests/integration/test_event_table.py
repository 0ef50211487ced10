"""What the relay refuses in an event table, and says before it runs.

Each refused layout would lose events or crash the relay later; the message names
the key, the table or child at fault, and the fix.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from relay.config import SourceConfig
from relay.errors import SourceError
from relay.postgres.source import EventSource
from tests.support import postgres
from tests.support.db import connect
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, save

_REST = """
  aggregate_type text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL,
  type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
  created_at timestamptz NOT NULL DEFAULT now()
"""

REFUSED = {
    "missing table": ("", "source.table: table 'events' does not exist"),
    "a column named as the relay's own": (
        "CREATE TABLE events (position bigserial PRIMARY KEY, aggregate_type text,"
        " aggregate_id text, version bigint, type text, payload jsonb, metadata jsonb,"
        " created_at timestamptz, relay_page_rows int)",
        "source.table: table 'events' has a column named 'relay_page_rows', a name the relay's"
        " read gives a column of its own; rename that column",
    ),
    "payload bytea": (
        "CREATE TABLE events (position bigserial PRIMARY KEY, aggregate_type text,"
        " aggregate_id text, version bigint, type text, payload bytea, metadata jsonb,"
        " created_at timestamptz)",
        "source.columns.payload: column 'payload' of table 'events' is bytea;"
        " the relay needs json, jsonb or text",
    ),
    "version text": (
        "CREATE TABLE events (position bigserial PRIMARY KEY, aggregate_type text,"
        " aggregate_id text, version text, type text, payload jsonb, metadata jsonb,"
        " created_at timestamptz)",
        "source.columns.version: column 'version' of table 'events' is text",
    ),
    "nullable position": (
        f"CREATE SEQUENCE s; CREATE TABLE events (position bigint DEFAULT nextval('s'), {_REST});"
        " ALTER SEQUENCE s OWNED BY events.position",
        "source.columns.position: column 'position' of table 'events' allows NULL",
    ),
    "no sequence": (
        f"CREATE TABLE events (position bigint PRIMARY KEY, {_REST})",
        "source.columns.position: column 'position' takes no value from a sequence",
    ),
    "cached sequence": (
        f"CREATE TABLE events (position bigserial PRIMARY KEY, {_REST});"
        " ALTER SEQUENCE events_position_seq CACHE 20",
        "run ALTER SEQUENCE public.events_position_seq CACHE 1",
    ),
    "child with its own sequence": (
        f"CREATE TABLE events (position bigserial PRIMARY KEY, {_REST});"
        " CREATE TABLE events_2026 (position bigserial) INHERITS (events)",
        "source.table: events_2026 (part of \"events\") takes its 'position' from sequence"
        " events_2026_position_seq, not public.events_position_seq",
    ),
    "partition with another default": (
        f"CREATE TABLE events (position bigserial, {_REST}) PARTITION BY RANGE (created_at);"
        " CREATE SEQUENCE other; CREATE TABLE events_x PARTITION OF events"
        " FOR VALUES FROM (MINVALUE) TO (MAXVALUE);"
        " ALTER TABLE events_x ALTER COLUMN position SET DEFAULT nextval('other')",
        "events_x (part of \"events\") takes its 'position' from sequence other",
    ),
}

ACCEPTED = {
    "identity": f"CREATE TABLE events (position bigint GENERATED ALWAYS AS IDENTITY, {_REST})",
    "partitions": (
        f"CREATE TABLE events (position bigserial, {_REST}) PARTITION BY RANGE (created_at);"
        " CREATE TABLE events_a PARTITION OF events FOR VALUES FROM (MINVALUE) TO ('2030-01-01');"
        " CREATE TABLE events_b PARTITION OF events FOR VALUES FROM ('2030-01-01') TO (MAXVALUE)"
    ),
    "inheritance": (
        f"CREATE TABLE events (position bigserial PRIMARY KEY, {_REST});"
        " CREATE TABLE events_2026 () INHERITS (events)"
    ),
    "text payloads": (
        "CREATE TABLE events (position bigserial PRIMARY KEY, aggregate_type text,"
        " aggregate_id text, version integer, type text, payload text, metadata json,"
        " created_at timestamp)"
    ),
}


async def _check(dsn: str, ddl: str) -> None:
    async with connect(dsn) as conn:
        if ddl:
            await conn.execute(ddl)
        await EventSource(SourceConfig()).check(conn)


@pytest.mark.parametrize("case", list(REFUSED))
async def test_layouts_that_would_lose_events_are_refused(case: str, database: str) -> None:
    ddl, message = REFUSED[case]
    with pytest.raises(SourceError) as caught:
        await _check(database, ddl)
    assert message in str(caught.value)


@pytest.mark.parametrize("case", list(ACCEPTED))
async def test_layouts_the_relay_reads(case: str, database: str) -> None:
    await _check(database, ACCEPTED[case])


async def test_relay_check_names_the_fault_without_a_traceback(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    ddl, message = REFUSED["child with its own sequence"]
    async with connect(database) as conn:
        await conn.execute(ddl)
    config = save(tmp_path, config_dict(database, nats_url, "unused"))
    result = run_cli(["check", "--config", str(config)])
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


async def test_relay_check_warns_that_the_notify_trigger_prevents_two_phase_commit(
    private_database: str, nats_url: str, tmp_path: Path
) -> None:
    postgres.run_sql_file(private_database)
    data = config_dict(private_database, nats_url, "unused")
    data["source"]["notify_trigger"] = True
    config = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    result = run_cli(["check", "--config", str(config)])
    assert result.returncode == 0, result.stderr
    assert "warning: source.notify_trigger is on" in result.stderr
    assert "max_prepared_transactions = 10" in result.stderr
    # What the warning is about, for real: the application cannot prepare such a transaction.
    async with connect(private_database) as conn:
        await conn.execute(
            "BEGIN; INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
            " VALUES ('book', 'b', 1, 'BookLent', '{}')"
        )
        with pytest.raises(asyncpg.FeatureNotSupportedError, match="NOTIFY"):
            await conn.execute("PREPARE TRANSACTION 'app-tx'")
    data["source"]["notify_trigger"] = False
    quiet = save(tmp_path, data, "quiet.yaml")
    assert run_cli(["migrate", "--config", str(quiet)]).returncode == 0
    assert "warning" not in run_cli(["check", "--config", str(quiet)]).stderr


async def test_relay_check_warns_about_a_costly_poll_interval(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    data = config_dict(events_table, nats_url, "unused")
    data["source"]["poll_interval"] = "20ms"
    result = run_cli(["check", "--config", str(save(tmp_path, data))])
    assert result.returncode == 0, result.stderr
    assert "warning: source.poll_interval is 20ms" in result.stderr
