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

from relay.runtime.log_noise import WINDOW
from tests.support.db import NewEvent, append_many, connect
from tests.support.kafka_server import (
    TansuServer,
    consume,
    create_topic,
    relay_config,
    unique_topic,
)
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, save


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
    path = save(tmp_path, relay_config(events_table, server.bootstrap, topic))
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


async def test_an_outbox_pointed_at_another_broker_says_so_at_start_up(
    *,
    tansu_factory: Callable[..., TansuServer],
    events_table: str,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    relay_process: Callable[..., RelayProcess],
) -> None:
    on_nats = config_dict(events_table, nats_url, stream)
    on_nats["http"] = {"enabled": False}
    nats_path = save(tmp_path, on_nats, "nats.yaml")
    assert run_cli(["migrate", "--config", str(nats_path)]).returncode == 0
    async with connect(events_table) as conn:
        await append_many(conn, lent(range(3)))

    async def relay_until(path: Path, match: Callable[[dict[str, Any]], bool]) -> RelayProcess:
        relay = relay_process(["run", "--config", str(path)])
        await relay.wait_for_log(match)
        relay.terminate()
        assert await relay.wait_async() == 0
        return relay

    def acknowledged(position: int) -> Callable[[dict[str, Any]], bool]:
        return lambda r: r.get("event") == "batch acknowledged" and r["last_position"] >= position

    def changed(r: dict[str, Any]) -> bool:
        return str(r.get("event", "")).startswith("the outbox's broker changed")

    first = await relay_until(nats_path, acknowledged(3))
    assert not any(changed(r) for r in first.logs())
    async with connect(events_table) as conn:
        recorded = await conn.fetchval(
            "SELECT broker FROM relay.checkpoints WHERE outbox = 'loans'"
        )
    assert recorded == f"nats {nats_url.removeprefix('nats://')}"

    # The same broker name, now a Kafka cluster: the checkpoint stands for events Kafka
    # never got, and the log says so, naming the way to send them.
    server = tansu_factory()
    topic = unique_topic("switched")
    await create_topic(server.bootstrap, topic, partitions=1)
    on_kafka = relay_config(events_table, server.bootstrap, topic)
    on_kafka["brokers"] = {"nats": on_kafka["brokers"]["kafka"]}
    on_kafka["outboxes"]["loans"]["broker"] = "nats"
    on_kafka["logging"]["level"] = "debug"
    kafka_path = save(tmp_path, on_kafka, "kafka.yaml")
    second = relay_process(["run", "--config", str(kafka_path)])
    warning = await second.wait_for_log(changed)
    assert warning["level"] == "warning"
    assert warning["recorded_broker"] == recorded
    assert warning["broker"] == f"kafka {server.bootstrap}"
    assert warning["checkpoint"] >= 3
    assert "relay replay loans --from-start" in warning["event"]
    async with connect(events_table) as conn:
        await append_many(conn, lent(range(3, 4)))
    await second.wait_for_log(acknowledged(4))
    second.terminate()
    assert await second.wait_async() == 0
    (record,) = await consume(server.bootstrap, topic, expected=1)
    assert record.key == b"book-3"

    # The checkpoint has been written for Kafka since: no warning any more.
    third = await relay_until(kafka_path, lambda r: r.get("event") == "lease acquired: relaying")
    assert not any(changed(r) for r in third.logs())
