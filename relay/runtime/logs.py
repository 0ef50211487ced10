"""structlog set-up: JSON lines when not on a terminal, and no secrets, ever.

Connection strings are redacted by a processor that sees every event, so a
password cannot leak through an exception message or a stray field: strings,
strings inside mappings and lists, the repr of any other value, and formatted
tracebacks, from structlog and from the standard library's loggers alike.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog
import structlog.tracebacks

from relay.printable import printable, printable_lines
from relay.redaction import redact
from relay.runtime.log_noise import RepeatFilter


def _scrub(value: Any) -> Any:
    """`value` with every string in it redacted; other objects become their redacted repr.

    The renderers would print those objects by repr anyway (an exception, a URL object), after
    this processor; turning them into text here is what lets redaction see them.
    """
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_scrub(v) for v in value]
    return redact(repr(value))


def _redact_event(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        event[key] = _scrub(value)
    return event


def _escape_for_terminal(
    _: Any, __: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """On a console, event data is shown, never obeyed (relay/printable.py); a traceback
    keeps its lines. JSON lines need nothing: the encoder escapes every such character."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = printable_lines(value) if key == "exception" else printable(value)
        elif isinstance(value, list):
            event[key] = [printable(v) if isinstance(v, str) else v for v in value]
    return event


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Route structlog to stderr; `auto` means console on a TTY, JSON elsewhere."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    terminal: list[Any] = [] if use_json else [_escape_for_terminal]
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # A traceback in a JSON line is structured (exc_type, exc_value, frames), never the
    # frames' local variables (they may hold a secret); on a console it stays text.
    exceptions: Any = (
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False, use_rich=False)
        )
        if use_json
        else structlog.processors.format_exc_info
    )
    # Client libraries (aiokafka, aio-pika, botocore) log through the standard library:
    # their lines get the same format, level filter and redaction as ours.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _redact_event,
                *terminal,
                renderer,
            ],
            # format_exc_info: a library's traceback becomes text before _redact_event, not
            # after it in the renderer, where an exception's message would go out unredacted.
            foreign_pre_chain=[
                *shared,
                structlog.stdlib.add_logger_name,
                structlog.processors.format_exc_info,
            ],
        )
    )
    # Their retry noise during an outage: one line per kind a minute (log_noise.py).
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(logging.WARNING, logging.getLevelNamesMapping()[level.upper()]))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            exceptions,
            _redact_event,
            *terminal,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
