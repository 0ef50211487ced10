"""The split-brain check asks every host of a multi-host URL what it is, on a connection
of its own, for each new connection of the relay: a replica with many lanes opened as many
probes, at start and after every reconnect. A verdict is kept for a short time
(`SPLIT_BRAIN_CHECKED_FOR`), and only for connections to the very server it found the sole
primary: a restarted or another server is asked about again."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

from relay.config import DatabaseConfig
from relay.postgres.database import Database
from tests.support import postgres
from tests.support.proxy import TcpProxy
from tests.support.scenario import eventually


@contextmanager
def counting_listener() -> Iterator[tuple[int, list[int]]]:
    """A port that accepts and closes at once (a host that is down for PostgreSQL), and
    the count of connections it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = [0]

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            accepted[0] += 1
            client.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()


def second_host(dsn: str, host: str, port: int) -> str:
    """`dsn` with a second host after its own."""
    parts = urlsplit(dsn)
    first = "{}:{}".format(*postgres.address(dsn))
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{first},{host}:{port}" if userinfo else f"{first},{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def test_connections_opened_together_ask_the_hosts_once(database: str) -> None:
    with counting_listener() as (port, accepted):
        url = second_host(database, "127.0.0.1", port)
        db = Database(DatabaseConfig(url=url), "relay:tests:0")
        conns = [await db.connect("reader") for _ in range(6)]
        try:
            assert accepted[0] == 1, f"{accepted[0]} probes of the second host for 6 connections"

            async def asked_again() -> bool:  # once the verdict is older than it may be
                conn = await db.connect("reader")
                conns.append(conn)
                return accepted[0] == 2

            await eventually(asked_again, timeout=10, interval=0.5)
        finally:
            for conn in conns:
                conn.terminate()


async def test_the_hosts_are_asked_on_sessions_the_server_ends_when_their_path_dies(
    database: str,
) -> None:
    """The relay's own connections ask the server to probe them (`tcp_keepalives_*`,
    `tcp_user_timeout`), so a backend whose client's path died is ended in seconds; the
    probes of the hosts did not, and one caught by a dead path kept its slot for the
    server's default two hours."""
    proxy = TcpProxy(*postgres.address(database), record=True)
    try:
        url = second_host(database, proxy.host, proxy.port)
        db = Database(DatabaseConfig(url=url), "relay:tests:0")
        conn = await db.connect("reader")  # the first host; the proxy's is only asked
        conn.terminate()
        sent = proxy.client_bytes()
        assert b"relay:tests:0:probe" in sent
        for setting in (b"tcp_keepalives_idle", b"tcp_keepalives_count", b"tcp_user_timeout"):
            assert setting in sent, setting
    finally:
        proxy.close()
