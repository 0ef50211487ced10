"""OpenTelemetry: a producer span per published batch, linked to each event's trace.

Only with the optional `otel` extra (opentelemetry-api) installed; without it nothing is
imported and `traced` hands back the publisher's own method, so publishing costs exactly
what it did. The relay never installs an SDK: the operator chooses one (for example
`opentelemetry-instrument relay run`, configured by the standard OTEL_* variables).
Without one the API's spans are no-ops, and the links, one per message with a valid
`traceparent`, are only built for a span that records.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relay import __version__
from relay.core.publishing import Message, Outcome

try:  # the optional `otel` extra
    from opentelemetry import trace
except ImportError:  # pragma: no cover - the test of that runs in a subprocess
    trace = None  # type: ignore[assignment]

Publish = Callable[[Sequence[Message]], Awaitable[list[Outcome]]]

# OpenTelemetry's names for the brokers (semantic conventions, messaging.system).
_SYSTEMS = {
    "nats": "nats",
    "kafka": "kafka",
    "rabbitmq": "rabbitmq",
    "sqs": "aws_sqs",
    "pubsub": "gcp_pubsub",
    "redis": "redis",
    "sns": "aws_sns",  # not a well-known value of the conventions yet; named as aws_sqs is
    "kinesis": "aws_kinesis",  # likewise
}


def enabled() -> bool:
    """Whether opentelemetry-api is installed, and so batches are traced."""
    return trace is not None


def traced(
    publish: Publish, *, outbox: str, broker: str, broker_type: str, provider: Any = None
) -> Publish:
    """`publish` itself without OpenTelemetry; else `publish` inside a producer span.

    `provider` is a TracerProvider; the global one (the operator's SDK) when None.
    """
    if trace is None:
        return publish
    tracer = trace.get_tracer("outbox-relay", __version__, tracer_provider=provider)
    system = _SYSTEMS.get(broker_type, broker_type)

    async def publish_in_span(messages: Sequence[Message]) -> list[Outcome]:
        attributes: dict[str, Any] = {
            "messaging.system": system,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.batch.message_count": len(messages),
            "relay.outbox": outbox,
            "relay.broker": broker,
        }
        with tracer.start_as_current_span(
            "send", kind=trace.SpanKind.PRODUCER, attributes=attributes
        ) as span:
            # Without an SDK the span records nothing: nothing per message is done for it.
            recording = span.is_recording()
            if recording:
                _describe(span, messages)
            outcomes = await publish(messages)
            if recording:
                acked = next((i for i, o in enumerate(outcomes) if o is not None), len(outcomes))
                if acked < len(outcomes):
                    span.set_attribute("relay.acknowledged", acked)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(outcomes[acked])))
            return outcomes

    return publish_in_span


def _describe(span: Any, messages: Sequence[Message]) -> None:
    """The destination (when the batch has one) and a link to each event's trace."""
    destinations = {m.destination for m in messages}
    if len(destinations) == 1:
        (destination,) = destinations
        span.update_name(f"send {destination}")
        span.set_attribute("messaging.destination.name", destination)
    for message in messages:
        if message.traceparent is not None:
            span.add_link(_context(message), {"messaging.message.id": message.id})


def _context(message: Message) -> Any:
    """The event's span context, from a traceparent the mapper already validated."""
    assert trace is not None and message.traceparent is not None
    value = message.traceparent
    state = trace.TraceState.from_header([message.tracestate]) if message.tracestate else None
    return trace.SpanContext(
        trace_id=int(value[3:35], 16),
        span_id=int(value[36:52], 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(value[53:55], 16)),
        trace_state=state,
    )
