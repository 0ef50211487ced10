"""The tiers, by folder, and what loads for each: the unit tier alone (`-m "not integration"`)
loads no server fixture; every other run loads them from tests/support/service_fixtures.py
and the brokers' server modules. pytest runs with warnings as errors: every fixture closes
what it opens.
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

# The tier is the folder: tests/unit/ runs in seconds with nothing on the machine
# (`pytest -m "not integration"`); everything else is the `integration` tier. A unit test
# that asks for one of these fixtures (each reaches or starts a server) is a mistake.
SERVICE_FIXTURES = {
    "pg_admin_dsn",
    "database",
    "events_table",
    "private_pg_admin_dsn",
    "private_database",
    "nats_url",
    "nats_factory",
    "relay_process",
    "rabbitmq_url",
    "rabbitmq_small_url",
    "tansu",
    "tansu_factory",
    "kafka_topic",
    "sqs_endpoint",
    "pubsub_emulator",
    "redis_url",
    "redis_factory",
    "tls_server",
    "private_postgres",
    "chart",
}
TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The unit tier alone (`-m "not integration"`) is one folder: the others are not even
    imported, since each of their tests would be deselected."""
    if not _unit_tier_only(config):
        return None
    path = collection_path.resolve()
    if path == TESTS or not path.is_relative_to(TESTS) or path.is_relative_to(UNIT):
        return None
    return True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.integration)
            continue
        services = SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if services:
            raise pytest.UsageError(
                f"{item.nodeid}: a unit test asks for {sorted(services)}; it belongs in"
                " tests/integration/"
            )


# The fixtures that reach or start a server, and each broker's test server (in its own
# module, beside the adapter it tests). The unit tier alone never loads them: importing
# them costs seconds that its tests, which touch no server, do not need.
SERVICE_PLUGINS = (
    "tests.support.service_fixtures",
    "tests.support.kafka_server",
    "tests.support.rabbitmq_server",
    "tests.support.sqs_server",
    "tests.support.redis_server",
)


def pytest_configure(config: pytest.Config) -> None:
    _ctrl_c_reaches_children()
    if _unit_tier_only(config):
        return
    for plugin in SERVICE_PLUGINS:
        config.pluginmanager.import_plugin(plugin)


def _ctrl_c_reaches_children() -> None:
    """A suite started in the background by a shell without job control (`cmd &`) inherits
    SIGINT ignored, and so does every relay it starts: the tests that stop `relay status
    --watch` with Ctrl-C then waited for ever. Handled here, it is the default again in
    each child (an exec resets a handled signal, not an ignored one)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The unit tier's heap, once collected, is set aside from the garbage collector, as
    the relay sets aside its own start-up heap (relay/runtime/heap.py): collection imports
    every broker client, and each full collection during the tests walked all of it again
    to find nothing (the tier took 8.1 s, 7.4 s with the freeze). The integration tier
    leaves the heap alone: its in-process relays must freeze and thaw it themselves."""
    if _unit_tier_only(session.config):
        gc.collect()
        gc.freeze()


def _unit_tier_only(config: pytest.Config) -> bool:
    return bool(config.option.markexpr.strip() == "not integration")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """Put the process's logging back as it was after a test that calls `configure`."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers, root.level = handlers, level
        structlog.reset_defaults()
