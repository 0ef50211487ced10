"""`relay status --watch` rides out a database restart, as it refreshes until Ctrl-C.

It used to exit 1 at the first refresh that found the database gone. Now it shows one line
saying the database is unreachable (no traceback, no password) at each refresh, and the
table again once the database is back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.config import load_config
from relay.errors import DatabaseError
from relay.postgres.database import Database, DatabaseUnavailable
from tests.support.db import connect
from tests.support.postgres import EVENTS_SQL, EmbeddedPostgres, create_database
from tests.support.postgres import server as postgres_server
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, migrate_cli, save

PASSWORD = "s3cret-Pw"  # trust authentication accepts any: it must never be shown


@pytest.fixture
def restartable_postgres() -> Iterator[EmbeddedPostgres]:
    server = postgres_server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _with_password(dsn: str) -> str:
    return dsn.replace("postgres@", f"postgres:{PASSWORD}@")


async def test_status_watch_shows_the_database_unreachable_and_carries_on(
    restartable_postgres: EmbeddedPostgres, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    dsn = _with_password(create_database(restartable_postgres.dsn))
    async with connect(dsn) as conn:
        await conn.execute(EVENTS_SQL.read_text())
    path = save(tmp_path, config_dict(dsn, nats_url, "watched"))
    migrate_cli(path)
    table: RelayProcess = relay_process(["status", "--watch", "--config", str(path)])
    lines: RelayProcess = relay_process(["status", "--watch", "--json", "--config", str(path)])

    def out(process: RelayProcess) -> str:
        return process.stdout_path.read_text()

    def refreshes(process: RelayProcess, what: str) -> int:
        return out(process).count(what)

    await eventually(lambda: refreshes(table, "NAME  ") >= 1, timeout=20)
    await eventually(lambda: refreshes(lines, '"name": "loans"') >= 1, timeout=20)

    await asyncio.to_thread(restartable_postgres.halt)
    try:
        await eventually(lambda: refreshes(table, "database unreachable") >= 3, timeout=20)
        await eventually(lambda: lines.stderr_path.read_text().count("unreachable") >= 3)
        assert table.returncode is None, table.output()
        assert lines.returncode is None, lines.output()
    finally:
        await asyncio.to_thread(restartable_postgres.resume)
    before = refreshes(table, "NAME  ")
    await eventually(lambda: refreshes(table, "NAME  ") > before + 1, timeout=20)
    after = out(lines).count('"name": "loans"')
    await eventually(lambda: refreshes(lines, '"name": "loans"') > after + 1, timeout=20)

    for process in (table, lines):
        process.interrupt()
        assert await process.wait_async(10) == 0, process.output()
        assert "Traceback" not in process.output()
        assert PASSWORD not in process.output()
    # One line per refresh while the database was down, under that refresh's time stamp.
    down = [line for line in out(table).splitlines() if "unreachable" in line]
    assert all(line.startswith("database unreachable: ") for line in down), down
    assert f"127.0.0.1:{restartable_postgres.port}" in down[0], down[0]
    # --json keeps stdout to one JSON array per refresh; the outage goes to stderr.
    assert all(isinstance(json.loads(line), list) for line in out(lines).splitlines())


async def test_a_session_whose_connection_is_cut_mid_command_is_unavailable_not_refused(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """What a one-shot command's session raises when the server ends it: worth retrying
    (DatabaseUnavailable), unlike a statement the server refuses (DatabaseError)."""
    config = load_config(save(tmp_path, config_dict(database, nats_url, "cut")))
    db = Database(config.database, "relay:tests:0")
    with pytest.raises(DatabaseUnavailable, match="lost the connection"):
        async with db.one_shot("status") as conn:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    with pytest.raises(DatabaseError, match="failed the command") as refused:
        async with db.one_shot("status") as conn:
            await conn.execute("SELECT * FROM no_such_table")
    assert not isinstance(refused.value, DatabaseUnavailable)
