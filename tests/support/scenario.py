"""Building relay configs for tests, and running a relay in the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from relay.config import RelayConfig, load_config
from relay.fleet.status import status as read_status
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.runtime.runner import Relay
from tests.support.config import write_config as write_yaml
from tests.support.db import NewEvent
from tests.support.postgres import with_address
from tests.support.relay_process import RelayProcess, run_cli

LIBRARY_MESSAGES: dict[str, Any] = {
    "BookLent": {
        "type": "library.book-lent.v1",
        "destination": "{subject}.{aggregate_type}",
        "payload": {
            "bookId": "aggregate_id",
            "loanId": "data.loanId",
            "memberId": "data.memberId",
            "version": "version",
        },
    },
    "BookReturned": {
        "type": "library.book-returned.v1",
        "destination": "{subject}.{aggregate_type}",
        "payload": "{bookId: aggregate_id, loanId: data.loanId, version: version}",
    },
}


def loans(count: int, aggregate_type: str = "book") -> list[NewEvent]:
    """`count` BookLent events, one per aggregate (`b0`, `b1`, ... for books)."""
    return [
        NewEvent(aggregate_type, f"{aggregate_type[0]}{i}", 1, "BookLent", {"loanId": f"L{i}"})
        for i in range(count)
    ]


# A BookLent whose 2 MB body NATS refuses for good (max_payload 1 MB): it is parked.
OVERSIZED_LOAN = NewEvent("book", "big", 1, "BookLent", {"loanId": "x" * 2_000_000})


def config_dict(
    dsn: str,
    nats_url: str,
    subject: str,
    *,
    outbox: str = "loans",
    messages: dict[str, Any] | None = None,
    schema: str = "relay",
    **outbox_options: Any,
) -> dict[str, Any]:
    """A config relaying the library's events to `subject.<aggregate_type>` on NATS.

    Retries are fast and the poll interval short, so tests run quickly; the
    logic is the same as with the defaults.
    """
    rules = messages if messages is not None else LIBRARY_MESSAGES

    def render(rule: dict[str, Any]) -> dict[str, Any]:
        return {**rule, "destination": rule["destination"].replace("{subject}", subject)}

    rendered = {
        event_type: [render(r) for r in rule] if isinstance(rule, list) else render(rule)
        for event_type, rule in rules.items()
    }
    options: dict[str, Any] = {
        "retry": {"initial": "20ms", "max": "200ms"},
        "park_after": 3,
        **outbox_options,
    }
    return {
        "database": {"url": dsn, "schema": schema, "retry": {"initial": "20ms", "max": "200ms"}},
        "source": {"poll_interval": "100ms", "barrier_report_after": "200ms"},
        "brokers": {"nats": {"type": "nats", "servers": [nats_url], "ack_timeout": "1s"}},
        "outboxes": {outbox: {"broker": "nats", "messages": rendered, **options}},
        "logging": {"level": "debug", "format": "json"},
        "http": {
            "port": 0,
            "host": "127.0.0.1",
            "database_probe_interval": "500ms",
            "ready_after_database_silence": "2s",
        },
        "shutdown": {"grace_period": "5s"},
    }


def save(tmp_path: Path, data: dict[str, Any], name: str = "relay.yaml") -> Path:
    return write_yaml(tmp_path / name, data)


async def load_and_migrate(tmp_path: Path, data: dict[str, Any]) -> RelayConfig:
    config = load_config(save(tmp_path, data))
    await migrate(config)
    return config


async def migrate(config: RelayConfig) -> None:
    """`relay migrate`, in this process."""
    await migrate_database(Database(config.database, "relay:tests:0"), config)


async def status(config: RelayConfig) -> list[dict[str, Any]]:
    """`relay status --json`, in this process: the stable interface operators script against."""
    return [row.as_json() for row in await read_status(config)]


@contextlib.asynccontextmanager
async def running(config: RelayConfig) -> AsyncIterator[Relay]:
    """Run the real relay in this loop; stop it gracefully and check it exited 0."""
    relay = Relay(config)
    task = asyncio.create_task(relay.run(), name="relay-under-test")
    try:
        yield relay
    finally:
        relay.stop.set()
        code = await asyncio.wait_for(task, timeout=30)
        assert code == 0, f"relay exited {code}"
        if not any(t.get_name() == task.get_name() for t in asyncio.all_tasks()):
            assert gc.get_freeze_count() == 0, "the relay left the heap frozen"


async def eventually(
    check: Callable[[], Awaitable[bool] | bool],
    timeout: float = 20.0,  # noqa: ASYNC109 - one deadline across many polls
    interval: float = 0.05,
) -> None:
    """Poll `check` (sync or async) until it is true; fail the test after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {check.__name__}")
        await asyncio.sleep(interval)


def write_config(
    tmp_path: Path,
    dsn: str,
    nats_url: str,
    subject: str,
    *,
    name: str = "relay.yaml",
    outbox: str = "loans",
    broker: dict[str, Any] | None = None,
    shutdown: dict[str, Any] | None = None,
    lease: dict[str, Any] | None = None,
    database: dict[str, Any] | None = None,
    **outbox_options: Any,
) -> Path:
    """`config_dict` written to `tmp_path/name`, with broker, shutdown, lease and database
    settings merged in (the outbox options go to the outbox)."""
    data = config_dict(dsn, nats_url, subject, outbox=outbox, **outbox_options)
    data["database"].update(database or {})
    data["brokers"]["nats"].update(broker or {})
    data["shutdown"].update(shutdown or {})
    if lease:
        data["lease"] = lease
    return save(tmp_path, data, name)


def migrate_cli(path: Path) -> None:
    """`relay migrate --config path`, as an operator runs it; it must succeed."""
    result = run_cli(["migrate", "--config", str(path)])
    assert result.returncode == 0, result.stderr


async def standing_by_through(
    address: tuple[str, int],
    dsn: str,
    *,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    start: Callable[..., RelayProcess],
    lease: dict[str, Any],
) -> RelayProcess:
    """A replica that reaches Postgres through `address` (a proxy's, a dead path's), once it
    stands by: another replica holds the outbox."""
    data = config_dict(with_address(dsn, *address), nats_url, stream)
    data["lease"] = lease
    replica = start(["run", "--config", str(save(tmp_path, data, "behind.yaml"))])
    await replica.wait_for_log("standing by")
    return replica
