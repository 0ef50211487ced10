"""Reading RabbitMQ back for an audit: a stream queue, consumed by offset over AMQP 0-9-1.

An exchange keeps nothing, and a classic or quorum queue hands each message to one
consumer: only a stream queue (`x-queue-type: stream`) can be read without taking anything
away. The relay cannot see bindings, so the operator names, per exchange (the relay's
destination), the stream queue bound to it that the audit reads (`audit_streams`). Whether
it is a stream is asked of RabbitMQ before anything is consumed (`_inspect`); a classic or
quorum queue is refused (CannotReadBack).

A read consumes the stream from the audit's start time (`x-stream-offset` as an AMQP
timestamp: whole seconds, the stream's chunk for that second; `first` without one), with a
prefetch and manual acks, as every stream consumer must; acks on a stream only give credit.
Each message carries its exchange and its offset, and the id in `message_id`. RabbitMQ
tells an AMQP 0-9-1 consumer neither where a stream ends nor when it stored a message, so:

- the end is found with two probes made when the read begins: `next` (the first offset
  written after that moment: the read stops before it) and `last` (the first offset of the
  last chunk: once past it, a pause of QUIET seconds ends the read, the rest of that chunk
  having come at once);
- a message's time is unknown: `Stored.time` is None, and the horizon gives the oldest
  message's own `timestamp` property (its event's time, as the relay set it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiormq
import aiormq.abc
from pamqp.commands import Basic

from relay.brokers.rabbitmq import (
    CONNECTION_ERRORS,
    Socket,
    close_connection,
    open_connection,
)
from relay.config import RabbitMqBrokerConfig
from relay.core.publishing import STRUCTURED
from relay.core.readback import Horizon, Stored, structured_id
from relay.errors import CannotReadBack, ReadBackError, TransientPublishError

PREFETCH = 1_000  # messages delivered ahead of the acks
ACK_EVERY = 250  # deliveries acknowledged at once (a stream's acks give credit only)
QUIET = 1.0  # seconds without a delivery that end a read once past the last chunk
PROBE_WAIT = 1.0  # seconds a probe waits for a stream's last (or first) message
INSPECT_ROUNDS = 8  # declarations made to learn a queue's type and its arguments

# The arguments a stream compares when it is declared again (rabbit_stream_queue).
_STREAM_ARGUMENTS = frozenset(
    {
        "x-max-length-bytes",
        "x-max-age",
        "x-stream-max-segment-size-bytes",
        "x-initial-cluster-size",
        "x-queue-leader-locator",
    }
)
# A declaration that creates nothing: RabbitMQ checks a dead-letter exchange's type only
# when it would create the queue, and a stream never compares that argument.
_PROBE = {"x-queue-type": "stream", "x-dead-letter-exchange": 0}
_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)'")
_CURRENT = re.compile(r"current is the value '(.*)' of type '(\w+)'")
_AGE = re.compile(r"(\d+)([YMDhms])")
_AGE_UNITS = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}
_UNKNOWN_TIME = datetime(1970, 1, 1, tzinfo=UTC)

T = TypeVar("T")


@dataclass(slots=True)
class _Queue:
    """What declaring the audit's queue told: whether it exists, and its arguments."""

    exists: bool
    arguments: dict[str, Any] = field(default_factory=dict)


class RabbitMqReader:
    def __init__(self, name: str, config: RabbitMqBrokerConfig) -> None:
        if not config.audit_streams:
            raise CannotReadBack(
                f"broker {name!r} (rabbitmq) cannot be read back without a stream queue: an"
                " exchange keeps no message, and a classic or quorum queue hands each to one"
                " consumer; bind a stream queue (x-queue-type: stream) to each exchange and"
                f" name it in brokers.{name}.audit_streams (exchange: queue)"
            )
        self.name = name
        self._config = config
        self._connection: aiormq.Connection | None = None
        self._socket: Socket | None = None
        self._queues: dict[str, _Queue] = {}

    async def connect(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            return
        await self.close()
        try:
            self._connection, self._socket = await open_connection(
                self.name, self._config, " (audit)"
            )
        except TransientPublishError as exc:
            raise ReadBackError(str(exc)) from exc

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        by_queue: dict[str, set[str]] = {}
        for exchange in destinations:
            by_queue.setdefault(self._queue_of(exchange), set()).add(exchange)
        for queue, exchanges in sorted(by_queue.items()):
            if not (await self._inspect(queue, exchanges)).exists:
                continue  # the horizon says it does not exist
            async for stored in self._read_stream(queue, exchanges, since):
                yield stored

    async def horizon(self, destination: str) -> Horizon:
        queue = self._queue_of(destination)
        info = await self._inspect(queue, {destination})
        if not info.exists:
            return Horizon(None, problem=f"stream queue {queue!r} does not exist")
        max_age = _age(info.arguments.get("x-max-age"))
        size = info.arguments.get("x-max-length-bytes")
        limits = f"x-max-length-bytes {size}" if size is not None else None
        first = await self._first(queue)
        if first is None:
            return Horizon(None, max_age=max_age, limits=limits, where=f"stream {queue}")
        offset, message = first
        properties = message.header.properties
        stamp = properties.timestamp
        when = _UNKNOWN_TIME if stamp is None else _utc(stamp)
        return Horizon(
            when,
            _message_id(message),
            max_age=max_age,
            limits=limits,
            where=f"stream {queue} offset {offset}",
        )

    async def duplicate_window(self, destination: str) -> float | None:
        return None  # RabbitMQ keeps every message it is sent

    async def close(self) -> None:
        connection, socket = self._connection, self._socket
        self._connection = self._socket = None
        if connection is not None and socket is not None:
            with contextlib.suppress(Exception):
                await close_connection(connection, socket, graceful=True)

    # -- which queue -------------------------------------------------------------------------

    def _queue_of(self, exchange: str) -> str:
        queue = self._config.audit_streams.get(exchange)
        if queue is None:
            raise CannotReadBack(
                f"broker {self.name!r}: no stream queue is named for exchange {exchange!r}:"
                f" bind one (x-queue-type: stream) and add it to brokers.{self.name}"
                f".audit_streams"
            )
        return queue

    async def _inspect(self, queue: str, exchanges: Collection[str]) -> _Queue:
        """Whether the queue exists and is a stream (CannotReadBack when it is not), asked
        by declaring it as a stream in a way that cannot create it: with a dead-letter
        exchange of the wrong type, which RabbitMQ checks only when it would create the
        queue, and a stream does not compare. Each argument the stream has and the
        declaration lacks is added from RabbitMQ's answer, and the declaration made again."""
        known = self._queues.get(queue)
        if known is not None:
            return known
        arguments: dict[str, Any] = dict(_PROBE)
        for _ in range(INSPECT_ROUNDS):
            try:
                async with self._channel() as channel:
                    await self._within(
                        channel.queue_declare(queue, durable=True, arguments=arguments)
                    )
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                text = _text(exc)
                if "invalid type" in text and "x-dead-letter-exchange" in text:
                    return _Queue(exists=False)  # it would have been created; asked again later
                name = _INEQUIVALENT.search(text)
                value = _CURRENT.search(text)
                if name is None or name.group(1) not in _STREAM_ARGUMENTS or value is None:
                    raise self._not_a_stream(queue, exchanges, text) from exc
                arguments[name.group(1)] = _typed(value.group(1), value.group(2))
                continue
            except CONNECTION_ERRORS as exc:  # ACCESS_REFUSED without `configure`, say
                raise self._failed(
                    f"cannot learn whether queue {queue!r} is a stream", exc
                ) from exc
            self._queues[queue] = found = _Queue(exists=True, arguments=arguments)
            return found  # a stream, known for the reader's life
        raise ReadBackError(
            f"broker {self.name!r}: cannot tell whether queue {queue!r} is a stream:"
            f" declaring it failed {INSPECT_ROUNDS} times"
        )

    def _not_a_stream(self, queue: str, exchanges: Collection[str], text: str) -> CannotReadBack:
        names = ", ".join(repr(e) for e in sorted(exchanges))
        return CannotReadBack(
            f"broker {self.name!r}: queue {queue!r} (audit_streams of exchange {names}) is"
            " not a stream queue: it hands each message to one consumer, so reading it would"
            " take them away; bind a stream queue (x-queue-type: stream) to the exchange and"
            f" name it instead (RabbitMQ: {text})"
        )

    # -- reading -----------------------------------------------------------------------------

    async def _read_stream(
        self, queue: str, exchanges: set[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        """The stream's messages published to `exchanges` from `since`, up to the last one
        stored when the read began."""
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        async with self._channel() as probes, self._channel() as reader:
            await self._within(probes.basic_qos(prefetch_count=1), f"cannot read stream {queue!r}")
            for which in ("next", "last"):  # `next` first: it is past everything `last` sees
                await self._consume(probes, queue, which, events)
            await self._within(
                reader.basic_qos(prefetch_count=PREFETCH), f"cannot read stream {queue!r}"
            )
            start = "first" if since is None else since.astimezone(UTC).replace(microsecond=0)
            await self._consume(reader, queue, start, events, "read")
            async for message in self._until_the_end(queue, reader, events):
                exchange = _delivery(message).exchange or ""
                if exchange in exchanges:
                    yield Stored(
                        _message_id(message),
                        exchange,
                        None,  # RabbitMQ does not tell a consumer when it stored a message
                        f"stream {queue} offset {_offset(message)}",
                    )

    async def _until_the_end(
        self,
        queue: str,
        reader: aiormq.abc.AbstractChannel,
        events: asyncio.Queue[tuple[str, Any]],
    ) -> AsyncIterator[aiormq.abc.DeliveredMessage]:
        """The reading consumer's messages, up to the end as of when the read began: just
        before the `next` probe's offset, or a pause of QUIET once past the `last` probe's
        (an empty stream answers neither probe). A stream that stops short of its last
        chunk for `ack_timeout` fails the read; one the read began past (`since` after its
        last message) gives nothing."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        latest: float | None = None  # when the last message came
        after_end: int | None = None  # `next`: the first offset written after it began
        last_chunk: int | None = None  # `last`: the first offset of the last chunk then
        highest = -1  # the highest offset read
        unacked, tag = 0, 0
        while after_end is None or highest < after_end - 1:
            quiet_since = began if latest is None else latest
            if last_chunk is None:
                deadline = began + PROBE_WAIT if highest < 0 else quiet_since + QUIET
            elif highest >= last_chunk:
                deadline = quiet_since + QUIET  # the rest of the last chunk comes at once
            else:
                deadline = quiet_since + self._config.ack_timeout
            if unacked and (events.empty() or unacked >= ACK_EVERY):
                await self._ack(reader, queue, tag)  # a stream's acks give credit only
                unacked = 0
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    kind, payload = await events.get()
            except TimeoutError:
                if reader.is_closed:
                    raise ReadBackError(
                        f"broker {self.name!r}: reading stream {queue!r} stopped at offset"
                        f" {highest}: its channel closed"
                    ) from None
                if last_chunk is not None and 0 <= highest < last_chunk:
                    raise ReadBackError(
                        f"broker {self.name!r}: reading stream {queue!r} stopped at offset"
                        f" {highest}, before its last chunk (offset {last_chunk}): nothing"
                        f" came for {self._config.ack_timeout:g}s"
                    ) from None
                return
            if kind == "next":
                after_end = int(payload)
            elif kind == "last":
                last_chunk = int(payload)
            else:
                message: aiormq.abc.DeliveredMessage = payload
                offset = _offset(message)
                if after_end is not None and offset >= after_end:
                    return  # written after the read began
                latest, highest = loop.time(), max(highest, offset)
                unacked, tag = unacked + 1, _delivery(message).delivery_tag or tag
                yield message

    async def _first(self, queue: str) -> tuple[int, aiormq.abc.DeliveredMessage] | None:
        """The stream's oldest message and its offset; None when it holds none."""
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        async with self._channel() as probe:
            await self._within(probe.basic_qos(prefetch_count=1), f"cannot read stream {queue!r}")
            await self._consume(probe, queue, "first", events, "read")
            try:
                _, message = await asyncio.wait_for(events.get(), PROBE_WAIT)
            except TimeoutError:
                return None
        return _offset(message), message

    async def _consume(
        self,
        channel: aiormq.abc.AbstractChannel,
        queue: str,
        offset: str | datetime,
        events: asyncio.Queue[tuple[str, Any]],
        kind: str | None = None,
    ) -> None:
        """A consumer from `offset` whose deliveries go to `events`: the message for a read,
        the offset for a probe (`kind` None: the offset spec's name)."""
        label = kind or str(offset)

        async def deliver(message: aiormq.abc.DeliveredMessage) -> None:
            events.put_nowait((label, message if kind else _offset(message)))

        consume = channel.basic_consume(
            queue, deliver, no_ack=False, arguments={"x-stream-offset": offset}
        )
        await self._within(consume, f"cannot read stream {queue!r}")

    async def _ack(self, channel: aiormq.abc.AbstractChannel, queue: str, tag: int) -> None:
        await self._within(
            channel.basic_ack(tag, multiple=True), f"reading stream {queue!r} stopped"
        )

    async def _within(self, call: Awaitable[T], what: str | None = None) -> T:
        """An AMQP call, within ack_timeout; its failure a ReadBackError saying `what` (left
        as it is without one, for the caller to read)."""
        try:
            async with asyncio.timeout(self._config.ack_timeout):
                return await call
        except CONNECTION_ERRORS as exc:
            if what is None:
                raise
            raise self._failed(what, exc) from exc

    @contextlib.asynccontextmanager
    async def _channel(self) -> AsyncIterator[aiormq.abc.AbstractChannel]:
        """A channel of its own, closed after (its consumers go with it)."""
        if self._connection is None or self._connection.is_closed:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        try:
            async with asyncio.timeout(self._config.connect_timeout):
                channel = await self._connection.channel()
        except CONNECTION_ERRORS as exc:
            raise self._failed("cannot open a channel", exc) from exc
        try:
            yield channel
        finally:
            if not channel.is_closed:
                with contextlib.suppress(*CONNECTION_ERRORS):
                    async with asyncio.timeout(self._config.connect_timeout):
                        await channel.close()

    def _failed(self, what: str, exc: BaseException) -> ReadBackError:
        return ReadBackError(f"broker {self.name!r}: {what}: {_text(exc)}")


def _offset(message: aiormq.abc.DeliveredMessage) -> int:
    """The message's offset in the stream, which RabbitMQ adds as a header."""
    offset = (message.header.properties.headers or {}).get("x-stream-offset")
    return offset if isinstance(offset, int) else -1


def _delivery(message: aiormq.abc.DeliveredMessage) -> Basic.Deliver:
    delivery = message.delivery
    assert isinstance(delivery, Basic.Deliver)  # a consumer's, not a basic.get's
    return delivery


def _message_id(message: aiormq.abc.DeliveredMessage) -> str | None:
    """The relay's id: `message_id` (set in both CloudEvents modes); else a CloudEvents
    header, or the body's `id` in structured mode."""
    properties = message.header.properties
    if properties.message_id:
        return str(properties.message_id)
    headers = properties.headers or {}
    for name in ("cloudEvents:id", "ce-id"):
        if isinstance(value := headers.get(name), str | bytes):
            return value.decode() if isinstance(value, bytes) else value
    if properties.content_type == STRUCTURED:
        return structured_id(message.body)
    return None


def _typed(value: str, kind: str) -> Any:
    """An argument's value as RabbitMQ printed it, in a type it compares as equal."""
    if kind in ("bool",):
        return value == "true"
    if kind in ("double", "float"):
        return float(value)
    if kind in ("longstr", "shortstr"):
        return value
    return int(value)


def _age(value: Any) -> float | None:
    """Seconds of an `x-max-age` ("7D", "12h", "1Y"), None without one."""
    if not isinstance(value, str):
        return None
    match = _AGE.fullmatch(value)
    return float(int(match.group(1)) * _AGE_UNITS[match.group(2)]) if match else None


def _utc(when: datetime) -> datetime:
    return when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _text(exc: BaseException) -> str:
    if isinstance(exc, aiormq.exceptions.AMQPError) and exc.args:
        return " ".join(str(arg) for arg in exc.args if arg is not None)
    return str(exc) or type(exc).__name__
