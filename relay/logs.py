"""structlog set-up: JSON lines when not on a terminal, and no secrets, ever.

Connection strings are redacted by a processor that sees every event, so a
password cannot leak through an exception message or a stray field.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

_DSN_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]*)@", re.I
)
_KV_PASSWORD = re.compile(
    r"(?P<key>password|passwd|pwd|token|secret)\s*=\s*(?P<val>[^\s&;]+)", re.I
)


def redact(text: str) -> str:
    """Hide passwords in URLs (`user:***@`) and `password=...` pairs."""
    text = _DSN_PASSWORD.sub(r"\g<scheme>\g<user>:***@", text)
    return _KV_PASSWORD.sub(r"\g<key>=***", text)


def _redact_event(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact(value)
    return event


def configure(level: str = "info", fmt: str = "auto") -> None:
    """Route structlog to stderr; `auto` means console on a TTY, JSON elsewhere."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Client libraries (aiokafka, aio-pika, botocore) log through the standard library:
    # their lines get the same format, level filter and redaction as ours.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _redact_event,
                renderer,
            ],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(logging.WARNING, logging.getLevelNamesMapping()[level.upper()]))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            _redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
