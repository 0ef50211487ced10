"""The optional OpenTelemetry span per batch: what it records, and that it is truly optional."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from relay.core.publishing import Message, Outcome
from relay.core.tracing import traced
from relay.errors import TransientPublishError

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def message(n: int, traceparent: str | None = None, tracestate: str | None = None) -> Message:
    return Message(
        id=f"book/book-{n}@1",
        type="library.book-lent.v1",
        destination="library.loans",
        key=f"book-{n}",
        body=b"{}",
        source="/outbox-relay/loans",
        time=datetime(2026, 11, 30, tzinfo=UTC),
        position=n,
        traceparent=traceparent,
        tracestate=tracestate,
    )


def recorder() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_a_batch_is_one_producer_span_linked_to_each_events_trace() -> None:
    provider, exporter = recorder()
    sent: list[list[str]] = []

    async def publish(messages: Sequence[Message]) -> list[Outcome]:
        sent.append([m.id for m in messages])
        return [None] * len(messages)

    send = traced(publish, outbox="loans", broker="nats", broker_type="nats", provider=provider)
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    batch = [message(1, TRACEPARENT, "congo=t61rcWkgMzE"), message(2), message(3, other)]
    assert await send(batch) == [None, None, None]
    assert sent == [[m.id for m in batch]]
    (span,) = exporter.get_finished_spans()
    assert span.kind == SpanKind.PRODUCER
    assert span.name == "send library.loans"
    assert span.attributes is not None
    assert span.attributes["messaging.system"] == "nats"
    assert span.attributes["messaging.batch.message_count"] == 3
    assert span.attributes["relay.outbox"] == "loans"
    links = [
        (link.context.trace_id, link.context.span_id, link.context.trace_flags)
        for link in span.links
    ]
    assert links == [
        (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1),
        (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 0),
    ]
    assert span.links[0].context.trace_state.get("congo") == "t61rcWkgMzE"
    assert span.links[0].context.is_remote
    assert span.status.status_code == StatusCode.UNSET


async def test_a_failed_batch_marks_its_span_as_an_error() -> None:
    provider, exporter = recorder()

    async def publish(messages: Sequence[Message]) -> list[Outcome]:
        return [None, TransientPublishError("broker 'sqs': throttled")]

    send = traced(publish, outbox="loans", broker="sqs", broker_type="sqs", provider=provider)
    await send([message(1), message(2)])
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None and span.attributes["messaging.system"] == "aws_sqs"
    assert span.attributes["relay.acknowledged"] == 1
    assert span.status.status_code == StatusCode.ERROR
    assert "throttled" in (span.status.description or "")
