"""`relay audit` against RabbitMQ: a stream queue the relay's messages did not all reach,
found and put back, and a queue that is not a stream refused.

The exchange has the consumers' classic queue and the audit's stream queue bound to it. A
stream deletes no message on request, so the loss is made as an operator could make it:
the stream is unbound while the relay publishes two loans, which RabbitMQ confirms (the
classic queue takes them), then bound again. A real `relay run` relays throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.audit.kit import audit, outbox_to
from tests.support.db import append_many, connect
from tests.support.operator_cli import relay_then_stop
from tests.support.rabbitmq_server import (
    admin,
    create_stream,
    create_topology,
    delete_topology,
    unique_name,
)
from tests.support.relay_process import run_cli
from tests.support.scenario import loans


def rabbitmq_outbox(
    events_table: str, url: str, exchange: str, stream: str, tmp_path: Path
) -> Path:
    """A config relaying every loan to `exchange`, the audit reading `stream`, migrated."""
    broker = {"type": "rabbitmq", "url": url, "audit_streams": {exchange: stream}}
    return outbox_to(events_table, tmp_path, exchange, "rabbit", broker)


async def test_messages_the_stream_did_not_get_are_found_missing_and_repaired(
    events_table: str, rabbitmq_url: str, tmp_path: Path, relay_process: Any
) -> None:
    exchange = unique_name("audit")
    stream = f"{exchange}-audit"
    await create_topology(rabbitmq_url, exchange, queue=exchange)  # the consumers'
    await create_stream(rabbitmq_url, stream, exchange)
    try:
        config = rabbitmq_outbox(events_table, rabbitmq_url, exchange, stream, tmp_path)
        async with connect(events_table) as conn:
            first = await append_many(conn, loans(10))
        await relay_then_stop(relay_process, config, first[-1])
        async with admin(rabbitmq_url) as channel:
            await channel.queue_unbind(stream, exchange, routing_key="#")
        async with connect(events_table) as conn:
            unbound = await append_many(conn, loans(2, "dvd"))
        await relay_then_stop(relay_process, config, unbound[-1])
        async with admin(rabbitmq_url) as channel:
            await channel.queue_bind(stream, exchange, routing_key="#")
        async with connect(events_table) as conn:
            later = await append_many(conn, loans(3, "bike"))
        await relay_then_stop(relay_process, config, later[-1])

        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["expected"] == 15 and report["found"] == 13
        assert sorted(m["position"] for m in report["missing"]) == unbound
        assert {m["id"] for m in report["missing"]} == {"dvd/d0@1", "dvd/d1@1"}
        assert all(m["reason"] == "not found" for m in report["missing"])
        assert report["duplicates"] == 0 and report["order_breaks"] == 0

        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert report["repair"]["ok"] and len(report["repair"]["published"]) == 2
        after = report["after_repair"]
        assert after["missing_count"] == 0 and after["found"] == 15 and after["duplicates"] == 0
    finally:
        await delete_topology(rabbitmq_url, exchange, exchange, stream)


async def test_a_queue_that_is_not_a_stream_is_refused_with_exit_2(
    events_table: str, rabbitmq_url: str, tmp_path: Path, relay_process: Any
) -> None:
    exchange = unique_name("audit")
    await create_topology(rabbitmq_url, exchange, queue=exchange)
    try:
        config = rabbitmq_outbox(events_table, rabbitmq_url, exchange, exchange, tmp_path)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(3))
        await relay_then_stop(relay_process, config, positions[-1])

        result = run_cli(["audit", "loans", "--from-start", "--config", str(config), "--json"])
        assert result.returncode == 2, result.stderr
        assert f"queue {exchange!r}" in result.stderr
        assert "is not a stream queue" in result.stderr
        assert "reading it would take them away" in result.stderr
        async with admin(rabbitmq_url) as channel:  # the consumers' messages are all there
            assert (await channel.queue_declare(exchange, passive=True)).message_count == 3
    finally:
        await delete_topology(rabbitmq_url, exchange, exchange)
