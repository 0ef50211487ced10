"""Redis Streams publisher, with redis-py (redis.asyncio).

Each message becomes one entry, XADD to the stream its `destination` names (with
`MAXLEN ~` when configured): the CloudEvents attributes as `ce_*` fields,
`content-type`, and the payload in `body`. Redis numbers the entries itself, so a
stream keeps the order the relay sent them in.

Deduplication. Redis has none of its own, so the relay keeps, per stream, a sorted
set of the ids it added within the last `dedup_window` (scored by Redis's clock), and
one Lua script checks the set and adds the entry atomically: a re-send within the
window (the same relay retrying, or a new lease holder repeating a batch a crashed one
had stored) is acknowledged and not stored again. Explicit entry ids derived from the
position were not used: Redis refuses an id that is not above the stream's last one,
which breaks as soon as two lanes (or two outboxes) write one stream.

A batch goes out as one script call (or a few, by size), each a single round trip;
the script stops at the first entry Redis refuses and reports it, so nothing after
a failed message is stored before it. The client does not retry: a lost connection
or a call without an answer within `ack_timeout` fails the batch as transient, and the
outbox's backoff decides when to try again.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rex
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from relay.brokers._batch import connect_or_fail, connected, not_sent
from relay.config.base import TlsConfig
from relay.config.brokers import RedisBrokerConfig
from relay.core.publishing import Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt

MAX_CALL_MESSAGES = 500  # entries per script call: one call holds the server for its length
MAX_CALL_BYTES = 4 * 1024 * 1024  # fields and values per call (a bigger message goes alone)
BODY_FIELD = "body"

# KEYS: stream 1, its id set, stream 2, its id set, ...
# ARGV: window (ms), maxlen ('' for none), then per message: its stream, its id, its field
#       count n, then n fields and values.
# Returns per message: the entry id, 0 for a duplicate; and stops at the first entry
# Redis refuses, whose place holds {error text}.
# TIME before writes needs effects replication: the default from Redis 5, the only kind
# from 7 (replicate_commands is then a no-op kept for compatibility).
SCRIPT = """\
-- outbox-relay: XADD each entry unless its id is in the stream's set of recent ids
if redis.replicate_commands then redis.replicate_commands() end
local window = tonumber(ARGV[1])
local maxlen = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local results, added, recent, number = {}, {}, {}, {}
for k = 1, #KEYS, 2 do number[KEYS[k]] = (k + 1) / 2 end
-- Each stream's ids, looked up in one ZMSCORE: an id recorded within the window is a
-- duplicate (expired ids are recognised by their score, and pruned at the end).
local asked = {}
local i = 3
while i <= #ARGV do
  local s = number[ARGV[i]]
  if asked[s] == nil then asked[s] = {} end
  table.insert(asked[s], ARGV[i + 1])
  i = i + 3 + 2 * tonumber(ARGV[i + 2])
end
for s, ids in pairs(asked) do
  recent[s] = {}
  for start = 1, #ids, 1000 do
    local last = math.min(start + 999, #ids)
    local scores = redis.call('ZMSCORE', KEYS[2 * s], unpack(ids, start, last))
    for k = start, last do
      local at = scores[k - start + 1]
      if at and tonumber(at) >= now - window then recent[s][ids[k]] = true end
    end
  end
end
-- The first write of a script is the one Redis refuses when over maxmemory (it cannot stop
-- a script half-way), so the entries go first and the ids after them.
local function finish()
  for s, ids in pairs(added) do
    local seen = KEYS[2 * s]
    for start = 1, #ids, 1000 do
      local pairs_ = {}
      for k = start, math.min(start + 999, #ids) do
        pairs_[#pairs_ + 1] = now
        pairs_[#pairs_ + 1] = ids[k]
      end
      redis.call('ZADD', seen, unpack(pairs_))
    end
    redis.call('ZREMRANGEBYSCORE', seen, '-inf', '(' .. (now - window))
    redis.call('PEXPIRE', seen, window)
  end
  return results
end
i = 3
while i <= #ARGV do
  local s, id, n = number[ARGV[i]], ARGV[i + 1], tonumber(ARGV[i + 2])
  if recent[s][id] then
    results[#results + 1] = 0
  else
    local r
    if maxlen == '' then
      r = redis.pcall('XADD', KEYS[2 * s - 1], '*', unpack(ARGV, i + 3, i + 2 + 2 * n))
    else
      r = redis.pcall('XADD', KEYS[2 * s - 1], 'MAXLEN', '~', maxlen, '*',
                      unpack(ARGV, i + 3, i + 2 + 2 * n))
    end
    if type(r) == 'table' and r.err then
      results[#results + 1] = {r.err}
      return finish()
    end
    recent[s][id] = true
    if added[s] == nil then added[s] = {} end
    table.insert(added[s], id)
    results[#results + 1] = r
  end
  i = i + 3 + 2 * n
end
return finish()
"""

SCRIPT_SHA = hashlib.sha1(SCRIPT.encode(), usedforsecurity=False).hexdigest()

# What Redis answers for an entry it will never take, whatever the retry: the stream's key
# holds another type. Everything else (OOM, NOPERM, READONLY, BUSY, LOADING) passes.
_PERMANENT = ("WRONGTYPE",)


@dataclass(slots=True)
class _Entry:
    index: int  # in the batch
    message: Message
    packed: bytes  # its script arguments, in RESP: stream, id, field count, fields, values
    arguments: int  # how many
    size: int


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


_NAMES: dict[str, bytes] = {}  # a field name -> its bulk string, built once per name
_SCRIPT, _SHA = _bulk(SCRIPT.encode()), _bulk(SCRIPT_SHA.encode())


class RedisPublisher:
    def __init__(self, name: str, config: RedisBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._connection: Connection | None = None
        self._sha: str | None = None
        self._head = _bulk(str(round(config.dedup_window * 1000)).encode()) + _bulk(
            b"" if config.maxlen is None else str(config.maxlen).encode()
        )
        self.duplicates = 0
        self.last_duplicates: list[int] = []

    # -- connection ------------------------------------------------------------------------------

    async def connect(self) -> None:
        if self._connection is not None:
            return
        self._connection = await open_connection(self.name, self._config)

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: connect and authenticate, and look at each stream's key: one
        that holds another type would park every message. Writes nothing."""
        await self.connect()
        connection = connected(self._connection)
        problems = []
        try:
            for destination in sorted(destinations):
                if problem := self.refused(destination):
                    problems.append(f"broker {self.name!r}: {problem}")
                    continue
                try:
                    await connection.send_command("TYPE", destination)
                    kind = await connection.read_response()
                except rex.RedisError as exc:
                    problems.append(f"broker {self.name!r}: stream {destination!r}: {exc}")
                    continue
                if kind not in (b"stream", b"none"):
                    problems.append(
                        f"broker {self.name!r}: key {destination!r} holds a {_str(kind)},"
                        " not a stream: every message to it would be parked (WRONGTYPE)"
                    )
            return problems
        finally:
            await self.close()

    # -- a batch ---------------------------------------------------------------------------------

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        self.last_duplicates = []
        entries: list[_Entry] = []
        refused: UnsendableError | None = None
        for index, message in enumerate(messages):
            entry_or_error = self._entry(index, message)
            if isinstance(entry_or_error, UnsendableError):
                refused = entry_or_error
                break
            entries.append(entry_or_error)
        outcomes: list[Outcome] = []
        if entries:
            if failed := await connect_or_fail(self.connect, len(entries)):
                return failed + not_sent(len(messages) - len(entries))
            outcomes = await self._send(entries)
        if refused is not None and len(outcomes) == len(entries):
            failed_before = any(o is not None for o in outcomes)
            outcomes.append(not_sent(1)[0] if failed_before else refused)
        return outcomes + not_sent(len(messages) - len(outcomes))

    def _entry(self, index: int, message: Message) -> _Entry | UnsendableError:
        if problem := self.refused(message.destination):
            return UnsendableError(f"broker {self.name!r}: {problem}")
        attributes = message_fields(message)
        attributes[BODY_FIELD] = ""
        parts = [_bulk(message.destination.encode()), _bulk(message.id.encode())]
        parts.append(_bulk(b"%d" % len(attributes)))
        size = 0
        for name, text in attributes.items():
            if (bulk := _NAMES.get(name)) is None:
                bulk = _NAMES[name] = _bulk(name.encode())
            value = text.encode() if name != BODY_FIELD else message.body
            parts += (bulk, _bulk(value))
            size += len(name) + len(value)
        if size > self._config.max_message_bytes:
            return UnsendableError(
                f"broker {self.name!r}: message {excerpt(message.id)}: {size:,} bytes (fields and"
                f" values) is more than max_message_bytes ({self._config.max_message_bytes:,})"
            )
        return _Entry(index, message, b"".join(parts), len(parts), size)

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`)."""
        entry = self._entry(0, message)
        return str(entry) if isinstance(entry, UnsendableError) else None

    def dedup_scope(self, destination: str) -> str | None:
        """The relay's own window of ids, kept per stream (`dedup_window`)."""
        return f"broker {self.name!r}, stream {destination}"

    def refused(self, stream: str) -> str | None:
        """Why `stream` can never be a destination here; None when it can."""
        if not stream:
            return "invalid stream name '': the destination is empty"
        if stream.startswith(self._config.dedup_key_prefix):
            return (
                f"invalid stream name {stream!r}: it starts with dedup_key_prefix"
                f" {self._config.dedup_key_prefix!r}, the relay's own keys"
            )
        return None

    async def _send(self, entries: list[_Entry]) -> list[Outcome]:
        """Call after call, in order; the first that fails stops the rest."""
        outcomes: list[Outcome] = []
        for chunk in _chunks(entries):
            results = await self._call(chunk)
            outcomes += results
            if len(results) < len(chunk) or any(r is not None for r in results):
                break
        return outcomes

    async def _call(self, chunk: list[_Entry]) -> list[Outcome]:
        """One script call: an outcome for each entry up to the first that failed."""
        connection = connected(self._connection)
        prefix = self._config.dedup_key_prefix
        streams = dict.fromkeys(entry.message.destination for entry in chunk)
        keys = [_bulk(k.encode()) for s in streams for k in (s, prefix + s)]
        count = len(keys) + 2 + sum(entry.arguments for entry in chunk)
        body = [*keys, self._head, *(entry.packed for entry in chunk)]
        try:
            replies = await self._evaluate(connection, count, len(keys), body)
        except Exception as exc:  # noqa: BLE001 - classified, not swallowed
            if isinstance(exc, rex.ConnectionError | rex.TimeoutError | OSError):
                await self.close()  # the connection's state is unknown: a new one next time
            return [self._call_error(exc)] * len(chunk)
        return self._outcomes(chunk, replies)

    async def _evaluate(
        self, connection: Connection, count: int, keys: int, body: list[bytes]
    ) -> list[Any]:
        """EVALSHA, or EVAL when the server does not have the script (restarted, flushed).

        The command is written in RESP here: redis-py's own packing of thousands of
        arguments cost more CPU than the rest of the batch's path."""
        if self._sha is not None:
            try:
                return await self._run(connection, count, keys, body, (b"EVALSHA", _SHA))
            except rex.NoScriptError:
                pass
        replies = await self._run(connection, count, keys, body, (b"EVAL", _SCRIPT))
        self._sha = SCRIPT_SHA
        return replies

    async def _run(
        self,
        connection: Connection,
        count: int,
        keys: int,
        body: list[bytes],
        call: tuple[bytes, bytes],  # the command, the script (or its SHA) as a bulk string
    ) -> list[Any]:
        command, script = call
        head = b"*%d\r\n%s%s%s" % (count + 3, _bulk(command), script, _bulk(b"%d" % keys))
        await connection.send_packed_command([head, *body], check_health=False)
        replies: list[Any] = await connection.read_response()
        return replies

    def _outcomes(self, chunk: list[_Entry], replies: list[Any]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for entry, reply in zip(chunk, replies, strict=False):
            if isinstance(reply, list):  # the entry Redis refused; the script stopped there
                text = reply[0].decode(errors="replace") if reply else "refused"
                outcomes.append(self._refusal(entry.message, text))
                break
            if reply == 0:
                self.duplicates += 1
                self.last_duplicates.append(entry.index)
            outcomes.append(None)
        return outcomes

    def _refusal(self, message: Message, text: str) -> PublishError:
        said = f"broker {self.name!r}: stream {message.destination!r}: {text}"
        if text.startswith(_PERMANENT):
            return PermanentPublishError(said)
        return TransientPublishError(said)

    def _call_error(self, exc: BaseException) -> PublishError:
        """Why a whole call failed; never the message's fault, so always transient."""
        if isinstance(exc, rex.TimeoutError):
            text = f"no answer within {self._config.ack_timeout}s"
        else:
            text = self._text(exc)
        return TransientPublishError(f"broker {self.name!r}: {text}")

    def _text(self, exc: BaseException) -> str:
        return str(exc) or type(exc).__name__


async def open_connection(name: str, config: RedisBrokerConfig) -> Connection:
    """One connection, authenticated and answering PING; TransientPublishError when refused
    or unreachable. The publisher's and the audit's.

    One connection, not a pool: a batch is one command at a time, in order, so a pool would
    only add a lock. redis-py's own retries are off: the outbox's backoff is the one policy."""
    c = config
    options: dict[str, Any] = dict(parse_url(c.url.get_secret_value().strip()))
    if c.password is not None:
        options["username"] = c.username
        options["password"] = c.password.get_secret_value()
    kind = options.pop("connection_class", Connection)
    if kind is SSLConnection:
        kind, options["tls"] = _TlsConnection, c.tls or TlsConfig()
    connection: Connection = kind(
        **options,
        socket_connect_timeout=c.connect_timeout,
        socket_timeout=c.ack_timeout,
        retry=Retry(NoBackoff(), 0),
        client_name="outbox-relay",
    )
    try:
        await connection.connect()  # type: ignore[no-untyped-call]  # TLS, AUTH (HELLO), SELECT, CLIENT SETNAME
        await connection.send_command("PING")
        await connection.read_response()
    except Exception as exc:
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        raise TransientPublishError(
            f"broker {name!r}: cannot connect: {str(exc) or type(exc).__name__}"
        ) from exc
    return connection


def message_fields(message: Message) -> dict[str, str]:
    """An entry's fields but the body: CloudEvents in binary mode, named as in the Kafka
    binding (`ce_` prefix), and `content-type`; in structured mode `content-type` alone."""
    fields = cloudevent_attributes(message, "ce_")
    fields["content-type"] = message.content_type
    return fields


def _chunks(entries: list[_Entry]) -> list[list[_Entry]]:
    """Runs of up to MAX_CALL_MESSAGES entries and MAX_CALL_BYTES (a bigger one alone)."""
    chunks: list[list[_Entry]] = []
    chunk: list[_Entry] = []
    size = 0
    for entry in entries:
        if chunk and (len(chunk) == MAX_CALL_MESSAGES or size + entry.size > MAX_CALL_BYTES):
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append(entry)
        size += entry.size
    if chunk:
        chunks.append(chunk)
    return chunks


def _str(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class _TlsConnection(SSLConnection):
    """redis-py's TLS connection, with the relay's own context (tls.ca_file, or the system's
    CAs; a client certificate when set), as every broker verifies."""

    def __init__(self, *, tls: TlsConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssl_context.context = tls.context()
