"""The database roles of docs/operations.md, as written there: the relay, an operator, a reader.

A command row is operator power, so who may write one, and who is recorded as having asked,
are checked against the real server with the GRANTs the operator copies from the docs.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.db import append_many, connect
from tests.support.jetstream import delete_stream
from tests.support.operator_cli import relay_then_stop, setup_outbox
from tests.support.postgres import as_role
from tests.support.relay_process import run_cli
from tests.support.scenario import eventually, loans, migrate_cli, write_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def doc_sql(after: str) -> str:
    """The first ```sql block after the heading `after` in docs/operations.md."""
    text = DOC.read_text()
    found = re.search(re.escape(after) + r".*?```sql\n(.*?)```", text, re.S)
    assert found, f"no sql block after {after!r} in {DOC}"
    return found.group(1)


@dataclass(frozen=True)
class Outbox:
    config: Path
    stream: str


@dataclass(frozen=True)
class Roles:
    relay: str
    operator: str
    reader: str
    dsn: dict[str, str]
    outbox: Outbox


@pytest.fixture
async def outbox(events_table: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Outbox]:
    """A stream, and a config relaying to it as the superuser, migrated."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        yield Outbox(config, stream)
    finally:
        await delete_stream(nats_url, stream)


@pytest.fixture
async def roles(events_table: str, pg_admin_dsn: str, outbox: Outbox) -> AsyncIterator[Roles]:
    """The docs' three roles under fresh names, with exactly the docs' GRANTs."""
    tag = uuid.uuid4().hex[:8]
    names = {"outbox_relay": f"relay_{tag}", "alice": f"alice_{tag}"}
    names["outbox_reader"] = f"reader_{tag}"
    sql = doc_sql("### 1. Database rights") + doc_sql("#### Operators and readers")
    for doc_name, name in names.items():
        sql = re.sub(rf"\b{doc_name}\b", name, sql)
    made = Roles(
        names["outbox_relay"],
        names["alice"],
        names["outbox_reader"],
        {name: as_role(events_table, name) for name in names.values()},
        outbox,
    )
    try:
        async with connect(pg_admin_dsn) as admin:
            await admin.execute(f"CREATE ROLE {names['outbox_relay']} LOGIN")
        # CREATE ROLE is per server, the GRANTs per database: both in the test's database.
        async with connect(events_table) as conn:
            await conn.execute(sql)
        yield made
    finally:  # roles outlive the test's database: dropped whatever happened
        async with connect(events_table) as conn:
            for name in names.values():
                await conn.execute(
                    f"DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}')"
                    f" THEN DROP OWNED BY {name}; END IF; END $$"
                )
        async with connect(pg_admin_dsn) as admin:
            for name in names.values():
                await admin.execute(f"DROP ROLE IF EXISTS {name}")


def as_(tmp_path: Path, dsn: str, nats_url: str, stream: str) -> Path:
    """The same outbox's config, logging in with `dsn`."""
    return write_config(tmp_path, dsn, nats_url, stream, name=f"{uuid.uuid4().hex}.yaml")


def cli(config: Path, *args: str) -> tuple[int, Any, str]:
    result = run_cli([*args, "--config", str(config), "--json"])
    out = json.loads(result.stdout) if result.returncode == 0 else None
    return result.returncode, out, result.stderr


async def test_each_role_does_what_the_docs_say_and_no_more(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any, roles: Roles
) -> None:
    stream = roles.outbox.stream
    relay = as_(tmp_path, roles.dsn[roles.relay], nats_url, stream)
    async with connect(events_table) as conn:
        positions = await append_many(conn, loans(10))
    await relay_then_stop(relay_process, relay, positions[-1])

    reader = as_(tmp_path, roles.dsn[roles.reader], nats_url, stream)
    code, shown, err = await asyncio.to_thread(cli, reader, "status")
    assert code == 0, err
    assert shown[0]["checkpoint"] == positions[-1]
    code, parked, err = await asyncio.to_thread(cli, reader, "parked", "list", "loans")
    assert code == 0 and parked == [], err

    code, _, err = await asyncio.to_thread(
        cli, reader, "replay", "loans", "--from", str(positions[4])
    )
    assert code == 1, err
    assert "permission denied" in err, err
    async with connect(events_table) as conn:
        assert await conn.fetchval("SELECT count(*) FROM relay.commands") == 0
    code, shown, err = await asyncio.to_thread(cli, reader, "status")
    assert shown[0]["checkpoint"] == positions[-1], "a reader moved the checkpoint"

    operator = as_(tmp_path, roles.dsn[roles.operator], nats_url, stream)
    code, done, err = await asyncio.to_thread(
        cli, operator, "replay", "loans", "--from", str(positions[4])
    )
    assert code == 0 and done["ok"], err
    async with connect(events_table) as conn:
        (row,) = await conn.fetch("SELECT id, requested_by FROM relay.commands")
        assert row["requested_by"].startswith(f"{roles.operator} (relay:"), row
        assert row["requested_by"].endswith(")")


async def test_requested_by_is_the_session_that_wrote_the_row_not_its_text(
    events_table: str, roles: Roles
) -> None:
    """The audit trail cannot be signed with someone else's name."""
    async with connect(roles.dsn[roles.operator]) as conn:
        await conn.execute("SET application_name = 'psql'")
        forged = await conn.fetchval(
            "INSERT INTO relay.commands (outbox, kind, args, requested_by)"
            " VALUES ('loans', 'replay', '{\"to\": 0}', 'the-ceo') RETURNING requested_by"
        )
        assert forged == f"{roles.operator} (psql)"
        await conn.execute("SET ROLE " + roles.relay)
        await conn.execute("UPDATE relay.commands SET requested_by = 'the-ceo'")
        kept = await conn.fetchval("SELECT requested_by FROM relay.commands")
        assert kept == f"{roles.operator} (psql)"
        await conn.execute("RESET ROLE")
        await conn.execute("SET application_name = ''")
        bare = await conn.fetchval(
            "INSERT INTO relay.commands (outbox, kind, args, requested_by)"
            " VALUES ('loans', 'replay', '{\"to\": 0}', 'x') RETURNING requested_by"
        )
        assert bare == roles.operator
    migrate_cli(roles.outbox.config)  # migrating again keeps the trigger as it is
    async with connect(events_table) as conn:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'relay.commands'::regclass"
                " AND NOT tgisinternal"
            )
            == 1
        )


async def test_a_standby_at_its_roles_connection_limit_backs_off_and_claims_once_it_can(  # noqa: PLR0917
    events_table: str,
    pg_admin_dsn: str,
    nats_url: str,
    tmp_path: Path,
    relay_process: Any,
    roles: Roles,
) -> None:
    """A standby whose role has no connection left takes the free lane's lock, cannot open
    the connection its claim reads on, and lets it go: it did so every retry interval, with
    every lane of the outbox marked `database unavailable`, for as long as the limit held.
    Its attempts at that lane now back off (the database's retry policy), each said once;
    the rest of the replica carries on, and the lane is claimed once a connection is free."""
    stream, role = roles.outbox.stream, roles.relay
    holder = relay_process(["run", "--config", str(roles.outbox.config)])
    await holder.wait_for_log("lease acquired: relaying")
    standby_config = as_(tmp_path, roles.dsn[role], nats_url, stream)
    standby = relay_process(["run", "--config", str(standby_config)])
    await standby.wait_for_log(lambda r: "standing by" in str(r.get("event")))
    async with connect(pg_admin_dsn) as admin:
        used = await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT {used}")
        try:
            holder.kill()
            await eventually(lambda: len(not_claimed(standby)) >= 3, timeout=60)
            delays = [r["retry_in"] for r in not_claimed(standby)[:3]]
            assert delays[0] < delays[1] < delays[2], delays
            assert "too many connections" in not_claimed(standby)[0]["error"]
            assert not [
                r for r in standby.logs() if r.get("event") == "database unavailable, retrying"
            ]
        finally:
            await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
    await standby.wait_for_log("lease acquired: relaying", timeout=60)


def not_claimed(replica: Any) -> list[dict[str, Any]]:
    return [
        r
        for r in replica.logs()
        if r.get("event") == "lane not claimed: no connection for its reads"
    ]
