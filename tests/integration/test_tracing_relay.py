"""The relay, run for real against Postgres and NATS, records its batches as OpenTelemetry
producer spans linked to the traces of the events' requests (the `otel` extra)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from relay.core import tracing
from tests.contract.brokers.nats import NatsHarness
from tests.contract.test_contract import relay_config
from tests.support.db import NewEvent, append_many, connect
from tests.support.scenario import load_and_migrate, running

TRACES = [f"{n:032x}" for n in range(1, 4)]


async def test_each_batch_is_a_producer_span_linked_to_its_events_traces(
    nats_url: str, events_table: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The relay uses the global provider (the operator's SDK); this test hands it its own.
    monkeypatch.setattr(
        "relay.core.delivery.traced", functools.partial(tracing.traced, provider=provider)
    )
    harness = NatsHarness(nats_url)
    await harness.prepare()
    try:
        raw = relay_config(events_table, harness)
        raw["outboxes"]["loans"]["trace_context"] = True
        config = await load_and_migrate(tmp_path, raw)
        events = [
            NewEvent(
                "book",
                f"b-{n}",
                1,
                "BookLent",
                {"loanId": f"L{n}"},
                {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"},
            )
            for n, trace in enumerate(TRACES)
        ]
        events.append(NewEvent("book", "b-9", 1, "BookLent", {"loanId": "L9"}, {}))
        async with connect(events_table) as conn:
            await append_many(conn, events)
        async with running(config):
            await harness.consume(expected=len(events))
    finally:
        await harness.close()
    spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.PRODUCER]
    assert spans, "no producer span recorded"
    assert all(s.attributes and s.attributes["messaging.system"] == "nats" for s in spans)
    counts = [s.attributes.get("messaging.batch.message_count") for s in spans if s.attributes]
    assert all(isinstance(count, int) for count in counts)
    assert sum(count for count in counts if isinstance(count, int)) >= len(events)
    linked = {f"{link.context.trace_id:032x}" for s in spans for link in s.links}
    assert linked == set(TRACES)  # the event without trace context has no link
    assert {s.name for s in spans} == {f"send {harness.destination()}"}
