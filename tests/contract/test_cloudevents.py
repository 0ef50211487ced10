"""Every broker, binary and structured mode: the CloudEvents SDK for Python reads the messages.

Each harness reads the raw broker message as a consumer would and parses it with the
SDK's own binding (tests/contract/brokers/). The first test runs the whole relay, trace
context read from the events' metadata; the second sends, through the broker's adapter,
a message that carries every optional attribute there is (dataschema included, which the
config sets from a schema's `$id`), to check it is accepted and read back whole, within
SQS's ten message attributes.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from relay.brokers import create_publisher
from relay.config.brokers import BrokerConfig
from relay.core.publishing import STRUCTURED, Message, to_structured
from tests.contract.harness import BrokerHarness
from tests.contract.test_contract import relay_config
from tests.support.db import NewEvent, append_many, connect
from tests.support.scenario import load_and_migrate, running

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
SCHEMA = "https://schemas.example.com/library/book-lent.v1.json"
MODES = ["binary", "structured"]


@pytest.mark.parametrize("mode", MODES)
async def test_the_sdk_reads_what_the_relay_published(
    broker: BrokerHarness, events_table: str, tmp_path: Path, mode: str
) -> None:
    raw = relay_config(events_table, broker)
    raw["outboxes"]["loans"] |= {"cloudevents": mode, "trace_context": True}
    config = await load_and_migrate(tmp_path, raw)
    traced = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    events = [
        NewEvent("book", "b-1", 1, "BookLent", {"loanId": "L1"}, traced),
        NewEvent("book", "b-1", 2, "BookReturned", {"loanId": "L1"}, {"tenant": "north"}),
        NewEvent("book", "b-2", 1, "BookLent", {"loanId": "L2"}, {"traceparent": "bogus"}),
    ]
    async with connect(events_table) as conn:
        positions = await append_many(conn, events)
        created = {
            row["position"]: row["created_at"]
            for row in await conn.fetch(
                "SELECT position, created_at FROM events WHERE position = ANY($1)", positions
            )
        }
    async with running(config):
        received = await broker.consume(expected=len(events))
    parsed = {m.id: broker.cloudevent(m) for m in received}
    assert set(parsed) == {"book/b-1@1", "book/b-1@2", "book/b-2@1"}
    for (event_id, data), position in zip(
        [("book/b-1@1", "L1"), ("book/b-1@2", "L1"), ("book/b-2@1", "L2")], positions, strict=True
    ):
        ce = parsed[event_id]
        book, version = event_id.removeprefix("book/").split("@")
        assert ce.get_id() == event_id
        assert ce.get_source() == "/outbox-relay/loans"
        assert ce.get_specversion() == "1.0"
        assert ce.get_time() == created[position]
        assert ce.get_datacontenttype() == "application/json"
        assert ce.get_data() == {"bookId": book, "loanId": data, "version": int(version)}
        assert ce.get_dataschema() is None  # no schema in this config
    assert parsed["book/b-1@1"].get_type() == "library.book-lent.v1"
    assert parsed["book/b-1@2"].get_type() == "library.book-returned.v1"
    assert parsed["book/b-1@1"].get_extension("traceparent") == TRACEPARENT
    assert parsed["book/b-1@1"].get_extension("tracestate") == TRACESTATE
    assert parsed["book/b-1@2"].get_extension("traceparent") is None  # none stored
    assert parsed["book/b-2@1"].get_extension("traceparent") is None  # invalid: dropped
    for message in received:
        if broker.kind == "kinesis":  # no headers: the record is the whole event in both modes
            assert "specversion" in json.loads(message.raw["Data"])
            continue
        body = json.loads(message.body)
        assert ("data" in body and "specversion" in body) is (mode == "structured")


@pytest.mark.parametrize("mode", MODES)
async def test_a_message_with_every_attribute_is_accepted_and_read_back_whole(
    broker: BrokerHarness, mode: str
) -> None:
    message = Message(
        id="book/b-9@3",
        type="library.book-lent.v1",
        destination=broker.destination(),
        key="b-9",
        body=b'{"bookId":"b-9","loanId":"L9"}',
        source="/outbox-relay/loans",
        time=datetime(2026, 11, 30, 21, 45, 12, 345678, tzinfo=UTC),
        position=1,
        routing_key="library.book-lent",
        dataschema=SCHEMA,
        traceparent=TRACEPARENT,
        tracestate=TRACESTATE,
    )
    if mode == "structured":
        to_structured(message)
    broker_config: Any = TypeAdapter(BrokerConfig).validate_python(broker.broker_config())
    publisher = create_publisher("under-test", broker_config)
    try:
        assert await publisher.publish([message]) == [None]
    finally:
        await publisher.close()
    (received,) = await broker.consume(expected=1)
    ce = broker.cloudevent(received)
    assert ce.get_id() == "book/b-9@3"
    assert ce.get_type() == "library.book-lent.v1"
    assert ce.get_source() == "/outbox-relay/loans"
    assert ce.get_time() == message.time
    assert ce.get_dataschema() == SCHEMA
    assert ce.get_extension("traceparent") == TRACEPARENT
    assert ce.get_extension("tracestate") == TRACESTATE
    assert ce.get_extension("partitionkey") == "b-9"
    assert ce.get_data() == {"bookId": "b-9", "loanId": "L9"}
    if mode == "structured":
        assert message.content_type == STRUCTURED
    if broker.kind in ("sqs", "sns"):
        # SQS refuses more than 10 message attributes (SNS delivers into SQS); moto does not
        # check, so count them.
        attributes = received.raw["MessageAttributes"]
        assert len(attributes) == (10 if mode == "binary" else 1), sorted(attributes)
