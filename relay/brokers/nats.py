"""NATS publisher: JetStream by default, core NATS on request.

Messages are written to the socket in order and all of a batch's PubAcks are
awaited together, so a batch costs about one round trip. The message id goes
in `Nats-Msg-Id`, so JetStream drops a re-sent message within the stream's
duplicate window; a PubAck marked duplicate counts as published.

The client does not reconnect by itself: a lost connection fails the batch
as transient, and the outbox's backoff decides when to connect again. That
keeps one retry policy, visible in `status`, for every broker.

Core NATS (`jetstream: false`) has no acknowledgement: a flush proves the
server read the batch, not that anyone received it. The relay warns at start.

Each subject is checked before it is sent. The server would store a message
on a wildcard subject, and answers an empty token as if no stream captured
it: a transient error that would hold the outbox back for ever. So are the
header values: nats-py rewrites CR, LF and whitespace at either end, which
would give two events one `Nats-Msg-Id` (see `_header_values`).

With TLS configured, the client refuses a server that does not require TLS
before it sends CONNECT, so credentials never cross the network in cleartext.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Collection, Sequence

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from relay.brokers._batch import connect_or_fail, connected, not_sent
from relay.brokers._header_values import altered
from relay.brokers._nats import open_connection, text_of
from relay.brokers._nats_subjects import (
    VALID_SUBJECT,
    captures,
    invalid,
    reserved,
    too_long,
)
from relay.config.brokers import NatsBrokerConfig, NatsStreamConfig
from relay.core.publishing import ATTRIBUTES, Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt

log = structlog.get_logger("relay.brokers.nats")

# JetStream API error codes that no retry can fix.
_PERMANENT_CODES = {
    10054,  # message size exceeds the stream's maximum
    10097,  # header size exceeds the maximum allowed (64 KiB): an id or key that long
}

# Subjects whose stream `refusal` and `dedup_scope` remember (a template's may be many).
_SUBJECTS_KEPT = 10_000
# A JetStream stream refuses a message whose header block is longer (err_code 10097).
MAX_HEADER_BYTES = 65_535


class NatsPublisher:
    def __init__(self, name: str, config: NatsBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._header_limit = MAX_HEADER_BYTES if config.jetstream else None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._replies: _Replies | None = None
        self.duplicates = 0
        self.last_duplicates: list[int] = []
        self._max_payload: int | None = None  # the server's, once a connection learnt it
        # subject -> (its stream, the stream's max_msg_size), as `probe` found them
        self._streams: dict[str, str | None] = {}  # subject -> the stream capturing it
        self._limits: dict[str, int] = {}  # stream -> its max_msg_size, where it has one
        # every stream's (name, subjects), as `probe` listed them: a subject made from an
        # event finds its stream here, without a request each
        self._listed: list[tuple[str, list[str]]] = []

    async def connect(self) -> None:
        if self._nc is not None and self._nc.is_connected:
            return
        await self.close()
        c = self._config
        nc = await self._open()
        self._nc, self._js = nc, nc.jetstream(timeout=c.ack_timeout)
        self._max_payload = nc.max_payload
        if not c.jetstream:
            log.warning(
                "core NATS has no acknowledgements: a message nobody is subscribed to is lost",
                broker=self.name,
            )
            return
        try:
            # One API round trip: proves JetStream is on, and sets up reply
            # subscriptions before the first batch so its order is kept.
            await self._js.account_info()
            self._replies = await _Replies.subscribe(nc)
            if c.stream is not None:
                await self._provision_stream(c.stream)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            await self.close()
            raise TransientPublishError(
                f"broker {self.name!r}: JetStream unavailable: {_text(exc)}"
            ) from exc

    async def _open(self) -> Client:
        """A connection, authenticated; TransientPublishError when refused or unreachable."""
        return await open_connection(self.name, self._config)

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: connect and authenticate, and find the stream that captures each
        subject. Creates nothing and publishes nothing; what is wrong, one line each."""
        c = self._config
        nc = await self._open()
        self._max_payload = nc.max_payload
        try:
            if not c.jetstream:
                return []
            js = nc.jetstream(timeout=c.ack_timeout)
            try:
                await js.account_info()
                await self._list_streams(js)
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                return [f"broker {self.name!r}: JetStream unavailable: {_text(exc)}"]
            return [p for p in [await self._probe_stream(js)] if p] + [
                problem
                for subject in sorted(destinations)
                if (problem := await self._probe_subject(js, subject))
            ]
        finally:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _probe_stream(self, js: JetStreamContext) -> str | None:
        wanted = self._config.stream
        if wanted is None or wanted.create:
            return None  # created at start when missing
        try:
            await js.stream_info(wanted.name)
        except nats.js.errors.NotFoundError:
            return (
                f"broker {self.name!r}: stream {wanted.name!r} does not exist and stream.create"
                " is false"
            )
        return None

    async def _probe_subject(self, js: JetStreamContext, subject: str) -> str | None:
        if not VALID_SUBJECT.fullmatch(subject) or too_long(subject) or reserved(subject):
            return f"broker {self.name!r}: {invalid(subject)}"
        wanted = self._config.stream
        if (
            wanted is not None
            and wanted.create
            and any(captures(pattern, subject) for pattern in wanted.subjects)
        ):
            return None  # the configured stream captures it, and is created at start
        try:
            stream = await js.find_stream_name_by_subject(subject)
            limit = (await js.stream_info(stream)).config.max_msg_size
        except nats.js.errors.NotFoundError:
            return (
                f"broker {self.name!r}: no JetStream stream captures subject {subject!r}:"
                " every message to it would be retried for ever; create a stream for it"
                " (or configure brokers.<name>.stream)"
            )
        self._streams[subject] = stream
        if limit is not None and limit > 0:  # `refusal` judges its messages by it
            self._limits[stream] = limit
        return None

    async def _list_streams(self, js: JetStreamContext) -> None:
        """Every stream's subjects and max_msg_size, for `refusal` and `dedup_scope` to judge
        subjects `probe` was not asked about (made from events)."""
        self._listed = []
        for info in await js.streams_info():
            name, limit = info.config.name, info.config.max_msg_size
            if name is None:
                continue
            self._listed.append((name, list(info.config.subjects or [])))
            if limit is not None and limit > 0:
                self._limits[name] = limit

    def _stream_of(self, subject: str) -> str | None:
        """The stream capturing `subject`, as `probe` found or listed it; None if unknown."""
        if subject in self._streams:
            return self._streams[subject]
        stream = next(
            (
                name
                for name, subjects in self._listed
                if any(captures(p, subject) for p in subjects)
            ),
            None,
        )
        if len(self._streams) < _SUBJECTS_KEPT:
            self._streams[subject] = stream
        return stream

    async def _provision_stream(self, wanted: NatsStreamConfig) -> None:
        """Create the configured stream if missing; say so if it differs from the config."""
        assert self._js is not None
        try:
            info = await self._js.stream_info(wanted.name)
        except nats.js.errors.NotFoundError:
            if not wanted.create:
                log.warning("stream not found and stream.create is false", stream=wanted.name)
                return
            await self._js.add_stream(
                StreamConfig(
                    name=wanted.name,
                    subjects=wanted.subjects,
                    storage=StorageType(wanted.storage),
                    duplicate_window=wanted.duplicate_window,
                )
            )
            log.info("stream created", broker=self.name, stream=wanted.name)
            return
        missing = set(wanted.subjects) - set(info.config.subjects or [])
        window = info.config.duplicate_window
        storage = getattr(info.config.storage, "value", info.config.storage)
        if missing or storage != wanted.storage or window != wanted.duplicate_window:
            log.warning(
                "stream differs from the config; it is left unchanged",
                stream=wanted.name,
                missing_subjects=sorted(missing),
                storage=storage,
                duplicate_window=window,
            )

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        # Only what comes before the first message that cannot be sent as written is sent,
        # so order is kept; that one is refused for good, the rest retried after it.
        self.last_duplicates = []
        if failed := await connect_or_fail(self.connect, len(messages)):
            return failed
        limit = connected(self._nc).max_payload  # the server's, as it said when we connected
        headers: list[dict[str, str]] = []
        refused: PermanentPublishError | None = None
        for message in messages:
            problem = _unsendable(message)
            if problem is None:
                carried = message_headers(message)
                if (problem := _oversized(message, carried, limit, self._header_limit)) is None:
                    headers.append(carried)
                    continue
            refused = UnsendableError(f"broker {self.name!r}: {problem}")
            break
        sendable = len(headers)
        outcomes = await self._send(messages[:sendable], headers) if sendable else []
        if refused is not None:
            outcomes += [refused, *not_sent(len(messages) - sendable - 1)]
        return outcomes

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`).
        Its size is judged once the server's max_payload is known: after `probe` or
        `connect`."""
        problem = _unsendable(message)
        if problem is None and self._max_payload is not None:
            carried = message_headers(message)
            problem = _oversized(message, carried, self._max_payload, self._header_limit)
        if (
            problem is None
            and self._limits
            and (stream := self._stream_of(message.destination)) is not None
            and (limit := self._limits.get(stream))
        ):
            size = len(message.body) + _header_bytes(message_headers(message))
            if size > limit:  # the stream refuses it (10054), as `relay run` would find
                problem = (
                    f"message {excerpt(message.id)} is {size:,} bytes with its headers,"
                    f" larger than stream {stream}'s max_msg_size ({limit:,})"
                )
        return None if problem is None else f"broker {self.name!r}: {problem}"

    def dedup_scope(self, destination: str) -> str | None:
        """JetStream drops a message whose Nats-Msg-Id its stream has seen within its
        duplicate window: the stream is the scope (the configured one for a subject it
        captures, else the one `probe` found). Not asked (`--offline`), it is the whole
        broker, which may join two streams. Core NATS keeps every message."""
        if not self._config.jetstream:
            return None
        wanted = self._config.stream
        if wanted is not None and any(captures(p, destination) for p in wanted.subjects):
            return f"broker {self.name!r}, stream {wanted.name}"
        if (stream := self._stream_of(destination)) is not None:
            return f"broker {self.name!r}, stream {stream}"
        return f"broker {self.name!r} (its streams not asked)"

    async def _send(
        self, messages: Sequence[Message], headers: Sequence[dict[str, str]]
    ) -> list[Outcome]:
        if not self._config.jetstream:
            return await self._publish_core(messages, headers)
        nc, replies = connected(self._nc), connected(self._replies)
        acks = replies.expect(len(messages))
        publish, reply_to, first = nc.publish, replies.subject, acks.first
        for i, message in enumerate(messages):
            try:
                # nats-py's public publish(subject, payload, reply, headers), positionally.
                await publish(message.destination, message.body, reply_to(first + i), headers[i])
            except Exception as exc:  # noqa: BLE001 - classified, not swallowed
                # Nothing after a failed message is sent, so order is kept on retry.
                acks.sent(i)
                return [
                    *await self._acks(acks),
                    self._classify(exc),
                    *not_sent(len(messages) - i - 1),
                ]
        return await self._acks(acks)

    async def _publish_core(
        self, messages: Sequence[Message], headers: Sequence[dict[str, str]]
    ) -> list[Outcome]:
        """Core NATS: written in order, then one PING/PONG proves the server read them.

        A message the client refuses (too large, say) fails alone: those written before
        it are still flushed and count as published, those after it are not sent.
        """
        nc = connected(self._nc)
        written, refused = len(messages), None
        for i, message in enumerate(messages):
            try:
                await nc.publish(message.destination, message.body, headers=headers[i])
            except Exception as exc:  # noqa: BLE001 - classified, not swallowed
                written, refused = i, self._classify(exc)
                break
        try:
            await nc.flush(timeout=math.ceil(self._config.ack_timeout))
        except Exception as exc:  # noqa: BLE001 - classified, not swallowed
            await self.close()
            return [self._classify(exc)] * len(messages)
        if refused is None:
            return [None] * written
        if not isinstance(refused, PermanentPublishError):
            await self.close()
        return [None] * written + [refused, *not_sent(len(messages) - written - 1)]

    async def _acks(self, acks: _BatchAcks) -> list[Outcome]:
        """Every PubAck of the batch, or a transient failure for those that did not come."""
        if acks.expected:
            try:
                async with asyncio.timeout(self._config.ack_timeout):
                    await acks.done.wait()
            except TimeoutError:
                if self._nc is not None and not self._nc.is_connected:
                    await self.close()
        missing = TransientPublishError(f"no PubAck within {self._config.ack_timeout}s")
        outcomes: list[Outcome] = []
        for index, reply in enumerate(acks.replies[: acks.expected]):
            if reply is None:
                outcomes.append(missing)
            elif reply is _DUPLICATE:
                self.duplicates += 1
                self.last_duplicates.append(index)
                outcomes.append(None)
            elif isinstance(reply, BaseException):
                outcomes.append(self._classify(reply))
            else:
                outcomes.append(None)
        return outcomes

    def _classify(self, exc: BaseException) -> PublishError:
        text = f"broker {self.name!r}: {_text(exc)}"
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PermanentPublishError(f"{text}: message larger than the server's max_payload")
        if isinstance(exc, nats.errors.BadSubjectError):
            return PermanentPublishError(f"{text}: invalid subject")
        if isinstance(exc, nats.js.errors.APIError) and exc.err_code in _PERMANENT_CODES:
            return PermanentPublishError(text)
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            return TransientPublishError(f"{text}: no stream captures this subject")
        if isinstance(exc, _NotAPubAck):  # a responder answers there: no retry makes it a stream
            return PermanentPublishError(text)
        return TransientPublishError(text)

    async def close(self) -> None:
        nc, self._nc, self._js, self._replies = self._nc, None, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()


_STORED, _DUPLICATE = "stored", "duplicate"
Reply = str | BaseException | None
"""A PubAck as read: stored, duplicate, or the error the server answered; None until it comes."""


class _BatchAcks:
    """The PubAcks of one batch, by index; done when every message sent has one."""

    def __init__(self, first: int, expected: int) -> None:
        self.first = first
        self.expected = expected
        self.replies: list[Reply] = [None] * expected
        self._received = 0
        self.done = asyncio.Event()

    def sent(self, count: int) -> None:
        """Only the first `count` messages were written: wait for no others."""
        self.expected = count
        if self._received >= count:
            self.done.set()

    def record(self, index: int, reply: Reply) -> None:
        if index < self.expected and self.replies[index] is None:
            self.replies[index] = reply
            self._received += 1
            if self._received >= self.expected:
                self.done.set()


class _Replies:
    """One reply subscription for every PubAck on a connection, tokens a counter.

    nats-py's publish_async takes a semaphore, draws a random token and makes a future
    with a callback for each message, then parses each PubAck into an object. Here a PubAck
    is matched to its message by number and read as bytes; only an error or a duplicate is
    parsed. Tokens only grow, so a late PubAck of an earlier batch is recognised and dropped.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._next = 0
        self._batch: _BatchAcks | None = None

    @classmethod
    async def subscribe(cls, nc: Client) -> _Replies:
        replies = cls(nc.new_inbox() + ".")
        await nc.subscribe(replies.prefix + "*", cb=replies._on_reply)
        return replies

    def subject(self, token: int) -> str:
        return self.prefix + str(token)

    def expect(self, count: int) -> _BatchAcks:
        self._batch = _BatchAcks(self._next, count)
        self._next += count
        return self._batch

    async def _on_reply(self, msg: Msg) -> None:
        batch = self._batch
        token = msg.subject[len(self.prefix) :]
        if batch is None or not token.isdigit():
            return
        index = int(token) - batch.first
        if index >= 0:
            batch.record(index, _read_reply(msg))


def _read_reply(msg: Msg) -> Reply:
    """A PubAck's meaning, parsing JSON only when it may hold an error or a duplicate."""
    data = msg.data
    if not data and msg.headers and msg.headers.get("Status"):
        if msg.headers["Status"] == "503":  # no stream captures the subject
            return nats.js.errors.NoStreamResponseError()
        return nats.js.errors.APIError(code=int(msg.headers["Status"]))
    if b'"error"' not in data and b'"duplicate"' not in data and b'"seq"' in data:
        return _STORED
    try:
        answer = json.loads(data)
    except ValueError as exc:
        return exc
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        try:
            nats.js.errors.APIError.from_error(error)
        except nats.js.errors.APIError as exc:
            return exc
    if not isinstance(answer, dict) or "seq" not in answer or "stream" not in answer:
        return _NotAPubAck(data)
    if answer.get("duplicate") is True:
        return _DUPLICATE
    return _STORED


class _NotAPubAck(Exception):
    """A reply without a stream and a sequence: a service answering on the subject (a
    request-reply responder), which no stream stores. Never taken for stored."""

    def __init__(self, data: bytes) -> None:
        said = excerpt(data.decode("utf-8", "replace"))
        super().__init__(f"the reply is not a PubAck (no stream stored the message): {said}")


def _unsendable(message: Message) -> str | None:
    """Why the message's subject or headers cannot go out as written; None when they can."""
    subject = message.destination
    if not VALID_SUBJECT.fullmatch(subject) or too_long(subject) or reserved(subject):
        return invalid(subject)
    # What comes from the event; the rest is the config's, checked at load.
    return altered(
        ("Nats-Msg-Id", message.id),
        ("ce-partitionkey", message.key),
        ("ce-traceparent", message.traceparent),
        ("ce-tracestate", message.tracestate),
        ("ce-dataschema", message.dataschema),
    )


# The header block's first line and its end, as nats-py writes it: `NATS/1.0\r\n...\r\n`;
# then per header its name, `: ` and `\r\n`. The names are the binding's, so that a bound
# on all of them together is known in advance.
_HEADER_BLOCK = 12
_NAMES = _HEADER_BLOCK + sum(
    len(name) + 4 for name in ("Nats-Msg-Id", "content-type", *(f"ce-{a}" for a in ATTRIBUTES))
)


def _oversized(
    message: Message, headers: dict[str, str], limit: int, header_limit: int | None
) -> str | None:
    """The server counts the body and the header block against max_payload and closes the
    connection on a message over it, while nats-py compares only the body: a message that
    fits alone but not with its headers would fail as a lost connection on every retry.
    JetStream also refuses a header block over `header_limit`, whatever max_payload says.

    A bound first (a character is at most 4 bytes in UTF-8), exact only near a limit.
    """
    bound = _NAMES + 4 * sum(map(len, headers.values()))
    headers_limit = header_limit or limit
    if len(message.body) + bound <= limit and bound <= headers_limit:
        return None
    block = _header_bytes(headers)
    if header_limit is not None and block > header_limit:
        return (
            f"message {excerpt(message.id)} has {block:,} bytes of headers, more than"
            f" JetStream takes ({header_limit:,})"
        )
    size = len(message.body) + block
    if size <= limit:
        return None
    return (
        f"message {excerpt(message.id)} is {size:,} bytes with its headers, larger than the"
        f" server's max_payload ({limit:,})"
    )


def _header_bytes(headers: dict[str, str]) -> int:
    """The header block as the server counts it: `NATS/1.0`, each `name: value`, CRLFs."""
    return _HEADER_BLOCK + sum(
        len(name) + 4 + len(value.encode()) for name, value in headers.items()
    )


def message_headers(message: Message) -> dict[str, str]:
    """JetStream's dedup id, then the CloudEvents NATS binding (binary mode).

    The id comes first: nats-server 2.9 looks a header up by the first occurrence of its
    name in the whole block, so an aggregate id holding `Nats-Msg-Id` in an earlier value
    (`ce-partitionkey`) hid the real one, and the message was stored again on every re-send.
    """
    headers = cloudevent_attributes(message, "ce-", first=("Nats-Msg-Id", message.id))
    headers["content-type"] = message.content_type
    return headers


def _text(exc: BaseException) -> str:
    return text_of(exc)
