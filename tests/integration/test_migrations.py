"""`relay migrate` during a deploy: it must never freeze the application's event table.

The chart runs migrate on every deploy. With `notify_trigger: true` it used to drop
and re-create the trigger each time, queueing for a lock that every writer then
waited behind. Each test holds a real writer transaction open on the table.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from relay.config import load_config
from relay.postgres.migrations import STEPS, migrate
from tests.support.db import append, connect
from tests.support.postgres import as_role
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, save

LENT = {"loanId": "L", "memberId": "m"}


def _config(tmp_path: Path, dsn: str, nats_url: str, *, trigger: bool) -> Path:
    name = f"relay-{trigger}.yaml"
    data = config_dict(dsn, nats_url, "unused")
    data["source"]["notify_trigger"] = trigger
    return save(tmp_path, data, name)


async def _triggers(dsn: str) -> int:
    async with connect(dsn) as conn:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'events'::regclass"
                " AND NOT tgisinternal"
            )
        )


async def _writer_can_append(dsn: str, version: int) -> None:
    """Another writer appends with a 3 s statement timeout, as applications configure it."""
    conn = await asyncpg.connect(dsn, server_settings={"statement_timeout": "3000"})
    try:
        await append(conn, "book", "other", version, "BookLent", LENT)
    finally:
        await conn.close()


async def test_migrate_on_an_up_to_date_schema_takes_no_lock_on_the_table(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    config = _config(tmp_path, events_table, nats_url, trigger=True)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    assert await _triggers(events_table) == 1
    async with connect(events_table) as writer, writer.transaction():
        await append(writer, "book", "open", 1, "BookLent", LENT)  # RowExclusiveLock held
        result = await asyncio.to_thread(run_cli, ["migrate", "--config", str(config)], None, 20)
        assert result.returncode == 0, result.stderr
        assert "up to date" in result.stdout and "unchanged" in result.stdout
        await _writer_can_append(events_table, 1)
    assert await _triggers(events_table) == 1


async def test_migrate_that_must_change_the_trigger_waits_politely_and_says_for_whom(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Callable[..., RelayProcess]
) -> None:
    config = _config(tmp_path, events_table, nats_url, trigger=True)
    assert await _triggers(events_table) == 0
    blocker = await asyncpg.connect(
        events_table, server_settings={"application_name": "checkout-service"}
    )
    try:
        tx = blocker.transaction()
        await tx.start()
        await append(blocker, "book", "open", 1, "BookLent", LENT)
        pid = await blocker.fetchval("SELECT pg_backend_pid()")
        migrating = relay_process(["migrate", "--config", str(config)])

        def says_who() -> bool:
            return f"pid {pid}" in migrating.stderr_path.read_text()

        for _ in range(200):
            if says_who() or migrating.returncode is not None:
                break
            await asyncio.sleep(0.05)
        assert says_who(), migrating.output()
        assert "checkout-service" in migrating.stderr_path.read_text()
        # Other writers are not stuck behind the waiting migration.
        await _writer_can_append(events_table, 1)
        await _writer_can_append(events_table, 2)
        assert migrating.returncode is None  # still waiting for the open transaction
        await tx.commit()
        assert await migrating.wait_async(20) == 0, migrating.output()
        assert "installed" in migrating.stdout_path.read_text()
    finally:
        await blocker.close()
    assert await _triggers(events_table) == 1


async def test_turning_the_trigger_off_removes_it(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    on = _config(tmp_path, events_table, nats_url, trigger=True)
    off = _config(tmp_path, events_table, nats_url, trigger=False)
    assert run_cli(["migrate", "--config", str(on)]).returncode == 0
    assert await _triggers(events_table) == 1
    result = run_cli(["migrate", "--config", str(off)])
    assert result.returncode == 0, result.stderr
    assert "removed" in result.stdout
    assert await _triggers(events_table) == 0


async def test_the_audit_table_comes_with_the_rights_roles_have_on_the_checkpoints(
    events_table: str, pg_admin_dsn: str, tmp_path: Path, nats_url: str
) -> None:
    """Step 11 adds relay.audits: a relay role granted what the docs said before it (no
    GRANT on the new table) keeps working after the upgrade, with no GRANT in between."""

    config = load_config(_config(tmp_path, events_table, nats_url, trigger=False))
    role, reader = f"relay_{uuid.uuid4().hex[:8]}", f"reader_{uuid.uuid4().hex[:8]}"
    async with connect(pg_admin_dsn) as admin:
        await admin.execute(f"CREATE ROLE {role} LOGIN; CREATE ROLE {reader} LOGIN")
    try:
        async with connect(events_table) as conn:
            await migrate(conn, config, steps=STEPS[:10])  # the schema before the audit
            await conn.execute(
                f"GRANT USAGE ON SCHEMA relay TO {role}, {reader};"
                f" GRANT SELECT, INSERT, UPDATE ON relay.checkpoints TO {role};"
                f" GRANT SELECT ON relay.checkpoints TO {reader}"
            )
        async with connect(events_table) as conn:
            await migrate(conn, config)
        async with connect(as_role(events_table, role)) as conn:
            await conn.execute("INSERT INTO relay.audits (outbox, position) VALUES ('x', 1)")
            await conn.execute("UPDATE relay.audits SET position = 2 WHERE outbox = 'x'")
        async with connect(as_role(events_table, reader)) as conn:
            assert await conn.fetchval("SELECT position FROM relay.audits") == 2
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute("UPDATE relay.audits SET position = 3")
    finally:
        async with connect(events_table) as conn:
            await conn.execute(f"DROP OWNED BY {role}; DROP OWNED BY {reader}")
        async with connect(pg_admin_dsn) as admin:
            await admin.execute(f"DROP ROLE {role}; DROP ROLE {reader}")
