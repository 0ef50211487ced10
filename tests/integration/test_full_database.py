"""A database with no connection slot free is waited for, like an unreachable one.

A replica started while PostgreSQL was at max_connections exited 1 at once ("sorry, too many
clients already"), as for a bad config; in a surge rollout the new pods start before the old
ones have gone. Each test runs its own PostgreSQL with a few slots, fills them, and frees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.support.db import append_many, connect
from tests.support.jetstream import fetch_all
from tests.support.postgres import EVENTS_SQL, EmbeddedPostgres, create_database, with_database
from tests.support.postgres import server as postgres_server
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, loans, migrate_cli, save

# superuser_reserved_connections stays at its default, 3: other roles get the other 5.
MAX_CONNECTIONS = 8


@pytest.fixture
def small_postgres() -> Iterator[EmbeddedPostgres]:
    server = postgres_server({"max_connections": str(MAX_CONNECTIONS)})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def all_slots_taken(dsn: str, slots: int) -> AsyncIterator[None]:
    """`slots` connections to `dsn`, the server then refusing one more; all closed on the
    way out. A connection closed just before may hold a slot until its backend has exited:
    one more is tried until it has."""
    held: list[asyncpg.Connection] = []

    async def one_more() -> bool:
        with contextlib.suppress(asyncpg.TooManyConnectionsError):
            held.append(await asyncpg.connect(dsn))
        return len(held) == slots

    try:
        await eventually(one_more)
        with pytest.raises(asyncpg.TooManyConnectionsError):
            held.append(await asyncpg.connect(dsn))
        yield
    finally:
        for conn in held:
            await conn.close()


def _waiting_for_a_slot(text: str) -> Any:
    def matches(record: dict[str, Any]) -> bool:
        return record.get("event") == "database unreachable, retrying" and text in str(
            record.get("error")
        )

    return matches


async def test_a_replica_started_on_a_full_database_waits_and_then_relays(
    small_postgres: EmbeddedPostgres,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    relay_process: Any,
) -> None:
    dsn = create_database(small_postgres.dsn)
    async with connect(dsn) as conn:
        await conn.execute(EVENTS_SQL.read_text())
        await append_many(conn, loans(3))
    path = save(tmp_path, config_dict(dsn, nats_url, stream))
    migrate_cli(path)
    async with all_slots_taken(dsn, MAX_CONNECTIONS):
        relay: RelayProcess = relay_process(["run", "--config", str(path)])
        record = await relay.wait_for_log(_waiting_for_a_slot("too many clients"))
        assert "no connection slot free" in record["error"], record
        assert record["level"] == "warning"
        # It keeps waiting with the database backoff, as for an unreachable server.
        await relay.wait_for_log(
            lambda r: r.get("event") == "database unreachable, retrying" and r["attempt"] == 3
        )
        assert relay.returncode is None, relay.output()
    received = await fetch_all(nats_url, stream, expected=3, timeout=30)
    assert [m.headers["ce-id"] for m in received] == [f"book/b{i}@1" for i in range(3)]
    assert "Traceback" not in relay.output()
    relay.terminate()
    assert await relay.wait_async(15) == 0, relay.output()


async def _own_database(admin_dsn: str, role: str) -> str:
    """A database owned by a role that is not a superuser, with the event table in it."""
    dsn = create_database(admin_dsn)
    name = dsn.rsplit("/", 1)[1]
    async with connect(admin_dsn) as conn:
        await conn.execute(f"CREATE ROLE {role} LOGIN")
        await conn.execute(f'ALTER DATABASE "{name}" OWNER TO {role}')
    own = with_database(admin_dsn.replace("postgres@", f"{role}@"), name)
    async with connect(own) as conn:
        await conn.execute(EVENTS_SQL.read_text())
    return own


async def test_only_reserved_slots_left_is_waited_for_too_and_so_is_a_role_at_its_limit(
    small_postgres: EmbeddedPostgres,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    relay_process: Any,
) -> None:
    """The relay's role is no superuser: with the superusers' reserved slots left, it is
    refused ("remaining connection slots are reserved"), the same SQLSTATE 53300. Later,
    running, its sessions are ended while its role may not connect (CONNECTION LIMIT 0, also
    53300): the lease, reader, listener and probe all wait, and relay when allowed again."""
    own = await _own_database(small_postgres.dsn, "relay_app")
    async with connect(own) as conn:
        await append_many(conn, loans(2))
    path = save(tmp_path, config_dict(own, nats_url, stream))
    migrate_cli(path)
    admin = with_database(small_postgres.dsn, own.rsplit("/", 1)[1])
    async with all_slots_taken(own, MAX_CONNECTIONS - 3):
        relay: RelayProcess = relay_process(["run", "--config", str(path)])
        await relay.wait_for_log(_waiting_for_a_slot("remaining connection slots are reserved"))
        assert relay.returncode is None, relay.output()
    received = await fetch_all(nats_url, stream, expected=2, timeout=30)
    assert [m.headers["ce-id"] for m in received] == ["book/b0@1", "book/b1@1"]

    async with connect(admin) as conn:
        await conn.execute("ALTER ROLE relay_app CONNECTION LIMIT 0")
        ended = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE 'relay:%'"
        )
        assert ended >= 3  # lease, reader, listener (and the probe, when it is connected)
        await relay.wait_for_log(
            lambda r: (
                r.get("event") == "database unavailable, retrying"
                and "too many connections for role" in str(r.get("error"))
            )
        )
        await append_many(conn, [("book", "b9", 1, "BookLent", {"loanId": "L9"})])
        assert relay.returncode is None, relay.output()
        await conn.execute("ALTER ROLE relay_app CONNECTION LIMIT -1")
    received = await fetch_all(nats_url, stream, expected=3, timeout=30)
    assert received[-1].headers["ce-id"] == "book/b9@1"

    async def back_to_four_sessions() -> bool:
        async with connect(admin) as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'relay:%'"
            )
        return bool(count == 4)

    await eventually(back_to_four_sessions, timeout=30)
    relay.terminate()
    assert await relay.wait_async(15) == 0, relay.output()
    assert "Traceback" not in relay.output()
