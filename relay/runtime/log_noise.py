"""Client libraries' repeated log lines, thinned out.

During a broker outage a client library logs every reconnect attempt: aiokafka wrote
2,330 error lines (`Unable connect to node…`, `NodeNotReadyError`) in 60 s, while the
relay's own `publish failed, retrying` line already said what was wrong. So records of
these libraries pass at most once per kind (logger, level and message template) per
window; the next one that passes says how many were held back since.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from relay.postgres.database import is_lost_reply

# Loggers of the broker and cloud clients the relay uses (and their children).
CLIENT_LOGGERS = ("aiokafka", "aiormq", "aio_pika", "nats", "botocore", "aiobotocore", "urllib3")
WINDOW = 60.0  # seconds between two lines of one kind
_MAX_KINDS = 1000  # kinds remembered; past it, those whose window is over are forgotten


@dataclass(slots=True)
class _Kind:
    shown: float  # when a line of this kind last passed
    held: int = 0  # lines held back since


class RepeatFilter(logging.Filter):
    """A handler filter: one line per kind per `window` from the `prefixes` loggers."""

    def __init__(
        self,
        prefixes: Iterable[str] = CLIENT_LOGGERS,
        window: float = WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._prefixes = tuple(prefixes)
        self._window = window
        self._clock = clock
        self._kinds: dict[tuple[str, int, str], _Kind] = {}
        self._lock = threading.Lock()  # the standard library logs from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._watched(record.name):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            kind = self._kinds.get(key)
            if kind is not None and now - kind.shown < self._window:
                kind.held += 1
                return False
            held = kind.held if kind is not None else 0
            if kind is None and len(self._kinds) >= _MAX_KINDS:
                self._forget(now)
            self._kinds[key] = _Kind(now)
        if held:
            record.msg = (
                f"{record.getMessage()} ({held} more like this in the last "
                f"{self._window:g}s were not logged)"
            )
            record.args = None
        return True

    def _watched(self, name: str) -> bool:
        return any(name == p or name.startswith(f"{p}.") for p in self._prefixes)

    def _forget(self, now: float) -> None:
        for key, kind in list(self._kinds.items()):
            if now - kind.shown >= self._window:
                del self._kinds[key]
        if len(self._kinds) >= _MAX_KINDS:  # all recent: a library logging unique texts
            self._kinds.clear()


def quiet_lost_replies(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Say asyncpg's lost replies (`is_lost_reply`) at debug, not as asyncio's error line,
    which every cut connection wrote after a timed-out statement; every other report goes
    to the handler that was there. Returns what puts that handler back."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_lost_reply(context):
            _log.debug("lost connection's late reply dropped", error=str(context["exception"]))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return lambda: loop.set_exception_handler(previous)


_log = structlog.get_logger("relay.database")
