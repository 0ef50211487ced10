"""CloudEvents attributes, structured mode and trace context: pure logic, no services.

The brokers' own tests (tests/contract/test_cloudevents.py) read the same messages back
from real servers with the CloudEvents SDK; these pin down the rules one at a time.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.formats.json import JSONFormat

from relay.brokers._aws import MAX_ATTRIBUTES, message_attributes
from relay.brokers._aws import within_limit as _within_limit
from relay.brokers.kafka import message_headers as kafka_headers
from relay.brokers.nats import message_headers as nats_headers
from relay.config import OutboxConfig, load_config
from relay.core.event import Event
from relay.core.publishing import STRUCTURED, Message, cloudevent_attributes, to_structured
from relay.errors import ConfigError
from relay.mapping.mapper import Mapper
from relay.mapping.trace_context import traceparent_problem, tracestate_valid

WHEN = datetime(2026, 11, 30, 9, 30, tzinfo=UTC)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def event(metadata: Any = None, **fields: Any) -> Event:
    base: dict[str, Any] = {
        "position": 7,
        "aggregate_type": "book",
        "aggregate_id": "book-1",
        "version": 2,
        "type": "BookLent",
        "data": {"loanId": "L1"},
        "metadata": {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
        if metadata is None
        else metadata,
        "created_at": WHEN,
    }
    base.update(fields)
    return Event(**base)


def outbox(**overrides: Any) -> OutboxConfig:
    config: dict[str, Any] = {
        "broker": "nats",
        "messages": {
            "BookLent": {
                "type": "library.book-lent.v1",
                "destination": "library.loans",
                "payload": {"loanId": "data.loanId"},
            }
        },
    }
    config.update(overrides)
    return OutboxConfig.model_validate(config)


def mapped(
    config: OutboxConfig, e: Event | None = None, counter: list[int] | None = None
) -> Message:
    count = counter if counter is not None else []
    message = Mapper("loans", config, count_invalid_trace=lambda: count.append(1)).map(e or event())
    assert message is not None
    return message


def full_message() -> Message:
    return Message(
        id="book/book-1@2",
        type="library.book-lent.v1",
        destination="library.loans",
        key="book-1",
        body=b'{"loanId":"L1"}',
        source="/outbox-relay/loans",
        time=WHEN,
        position=7,
        routing_key="loans.lent",
        dataschema="https://schemas.example.com/book-lent/v1.json",
        traceparent=TRACEPARENT,
        tracestate=TRACESTATE,
    )


# -- W3C trace context -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (TRACEPARENT, None),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", "four fields"),
        (TRACEPARENT.upper(), "lowercase hex"),
        (TRACEPARENT + "-x", "four fields"),
        ("ff" + TRACEPARENT[2:], "version ff"),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", "all-zero"),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", "all-zero"),
        ("00-4bf92f35-00f067aa0ba902b7-01", "lowercase hex"),
        (42, "not a string (int)"),
    ],
)
def test_traceparent_is_checked_against_the_w3c_format(value: Any, problem: str | None) -> None:
    found = traceparent_problem(value)
    assert found is None if problem is None else problem in (found or "")


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (TRACESTATE, True),
        ("tenant@vendor=x", True),
        ("a=1, b=2", True),
        ("", False),
        ("no-equals-sign", False),
        ("Upper=1", False),
        ("a=has,=empty-key", False),
        (",".join(f"k{i}=v" for i in range(33)), False),  # at most 32 members
        (["a=1"], False),
    ],
)
def test_tracestate_is_checked_against_the_w3c_format(value: Any, valid: bool) -> None:
    assert tracestate_valid(value) is valid


def test_the_message_carries_the_events_trace_context() -> None:
    message = mapped(outbox(trace_context=True))
    assert (message.traceparent, message.tracestate) == (TRACEPARENT, TRACESTATE)
    attributes = cloudevent_attributes(message)
    assert attributes["traceparent"] == TRACEPARENT
    assert attributes["tracestate"] == TRACESTATE


def test_no_trace_context_configured_means_none_is_read() -> None:
    message = mapped(outbox())
    assert message.traceparent is None and message.tracestate is None
    assert "traceparent" not in cloudevent_attributes(message)


def test_the_paths_are_configurable() -> None:
    config = outbox(trace_context={"traceparent": "data.trace.parent", "tracestate": None})
    e = event(data={"loanId": "L1", "trace": {"parent": TRACEPARENT}})
    message = mapped(config, e)
    assert message.traceparent == TRACEPARENT and message.tracestate is None


def test_an_invalid_traceparent_is_dropped_and_counted_not_fatal() -> None:
    counter: list[int] = []
    bad = event(metadata={"traceparent": "00-not-a-trace", "tracestate": TRACESTATE})
    message = mapped(outbox(trace_context=True), bad, counter)
    assert message.traceparent is None and message.tracestate is None  # tracestate goes too
    assert json.loads(message.body) == {"loanId": "L1"}
    assert counter == [1]


def test_an_invalid_tracestate_alone_is_dropped() -> None:
    counter: list[int] = []
    bad = event(metadata={"traceparent": TRACEPARENT, "tracestate": "Not Valid"})
    message = mapped(outbox(trace_context=True), bad, counter)
    assert (message.traceparent, message.tracestate) == (TRACEPARENT, None)
    assert counter == [1]


@pytest.mark.parametrize("padded", [" a=b", "a=b\t", " \ta=b,c=d \t"])
def test_white_space_around_a_tracestate_is_dropped_and_the_message_goes_out(
    padded: str,
) -> None:
    """Found by an attack: W3C allows it, and NATS refuses a header value that begins or ends
    with it, so the whole event was parked for its trace context."""
    counter: list[int] = []
    e = event(metadata={"traceparent": TRACEPARENT, "tracestate": padded})
    message = mapped(outbox(trace_context=True), e, counter)
    assert message.tracestate == padded.strip(" \t") and counter == []
    assert nats_headers(message)["ce-tracestate"] == padded.strip(" \t")


def test_an_event_without_trace_context_is_not_counted() -> None:
    counter: list[int] = []
    message = mapped(outbox(trace_context=True), event(metadata={}), counter)
    assert message.traceparent is None and counter == []


def test_metadata_that_is_not_json_drops_only_the_trace_context() -> None:
    counter: list[int] = []
    broken = event(metadata={}, metadata_problem="column 'metadata' is not valid JSON")
    message = mapped(outbox(trace_context=True), broken, counter)
    assert message.traceparent is None and counter == [1]


def test_metadata_is_decoded_when_trace_context_reads_it_and_only_then() -> None:
    assert not Mapper("loans", outbox()).reads_metadata
    assert Mapper("loans", outbox(trace_context=True)).reads_metadata
    from_data = outbox(trace_context={"traceparent": "data.tp", "tracestate": None})
    assert not Mapper("loans", from_data).reads_metadata


def test_trace_context_config_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "relay.yaml"
    path.write_text(
        "database: {url: 'postgresql://localhost/db'}\n"
        "brokers: {nats: {type: nats, servers: ['nats://nats.invalid:4222']}}\n"
        "outboxes:\n"
        "  loans:\n"
        "    broker: nats\n"
        "    cloudevents: envelope\n"
        "    trace_context: {traceparent: 'metadata.[bad'}\n"
        "    messages: {BookLent: {type: t, destination: d}}\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    text = str(raised.value)
    assert "relay.yaml:7" in text and "outboxes.loans.trace_context.traceparent" in text
    assert "relay.yaml:6" in text and "outboxes.loans.cloudevents" in text


# -- attributes and structured mode ----------------------------------------------------------


def test_dataschema_and_the_tracing_extension_are_attributes() -> None:
    attributes = cloudevent_attributes(full_message())
    assert attributes == {
        "specversion": "1.0",
        "id": "book/book-1@2",
        "type": "library.book-lent.v1",
        "source": "/outbox-relay/loans",
        "partitionkey": "book-1",
        "time": WHEN.isoformat(),
        "dataschema": "https://schemas.example.com/book-lent/v1.json",
        "traceparent": TRACEPARENT,
        "tracestate": TRACESTATE,
    }


def test_structured_mode_puts_the_whole_event_in_the_body() -> None:
    message = full_message()
    to_structured(message)
    assert message.content_type == STRUCTURED == "application/cloudevents+json"
    body = json.loads(message.body)
    assert body["data"] == {"loanId": "L1"}
    assert body["datacontenttype"] == "application/json"
    assert body["id"] == "book/book-1@2" and body["traceparent"] == TRACEPARENT
    assert cloudevent_attributes(message) == {}  # no `ce` header of any kind
    event = JSONFormat().read(None, message.body)  # as the CloudEvents SDK reads it
    assert event.get_id() == "book/book-1@2"
    assert event.get_dataschema() == "https://schemas.example.com/book-lent/v1.json"
    assert event.get_extension("tracestate") == TRACESTATE
    assert event.get_time() == WHEN
    assert event.get_data() == {"loanId": "L1"}


def test_a_structured_outbox_maps_to_structured_messages_with_the_same_id_and_key() -> None:
    binary = mapped(outbox(trace_context=True))
    structured = mapped(outbox(trace_context=True, cloudevents="structured"))
    assert structured.content_type == STRUCTURED
    assert (structured.id, structured.key) == (binary.id, binary.key)  # dedup and order
    assert json.loads(structured.body)["data"] == json.loads(binary.body)
    assert json.loads(structured.body)["traceparent"] == TRACEPARENT


def test_structured_messages_carry_only_the_content_type_in_headers() -> None:
    message = full_message()
    to_structured(message)
    assert kafka_headers(message) == [("content-type", STRUCTURED.encode())]
    assert nats_headers(message) == {"Nats-Msg-Id": message.id, "content-type": STRUCTURED}
    assert message_attributes(message) == {
        "content-type": {"DataType": "String", "StringValue": STRUCTURED}
    }


def test_kafka_binary_headers_leave_the_partition_key_to_the_record_key() -> None:
    names = [name for name, _ in kafka_headers(full_message())]
    assert "ce_partitionkey" not in names
    assert {"ce_dataschema", "ce_traceparent", "ce_tracestate", "content-type"} <= set(names)


# -- the SQS attribute limit -----------------------------------------------------------------


def test_a_message_with_every_attribute_fits_sqs_limit() -> None:
    attributes = message_attributes(full_message())
    assert len(attributes) == MAX_ATTRIBUTES == 10
    assert {"ce_dataschema", "ce_traceparent", "ce_tracestate", "ce_partitionkey"} <= set(
        attributes
    )


def test_past_the_limit_the_least_useful_attributes_go_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    every = {f"ce_{name}": "x" for name in cloudevent_attributes(full_message())}
    every["content-type"] = "application/json"
    assert _within_limit({**every, "ce_subject": "x", "ce_other": "x"}) == every
    monkeypatch.setattr("relay.brokers._aws.MAX_ATTRIBUTES", 8)
    kept = _within_limit(every)
    assert set(every) - set(kept) == {"ce_partitionkey", "ce_dataschema"}
    assert list(kept) == [name for name in every if name in kept]  # order kept
