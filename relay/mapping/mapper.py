"""Turning stored events into integration events, as the config describes.

Every expression is compiled when the Mapper is built, so a typo fails at
start-up. What can still fail at run time (a null in an id template, a type
error inside a JMESPath function) becomes a MappingError for that one event,
which the outbox retries and then parks like any permanent rejection.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from jmespath import functions as jmespath_functions
from jmespath.exceptions import JMESPathError

from relay.config import OutboxConfig, Rule
from relay.core.delivery import Item
from relay.core.event import Event, ExactNumber
from relay.core.nesting import headroom, room_given
from relay.core.publishing import Message, to_structured
from relay.errors import MalformedEventError, MappingError, SchemaViolation
from relay.mapping.encoding import encode_fast, encode_strict
from relay.mapping.expressions import (
    ExpressionError,
    Getter,
    Template,
    compile_expression,
    compile_template,
    may_compute,
)
from relay.mapping.message_schemas import CompiledSchema, compile_schema
from relay.mapping.rule_code import Values, compile_values
from relay.mapping.trace_context import TraceContext, TraceDrop

# Named as when trace context logged its own drops.
log = structlog.get_logger("relay.trace_context")


class _IsoTimes:
    """datetime.isoformat(), the date and seconds written once per second.

    isoformat() was a sixth of mapping's cost; events stored together share their second.
    Only UTC times (what asyncpg gives for timestamptz) take the short way.
    """

    __slots__ = ("_head", "_second", "_zone")

    def __init__(self) -> None:
        self._second: float | None = None
        self._head = ""
        self._zone = ""

    def __call__(self, time: datetime | None) -> str | None:
        if time is None:
            return None
        if time.tzinfo is not UTC:
            return time.isoformat()
        second = math.floor(time.timestamp())
        if second != self._second:
            text = time.isoformat(timespec="seconds")  # ends in +00:00
            self._second, self._head, self._zone = second, text[:-6], text[-6:]
        micros = time.microsecond
        return f"{self._head}.{micros:06d}{self._zone}" if micros else self._head + self._zone


@dataclass(frozen=True, slots=True)
class CompiledRule:
    """One rule, compiled: what turns an event into one message."""

    name: str  # "" for the single-rule form; see relay/config/rules.py
    where: str  # its dotted key in the config, for errors
    type: str
    values: Values  # (event, time) -> (body, id, destination, key, routing key)
    id_suffix: str
    encode: Callable[[Any], bytes]
    when: Getter | None
    when_text: str | None  # as written, for `relay check`
    schema: CompiledSchema | None
    dataschema: str | None  # the schema's `$id`


def _compile(rule: Rule, config: OutboxConfig) -> CompiledRule:
    m = rule.config
    schema = compile_schema(m.schema_) if m.schema_ is not None else None
    # The interpreter compiles every expression first: that reports a bad one.
    interpreted = _interpreted(
        _compile_payload(m.payload),
        compile_template(rule.id, distinct=True),
        compile_template(m.destination),
        compile_template(rule.key),
        compile_template(m.routing_key) if m.routing_key else None,
    )
    values = compile_values(m.payload, rule.id, m.destination, rule.key, m.routing_key)
    return CompiledRule(
        name=rule.name,
        where=rule.where,
        type=m.type,
        values=values or interpreted,
        id_suffix=rule.id_suffix,
        encode=_encoder(m.payload),
        when=compile_expression(m.when) if m.when else None,
        when_text=m.when,
        schema=schema,
        dataschema=schema.id if schema is not None else None,
    )


class Mapper:
    """Maps one outbox's events: each event type has one rule or several."""

    def __init__(
        self,
        outbox: str,
        config: OutboxConfig,
        *,
        count_invalid_trace: Callable[[], None] | None = None,
    ) -> None:
        self.outbox = outbox
        self._aggregates = frozenset(config.aggregates) if config.aggregates is not None else None
        self._source = config.source(outbox)
        self._times = _IsoTimes()
        self._by_type = {
            event_type: tuple(_compile(rule, config) for rule in rules)
            for event_type, rules in config.rules(outbox).items()
        }
        sources = [config.key, config.id]
        for rules in config.rules(outbox).values():
            for rule in rules:
                m = rule.config
                sources += [m.destination, m.key or "", m.id or "", m.routing_key or ""]
                sources += [*_payload_expressions(m.payload), m.when or ""]
        # Metadata that is not JSON fails the event only if the message itself reads it.
        self._needs_metadata = any("metadata" in text for text in sources)
        trace = config.trace_context
        self._trace = TraceContext(trace) if trace else None
        self._count_invalid_trace = count_invalid_trace
        self.invalid_trace = 0  # trace contexts dropped so far
        self._structured = config.cloudevents == "structured"
        # Decoding metadata is skipped when no expression could read it.
        self.reads_metadata = self._needs_metadata or (
            self._trace is not None and self._trace.reads_metadata
        )

    def rules_for(self, event: Event) -> tuple[CompiledRule, ...]:
        """The rules that map this event, in the config's order; none if it is skipped."""
        if self._aggregates is not None and event.aggregate_type not in self._aggregates:
            return ()
        return self._by_type.get(event.type, ())

    def map(self, event: Event) -> Message | None:
        """The message of the event's first rule (its only one, in the single-rule form)."""
        rules = self.rules_for(event)
        return self.message(event, rules[0]) if rules else None

    def messages(self, event: Event) -> list[Message]:
        """Every rule's message, in order; the first failure raises."""
        out = []
        for rule in self.rules_for(event):
            message = self.message(event, rule)
            if message is not None:
                out.append(message)
        return out

    def message(self, event: Event, rule: CompiledRule) -> Message | None:
        """This rule's message for the event; None when its `when` rejects the event."""
        problem = event.problem or (event.metadata_problem if self._needs_metadata else None)
        if problem:
            raise MalformedEventError(
                f"outboxes.{self.outbox}: event at position {event.position} ({_where(event)})"
                f" is malformed: {problem}",
                problem,
            )
        time_text = self._times(event.created_at)
        # Only `when` and trace context read the envelope itself; the values need none.
        envelope = event.envelope(time_text) if rule.when or self._trace else None
        try:
            if rule.when is not None and not _truthy(rule.when(envelope or {})):
                return None
            body, id_, destination, key, routing_key = rule.values(event, time_text)
            if rule.schema is not None and not rule.schema.is_valid(body):
                raise self._violation(event, rule, rule.schema.violations(body))
            message = Message(
                id_ + rule.id_suffix if rule.id_suffix else id_,
                rule.type,
                destination,
                key,
                rule.encode(body),
                self._source,
                event.created_at,
                event.position,
                "application/json",
                routing_key,
                time_text,
                rule.dataschema,
            )
        except (ExpressionError, JMESPathError, TypeError, ValueError, ArithmeticError) as exc:
            # ArithmeticError: `avg()` or `sum()` over an integer beyond a float's range
            # (jsonb holds them exactly) overflowed, and ended the relay at every start.
            raise MappingError(
                f"{rule.where}: cannot map event at position "
                f"{event.position} ({_where(event)}): {exc}"
            ) from exc
        except RecursionError as exc:
            # A walk over deep data (encoding, a template, JMESPath, a schema) met the
            # stack's limit: again with room for the depth the relay reads, once.
            if room_given():
                raise MappingError(
                    f"{rule.where}: cannot map event at position {event.position}"
                    f" ({_where(event)}): its values are nested too deeply for this rule ({exc})"
                ) from exc
            with headroom():
                return self.message(event, rule)
        if envelope is not None and self._trace is not None:
            dropped = self._trace.apply(envelope, message, event.metadata_problem)
            if dropped is not None:
                self._trace_dropped(message, dropped)
        if self._structured:
            to_structured(message)
        return message

    def _trace_dropped(self, message: Message, dropped: TraceDrop) -> None:
        self.invalid_trace += 1
        if self._count_invalid_trace is not None:
            self._count_invalid_trace()
        # Every drop is counted; only the first is logged, so that an app writing bad
        # values does not flood the log (relay_trace_context_invalid_total shows the rest).
        if self.invalid_trace == 1:
            log.warning(
                "invalid trace context dropped; the message goes out without it",
                outbox=self.outbox,
                position=message.position,
                message_id=message.id,
                field=dropped.field,
                problem=dropped.problem,
            )

    def _violation(self, event: Event, rule: CompiledRule, found: list[str]) -> SchemaViolation:
        shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        return SchemaViolation(
            f"{rule.where}: the body of event at position {event.position} ({_where(event)})"
            f" does not match its schema: {shown}",
            found,
        )


def _truthy(value: Any) -> bool:
    """JMESPath's truth: false, null, empty strings, lists and objects are false; 0 is true."""
    return value is not None and value is not False and value not in ("", [], {})


def _where(event: Event) -> str:
    return f"{event.aggregate_type}/{event.aggregate_id}@{event.version}"


def _number_to_jmespath(name: str) -> None:
    """JMESPath's functions check their arguments' types by class name: an ExactNumber is a
    number to them too, or `max(data.amounts)` would fail on one. (Here, where the events'
    values meet the expression language, which knows nothing of events.)"""
    jmespath_functions.TYPES_MAP.setdefault(name, "number")
    if name not in jmespath_functions.REVERSE_TYPES_MAP["number"]:
        jmespath_functions.REVERSE_TYPES_MAP["number"] += (name,)


_number_to_jmespath(ExactNumber.__name__)


def _encoder(payload: str | Mapping[str, str]) -> Callable[[Any], bytes]:
    """Values read from strict JSON are finite; only a function or a literal can compute
    NaN or Infinity (sum, avg, to_number('1e999'), `1e999`): those payloads stay strict."""
    computes = any(may_compute(source) for source in _payload_expressions(payload))
    return encode_strict if computes else encode_fast


def _payload_expressions(payload: str | Mapping[str, str]) -> list[str]:
    """A payload is one expression, or a mapping of field names to expressions."""
    return [payload] if isinstance(payload, str) else list(payload.values())


def _interpreted(
    payload: Getter, id_: Template, destination: Template, key: Template, routing: Template | None
) -> Values:
    """A rule with a JMESPath expression: its getters over the event's envelope."""

    def values(event: Event, time_text: str | None) -> tuple[Any, str, str, str, str | None]:
        envelope = event.envelope(time_text)
        body, id_text = payload(envelope), id_(envelope)
        return (
            body,
            id_text,
            destination(envelope),
            key(envelope),
            routing(envelope) if routing else None,
        )

    return values


def _compile_payload(payload: str | Mapping[str, str]) -> Getter:
    if isinstance(payload, str):
        return compile_expression(payload)
    fields = tuple((name, compile_expression(expr)) for name, expr in payload.items())

    def build(envelope: Mapping[str, Any]) -> dict[str, Any]:
        return {name: get(envelope) for name, get in fields}

    return build


def items_of(mapper: Mapper, event: Event, skipped: Callable[[CompiledRule], None]) -> list[Item]:
    """The event's messages, one per rule whose `when` takes it; a failure as its item.

    `skipped` is told of each rule whose condition rejected the event.
    """
    items = []
    for rule in mapper.rules_for(event):
        try:
            message = mapper.message(event, rule)
        except MappingError as exc:
            items.append(Item(event, None, exc, rule.name))
            continue
        if message is None:
            skipped(rule)
        else:
            items.append(Item(event, message, None, rule.name))
    return items
