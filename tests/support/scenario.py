"""Building relay configs for tests, and running a relay in the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from relay.config import RelayConfig, load_config
from relay.ops.commands import migrate
from relay.ops.runner import Relay
from tests.support.config import write_config

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
    rendered = {
        event_type: {**rule, "destination": rule["destination"].replace("{subject}", subject)}
        for event_type, rule in rules.items()
    }
    options: dict[str, Any] = {
        "retry": {"initial": "20ms", "max": "200ms"},
        "park_after": 3,
        **outbox_options,
    }
    return {
        "database": {"url": dsn, "schema": schema},
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
    return write_config(tmp_path / name, data)


async def load_and_migrate(tmp_path: Path, data: dict[str, Any]) -> RelayConfig:
    config = load_config(save(tmp_path, data))
    await migrate(config)
    return config


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
