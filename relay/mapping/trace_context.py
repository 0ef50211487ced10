"""W3C trace context carried from the stored event to the message.

The app that stored the event may have written the request's `traceparent` (and
`tracestate`) into its metadata; the message then carries them as the CloudEvents
distributed-tracing extension, so a consumer continues the same trace. A value that
is not a valid W3C header is dropped, never forwarded and never a reason to hold the
event back: the message goes out without trace context, and the drop is counted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jmespath.exceptions import JMESPathError

from relay.config import TraceContextConfig
from relay.core.publishing import Message
from relay.mapping.expressions import compile_expression

# version-traceid-parentid-flags, lowercase hex; version ff is invalid. A later version may
# append fields; the relay forwards only the four it knows (the contract's pattern), so a
# value with more is dropped rather than passed on unread.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")
_ZERO_TRACE, _ZERO_PARENT = "0" * 32, "0" * 16
# tracestate: up to 32 comma-separated `key=value` members (W3C Trace Context, level 1).
_KEY = r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(rf"[ \t]*{_KEY}={_VALUE}[ \t]*")
_MAX_MEMBERS = 32
# The common cases, checked with one match each (the general rules below give the reasons).
_VERSION_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}").fullmatch
_PLAIN_LIST = re.compile(rf"{_MEMBER.pattern}(?:,{_MEMBER.pattern})*").fullmatch


def traceparent_problem(value: Any) -> str | None:
    """Why `value` is not a W3C traceparent header, or None when it is one."""
    if (
        type(value) is str
        and len(value) == 55
        and _VERSION_00(value)
        and value[3:35] != _ZERO_TRACE
        and value[36:52] != _ZERO_PARENT
    ):
        return None
    if type(value) is not str:
        return f"not a string ({type(value).__name__})"
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return "not version-traceid-parentid-flags in lowercase hex"
    version, trace_id, parent_id, rest = match.groups()
    if version == "ff":
        return "version ff is invalid"
    if rest is not None:
        return "more than the four fields of version 00"
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return "an all-zero trace id or parent id is invalid"
    return None


def tracestate_valid(value: Any) -> bool:
    if type(value) is not str:
        return False
    if value.count(",") < _MAX_MEMBERS and _PLAIN_LIST(value):
        return True  # no empty member, at most 32
    if not value.strip():
        return False
    members = [m for m in value.split(",") if m.strip()]
    return len(members) <= _MAX_MEMBERS and all(_MEMBER.fullmatch(m) for m in members)


@dataclass(frozen=True, slots=True)
class TraceDrop:
    """A trace-context value dropped from a message: which field, and why."""

    field: str
    problem: str


class TraceContext:
    """One outbox's trace-context rule, compiled at start-up; `apply` runs once per event.

    It only sets the message's fields; what is dropped it returns, for the mapper to count.
    """

    def __init__(self, config: TraceContextConfig) -> None:
        self._traceparent = compile_expression(config.traceparent)
        self._tracestate = compile_expression(config.tracestate) if config.tracestate else None
        self.reads_metadata = any("metadata" in text for text in config.expressions())

    def apply(
        self, envelope: Mapping[str, Any], message: Message, metadata_problem: str | None = None
    ) -> TraceDrop | None:
        """Set the message's traceparent and tracestate from the event, when both are valid.

        An absent traceparent is normal (an event stored outside any trace). An invalid
        one is dropped with its tracestate, which means nothing without it; an invalid
        tracestate alone is dropped and the traceparent kept (as W3C asks of a vendor).
        """
        if metadata_problem is not None and self.reads_metadata:
            return TraceDrop("metadata", metadata_problem)
        try:
            traceparent = self._traceparent(envelope)
            tracestate = self._tracestate(envelope) if self._tracestate else None
        except (JMESPathError, TypeError, ValueError, ArithmeticError, RecursionError) as exc:
            # RecursionError: a JMESPath function walking metadata nested too deeply.
            return TraceDrop("trace_context", f"its expression failed: {exc}")
        if traceparent is None:
            return None
        if problem := traceparent_problem(traceparent):
            return TraceDrop("traceparent", problem)
        message.traceparent = traceparent
        if tracestate is None or tracestate == "" or tracestate_valid(tracestate):
            # White space around the list is allowed and means nothing (W3C's OWS), but a
            # header value that begins or ends with it is one a broker's client alters: NATS
            # refused such a message, and the whole event was parked for its trace context.
            message.tracestate = (tracestate or "").strip(" \t") or None
            return None
        return TraceDrop("tracestate", "not a W3C tracestate list")
