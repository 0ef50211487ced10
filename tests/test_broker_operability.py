"""Brokers as operators meet them, with a real relay process: what its log says when a
broker goes away, and when an outbox is pointed at another broker."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.ops.log_noise import WINDOW
from tests.support.db import NewEvent, append_many, connect
from tests.support.kafka_server import TansuServer, consume, create_topic, unique_topic
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import save


def kafka_config(dsn: str, bootstrap: str, topic: str) -> dict[str, Any]:
    return {
        "database": {"url": dsn, "retry": {"initial": "20ms", "max": "200ms"}},
        "source": {"poll_interval": "100ms"},
        "brokers": {
            "kafka": {
                "type": "kafka",
                "bootstrap_servers": [bootstrap],
                "enable_idempotence": False,
                "ack_timeout": "2s",
                "connect_timeout": "1s",
            }
        },
        "outboxes": {
            "loans": {
                "broker": "kafka",
                "messages": {"BookLent": {"type": "library.book-lent.v1", "destination": topic}},
                "retry": {"initial": "50ms", "max": "300ms"},
            }
        },
        "http": {"enabled": False},
        "logging": {"level": "info", "format": "json"},
    }


def lent(books: range) -> list[NewEvent]:
    return [NewEvent("book", f"book-{b}", 1, "BookLent", {"loanId": f"l{b}"}) for b in books]


async def test_kafka_outage_does_not_flood_the_log_with_the_clients_retries(
    tansu_factory: Callable[..., TansuServer],
    events_table: str,
    tmp_path: Path,
    relay_process: Callable[..., RelayProcess],
) -> None:
    server = tansu_factory()
    topic = unique_topic("outage")
    await create_topic(server.bootstrap, topic, partitions=3)
    path = save(tmp_path, kafka_config(events_table, server.bootstrap, topic))
    assert run_cli(["migrate", "--config", str(path)]).returncode == 0
    async with connect(events_table) as conn:
        await append_many(conn, lent(range(5)))
    relay = relay_process(["run", "--config", str(path)])
    assert len(await consume(server.bootstrap, topic, expected=5)) >= 5

    server.kill()
    started = time.monotonic()
    async with connect(events_table) as conn:
        await append_many(conn, lent(range(5, 10)))
    # Some seconds of outage: aiokafka retries every 100 ms meanwhile, for each node.
    retrying = await relay.wait_for_log(
        lambda r: r.get("event") == "publish failed, retrying" and r.get("attempt", 0) >= 5,
        timeout=90,
    )
    elapsed = time.monotonic() - started
    relay.terminate()
    assert await relay.wait_async() == 0

    assert retrying["outbox"] == "loans" and retrying["error"]
    client = [r for r in relay.logs() if str(r.get("logger", "")).startswith("aiokafka")]
    # A kind of line is its logger, level and text with the numbers (node ids, ports) out.
    kinds = Counter((r["logger"], r["level"], re.sub(r"\d+", "N", str(r["event"]))) for r in client)
    assert kinds, "aiokafka said nothing about the outage: the test proves nothing"
    allowed = 1 + math.ceil(elapsed / WINDOW)
    assert max(kinds.values()) <= allowed, kinds
    assert len(client) <= allowed * len(kinds)
