"""RabbitMQ publisher (AMQP 0-9-1, aio-pika).

A batch goes out on one channel in publisher-confirm mode: every message is
written in order, then all of the confirms are awaited together, so a batch
costs about one round trip. `mandatory` is on by default, so a message that
no queue receives comes back as a return instead of vanishing; that is a
transient failure (the binding may be created later), retried like an outage.

The connection does not recover by itself (no robust connection): a lost
connection or channel fails the batch as transient, and the outbox's backoff
decides when to connect again. That keeps one retry policy, visible in
`status`, for every broker.

RabbitMQ has no deduplication of its own. The message id is sent as the
`message_id` property, as `cloudEvents:id`, and as `x-deduplication-header`
for the message-deduplication plugin; `duplicates` stays 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Sequence
from typing import Any

import aio_pika
import aio_pika.abc
import aio_pika.exceptions
from pamqp.commands import Basic
from yarl import URL

from relay.config import RabbitMqBrokerConfig
from relay.errors import ConfigError, PermanentPublishError, PublishError, TransientPublishError
from relay.publishing import Message, Outcome

# RabbitMQ closes the channel with PRECONDITION_FAILED when a body exceeds the
# server's `max_message_size` (128 MiB by default up to 3.13, 16 MiB from 4.0).
_TOO_LARGE = re.compile(r"message size (\d+) is larger than configured max size (\d+)")

# AMQP short strings (exchange, routing key, message id, type) hold 255 bytes.
_SHORT_STRING = 255

_CLOSE_TIMEOUT = 5.0


class RabbitMqPublisher:
    def __init__(self, name: str, config: RabbitMqBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._url = config.url.get_secret_value()
        scheme = URL(self._url).scheme
        if scheme not in ("amqp", "amqps"):
            raise ConfigError(f"brokers.{name}.url: expected amqp:// or amqps://, got {scheme!r}")
        if config.tls is not None and scheme != "amqps":
            raise ConfigError(f"brokers.{name}.tls: needs an amqps:// url")
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: Any = None  # the aiormq channel under aio-pika's
        self._lock = asyncio.Lock()
        self.duplicates = 0

    async def connect(self) -> None:
        if self._usable():
            return
        await self.close()
        c = self._config
        connection: aio_pika.abc.AbstractConnection | None = None
        step = "cannot connect"
        try:
            async with asyncio.timeout(c.connect_timeout):
                connection = await aio_pika.connect(
                    self._url,
                    ssl_context=_tls_context(c) if c.tls else None,
                    client_properties={"connection_name": f"outbox-relay {self.name}"},
                )
                step = "cannot open a channel"
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                for exchange in c.declare_exchanges:
                    step = f"cannot declare exchange {exchange.name!r}"
                    await channel.declare_exchange(
                        exchange.name, exchange.type, durable=exchange.durable
                    )
                underlay = await channel.get_underlay_channel()
        except (*aio_pika.exceptions.CONNECTION_EXCEPTIONS, TimeoutError) as exc:
            if connection is not None:
                await _close(connection)
            raise TransientPublishError(f"broker {self.name!r}: {step}: {_text(exc)}") from exc
        self._connection, self._channel = connection, underlay

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if not messages:
            return []
        async with self._lock:
            try:
                await self.connect()
            except TransientPublishError as exc:
                self._probe = True
                return [exc] * len(messages)
            outcomes: list[Outcome] = []
            for segment in _segments(messages, probe=self._probe):
                outcomes += await self._publish_segment(segment)
                if any(outcomes):
                    break
            self._probe = any(outcomes)
            not_sent = TransientPublishError("not sent: an earlier message of the batch failed")
            return outcomes + [not_sent] * (len(messages) - len(outcomes))

    async def _publish_segment(self, messages: Sequence[Message]) -> list[Outcome]:
        """Send in order, stopping before a message that cannot be sent; await the confirms."""
        sendable, refused = messages, None
        for index, message in enumerate(messages):
            if problem := self._refuse(message):
                sendable, refused = messages[:index], problem
                break
        outcomes = await self._confirms(sendable)
        if refused is not None and not any(outcomes):
            outcomes.append(refused)
        return outcomes

    async def _confirms(self, messages: Sequence[Message]) -> list[Outcome]:
        if not messages:
            return []
        channel, mandatory = self._channel, self._config.mandatory
        # Tasks start in creation order and take the channel's lock in that order,
        # so the wire order (and the delivery tags) follow the batch.
        tasks = [
            asyncio.ensure_future(
                channel.basic_publish(
                    message.body,
                    exchange=message.destination,
                    routing_key=_routing_key(message),
                    properties=_properties(message),
                    mandatory=mandatory,
                    wait=False,
                )
            )
            for message in messages
        ]
        try:
            _, pending = await asyncio.wait(tasks, timeout=self._config.ack_timeout)
        except BaseException:  # cancelled: the channel may still owe confirms
            await _cancel(tasks)
            await self.close()
            raise
        await _cancel(pending)
        outcomes: list[Outcome] = []
        for message, task in zip(messages, tasks, strict=True):
            if task in pending:
                outcomes.append(
                    TransientPublishError(
                        f"broker {self.name!r}: no confirm within {self._config.ack_timeout:g}s"
                    )
                )
            elif (exc := task.exception()) is not None:
                outcomes.append(self._classify(exc, message))
            else:
                outcomes.append(None)
        if pending or not self._usable():
            # Confirms may still be owed on this channel: start again on a new connection.
            await self.close()
        return outcomes

    def _refuse(self, message: Message) -> PermanentPublishError | None:
        """Why AMQP cannot carry this message at all (checked before anything is sent)."""
        for what, value in (
            ("exchange name", message.destination),
            ("routing key", _routing_key(message)),
            ("message id", message.id),
            ("message type", message.type),
        ):
            if len(value.encode()) > _SHORT_STRING:
                return PermanentPublishError(
                    f"broker {self.name!r}: {what} longer than {_SHORT_STRING} bytes: "
                    f"{value[:40]!r}..."
                )
        if not message.id:
            return PermanentPublishError(f"broker {self.name!r}: empty message id")
        return None

    def _classify(self, exc: BaseException, message: Message, culprit_found: bool) -> PublishError:
        text = f"broker {self.name!r}: {_text(exc)}"
        if isinstance(exc, aio_pika.exceptions.PublishError):
            return TransientPublishError(
                f"broker {self.name!r}: returned unroutable ({_text(exc)}): no queue is bound "
                f"to exchange {message.destination!r} for routing key {_routing_key(message)!r}"
            )
        if isinstance(exc, aio_pika.exceptions.DeliveryError):
            return TransientPublishError(f"{text} (the broker could not take the message)")
        if isinstance(exc, aio_pika.exceptions.ChannelPreconditionFailed):
            # The channel closes for every message in flight; only the first one
            # over the server's limit is the cause, the others are simply retried.
            match = _TOO_LARGE.search(str(exc.args[0]) if exc.args else "")
            if match and not culprit_found and len(message.body) > int(match.group(2)):
                return PermanentPublishError(
                    f"broker {self.name!r}: message of {len(message.body)} bytes is larger than "
                    f"the server's max_message_size ({match.group(2)} bytes)"
                )
        if isinstance(exc, aio_pika.exceptions.ChannelNotFoundEntity):
            return TransientPublishError(
                f"{text} (exchange {message.destination!r} does not exist, yet)"
            )
        return TransientPublishError(text)

    def _usable(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            await _close(connection)


def _segments(messages: Sequence[Message]) -> list[Sequence[Message]]:
    """Split where a message id repeats: aiormq matches a return to its publish by id."""
    segments: list[Sequence[Message]] = []
    start, ids = 0, set()
    for index, message in enumerate(messages):
        if message.id in ids:
            segments.append(messages[start:index])
            start, ids = index, set()
        ids.add(message.id)
    segments.append(messages[start:])
    return segments


def _routing_key(message: Message) -> str:
    return message.routing_key if message.routing_key is not None else message.type


def _properties(message: Message) -> Basic.Properties:
    """Message properties plus the CloudEvents AMQP binding (binary mode) in headers."""
    headers: dict[str, Any] = {
        "cloudEvents:specversion": "1.0",
        "cloudEvents:id": message.id,
        "cloudEvents:type": message.type,
        "cloudEvents:source": message.source,
        "cloudEvents:partitionkey": message.key,
        "x-deduplication-header": message.id,
    }
    if message.time is not None:
        headers["cloudEvents:time"] = message.time.isoformat()
    return Basic.Properties(
        content_type=message.content_type,
        headers=headers,
        delivery_mode=2,  # persistent
        message_id=message.id,
        timestamp=message.time,
        message_type=message.type,
        app_id="outbox-relay",
    )


def _tls_context(config: RabbitMqBrokerConfig) -> ssl.SSLContext:
    assert config.tls is not None
    context = ssl.create_default_context(
        cafile=str(config.tls.ca_file) if config.tls.ca_file else None
    )
    if config.tls.cert_file:
        context.load_cert_chain(
            str(config.tls.cert_file), str(config.tls.key_file) if config.tls.key_file else None
        )
    return context


async def _close(connection: aio_pika.abc.AbstractConnection) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_CLOSE_TIMEOUT):
            await connection.close()


def _text(exc: BaseException) -> str:
    if isinstance(exc, aio_pika.exceptions.DeliveryError):
        return str(exc)
    if isinstance(exc, aio_pika.exceptions.AMQPError) and exc.args:
        return " ".join(str(arg) for arg in exc.args if arg is not None)
    return str(exc) or type(exc).__name__
