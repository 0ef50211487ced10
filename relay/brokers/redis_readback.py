"""Reading Redis Streams back for an audit: XRANGE, page after page, in a script.

Each stream is read from the entry id of the audit's start time (`<ms>-0`: Redis numbers an
entry by the millisecond it added it) up to the stream's last entry when the read began, in
pages of `PAGE` entries. XRANGE takes nothing from anyone: consumer groups, their pending
lists and last-delivered ids are left as they are. The message id is the `ce_id` field, or
the body's `id` in structured mode. The relay's own id set drops a re-send for
`dedup_window`, even of an entry no longer in the stream: that is the duplicate window.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Collection, Sequence
from datetime import UTC, datetime
from typing import Any

import redis.exceptions as rex
from redis.asyncio.connection import Connection

from relay.brokers.redis import BODY_FIELD, open_connection
from relay.config.brokers import RedisBrokerConfig
from relay.core.publishing import STRUCTURED
from relay.core.readback import Horizon, Stored, structured_id
from relay.errors import ReadBackError, TransientPublishError

PAGE = 1_000  # entries per XRANGE: each call holds the server for its length
_ID, _CONTENT_TYPE, _BODY = b"ce_id", b"content-type", BODY_FIELD.encode()  # as SCRIPT names them

# KEYS: the stream. ARGV: start, end, count, the structured mode's content type.
# Returns, per entry: its entry id, its `ce_id` (nil without), and its body when it has no
# `ce_id` and its content type is the structured mode's (else nil).
# Why a script: redis-py's parser (pure Python without hiredis) reads each field and value
# on its own; an entry has some twenty, and reading them cost 95% of a read at about 15,000
# entries a second. Three values an entry read several times faster. It writes nothing.
SCRIPT = """\
-- outbox-relay audit: XRANGE, each entry as its id, its ce_id, or its structured body
local entries = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])
local out = {}
for _, entry in ipairs(entries) do
  local fields, id, structured, body = entry[2], false, false, false
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'ce_id' then
      id = fields[i + 1]
      break
    elseif name == 'content-type' then
      structured = fields[i + 1] == ARGV[4]
    elseif name == 'body' then
      body = fields[i + 1]
    end
  end
  out[#out + 1] = entry[1]
  out[#out + 1] = id
  out[#out + 1] = (not id and structured and body) or false
end
return out
"""
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode(), usedforsecurity=False).hexdigest()


class RedisReader:
    def __init__(self, name: str, config: RedisBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._connection: Connection | None = None
        self._scripted = False  # the server has SCRIPT: EVALSHA finds it

    async def connect(self) -> None:
        if self._connection is not None:
            return
        try:
            self._connection = await open_connection(self.name, self._config)
        except TransientPublishError as exc:
            raise ReadBackError(str(exc)) from exc

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        for stream in sorted(destinations):
            async for stored in self._read_stream(stream, since):
                yield stored

    async def horizon(self, destination: str) -> Horizon:
        what = f"cannot read stream {destination!r}"
        try:
            reply = await self._command(what, "XINFO", "STREAM", destination)
        except rex.ResponseError as exc:
            text = str(exc)
            if "no such key" in text:
                return Horizon(None)  # nothing held: the next XADD creates it
            if text.startswith("WRONGTYPE"):
                return Horizon(None, problem=f"key {destination!r} holds no stream")
            raise self._failed(what, exc) from exc
        info = _mapping(reply)
        limits = None
        if self._config.maxlen is not None:
            limits = f"maxlen ~{self._config.maxlen} (the relay's XADD MAXLEN ~)"
        first = info.get(b"first-entry")
        if not first:
            return Horizon(None, limits=limits)
        entry_id, fields = first
        return Horizon(
            _time(entry_id),
            _message_id(fields),
            limits=limits,
            where=f"stream {destination} entry {_str(entry_id)}",
        )

    async def duplicate_window(self, destination: str) -> float | None:
        """The relay's own deduplication is always on: its id set drops a re-sent id for
        `dedup_window`, whether the stream still holds the entry or not."""
        return float(self._config.dedup_window)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)

    async def _read_stream(self, stream: str, since: datetime | None) -> AsyncIterator[Stored]:
        """The stream's entries from `since`, up to its last one now."""
        what = f"cannot read stream {stream!r}"
        try:
            last = await self._command(what, "XREVRANGE", stream, "+", "-", "COUNT", 1)
        except rex.ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                return  # holds no stream, so no message: the horizon says why
            raise self._failed(what, exc) from exc
        if not last:
            return
        end = last[0][0]
        start: bytes | str = "-" if since is None else f"{_milliseconds(since)}-0"
        while True:
            page = await self._page(what, stream, start, end)
            for i in range(0, len(page), 3):
                entry_id, found, body = page[i : i + 3]
                yield Stored(
                    _str(found) if found is not None else _body_id(body),
                    stream,
                    _time(entry_id),
                    f"entry {_str(entry_id)}",
                )
            if len(page) < 3 * PAGE or page[-3] == end:
                return
            start = b"(" + page[-3]

    async def _page(self, what: str, stream: str, start: bytes | str, end: bytes) -> Any:
        """Up to PAGE entries from `start` to `end`, three values each (SCRIPT)."""
        arguments = (1, stream, start, end, PAGE, STRUCTURED)
        if self._scripted:
            try:
                return await self._command(what, "EVALSHA", SCRIPT_SHA, *arguments)
            except rex.NoScriptError:
                pass  # the server restarted, or its scripts were flushed
            except rex.ResponseError as exc:
                raise self._failed(what, exc) from exc
        page = await self._checked(what, "EVAL", SCRIPT, *arguments)
        self._scripted = True
        return page

    async def _checked(self, what: str, *args: Any) -> Any:
        """A command whose error reply is a failure of the read too."""
        try:
            return await self._command(what, *args)
        except rex.ResponseError as exc:
            raise self._failed(what, exc) from exc

    async def _command(self, what: str, *args: Any) -> Any:
        """One command and its reply; an error reply raises ResponseError, anything else
        that fails drops the connection (its state is unknown) and raises ReadBackError."""
        connection = self._connection
        if connection is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        try:
            await connection.send_command(*args, check_health=False)
            return await connection.read_response()
        except rex.ResponseError:
            raise  # the server answered: the connection is as good as before
        except (rex.RedisError, OSError, TimeoutError) as exc:
            await self.close()
            raise self._failed(what, exc) from exc
        except BaseException:
            await self.close()  # cancelled between a command and its reply
            raise

    def _failed(self, what: str, exc: BaseException) -> ReadBackError:
        if isinstance(exc, rex.TimeoutError):
            text = f"no answer within {self._config.ack_timeout}s"
        else:
            text = str(exc) or type(exc).__name__
        return ReadBackError(f"broker {self.name!r}: {what}: {text}")


def _message_id(fields: Sequence[bytes]) -> str | None:
    """`ce_id`, or in structured mode the event's `id` in the body; None when neither."""
    structured = False
    body = None
    for i in range(0, len(fields) - 1, 2):
        name = fields[i]
        if name == _ID:
            return _str(fields[i + 1])
        if name == _CONTENT_TYPE:
            structured = fields[i + 1] == STRUCTURED.encode()
        elif name == _BODY:
            body = fields[i + 1]
    return structured_id(body) if structured and body is not None else None


def _body_id(body: bytes | None) -> str | None:
    return None if body is None else structured_id(body)


def _mapping(reply: Any) -> dict[bytes, Any]:
    """XINFO STREAM's answer as a mapping: RESP3 gives one, RESP2 a flat list."""
    if isinstance(reply, dict):
        return reply
    return {reply[i]: reply[i + 1] for i in range(0, len(reply) - 1, 2)}


def _milliseconds(when: datetime) -> int:
    return max(int(when.timestamp() * 1000), 0)


def _time(entry_id: bytes) -> datetime:
    """When Redis added the entry, by its own clock: the id's first part, in milliseconds."""
    return datetime.fromtimestamp(int(entry_id.partition(b"-")[0]) / 1000, UTC)


def _str(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
