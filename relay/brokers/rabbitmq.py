"""RabbitMQ publisher (AMQP 0-9-1, with aiormq, the protocol layer of aio-pika).

A batch goes out on one channel in publisher-confirm mode: every message is
written in order, then all of the confirms are awaited together, so a batch
costs about one round trip. `mandatory` is on by default, so a message that
no queue receives comes back as a return instead of vanishing; that is a
transient failure (the binding may be created later), retried like an outage.

The connection does not recover by itself (no robust connection): a lost
connection or channel fails the batch as transient, and the outbox's backoff
decides when to connect again. That keeps one retry policy, visible in
`status`, for every broker. aio-pika's own objects are not used: its publish
is a thin wrapper over aiormq's, and only aiormq lets the relay keep hold of
the socket, to abort a connection that went silent instead of waiting on it.

RabbitMQ has no deduplication of its own. The message id is sent as the
`message_id` property, as `cloudEvents:id` (or `ce-id`), and as
`x-deduplication-header` for the message-deduplication plugin; `duplicates`
stays 0.

CloudEvents headers come in two styles (`cloudevents_headers`): `amqp`, the
AMQP binding's `cloudEvents:` prefix (the default), or `ce`, the `ce-` prefix
that the RabbitMQ bindings of the CloudEvents SDKs read.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any

import aiormq
import aiormq.connection
import aiormq.exceptions
from pamqp.commands import Basic
from yarl import URL

from relay.brokers._batch import connect_or_fail, not_sent
from relay.config import RabbitMqBrokerConfig
from relay.core.publishing import Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError

# RabbitMQ closes the channel with PRECONDITION_FAILED when a body exceeds the
# server's `max_message_size` (128 MiB by default on 3.x, at most 512 MiB);
# rabbit_channel:check_msg_size leaves out "configured" at the 512 MiB maximum.
_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")

# Bodies over 1 MiB are sent on their own (see _segments).
_LARGE = 1024 * 1024

# AMQP short strings (exchange, routing key, message id, type) hold 255 bytes.
_SHORT_STRING = 255

_CLOSE_TIMEOUT = 5.0

# What a basic.nack means; AMQP gives it no reason. RabbitMQ nacks when a queue the
# message is routed to refuses it (x-overflow: reject-publish or reject-publish-dlx, its
# x-max-length or x-max-length-bytes reached), or cannot store it (a quorum queue
# without a majority, a crashed queue).
_NACKED = (
    "the broker refused the message (basic.nack, which carries no reason): a queue it is "
    "routed to is full and refuses publishes (x-overflow: reject-publish, its x-max-length "
    "or x-max-length-bytes reached) or cannot store it (a quorum queue without a majority); "
    "retried until the queue takes it. Look at the bound queues' messages and arguments: "
    "rabbitmqctl list_queues name messages message_bytes arguments"
)


class RabbitMqPublisher:
    def __init__(self, name: str, config: RabbitMqBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._connection: aiormq.Connection | None = None
        self._socket: Socket | None = None
        self._channel: aiormq.Channel | None = None
        self._lock = asyncio.Lock()
        # Bodies above this go alone (see _segments); lowered to the server's
        # max_message_size once it has refused a message for its size.
        self._alone_above = _LARGE
        self._probe = False  # the last batch failed
        self._prefix = config.header_prefix
        self.duplicates = 0
        self.last_duplicates: tuple[int, ...] = ()  # it cannot tell which

    async def connect(self) -> None:
        if self._usable():
            return
        await self.close()
        c = self._config
        connection, socket = await self._open()
        step = "cannot open a channel"
        async with self._closed_on_failure(connection, socket, lambda: step):
            async with asyncio.timeout(c.connect_timeout):
                channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                assert isinstance(channel, aiormq.Channel)
                for exchange in c.declare_exchanges:
                    step = f"cannot declare exchange {exchange.name!r}"
                    await channel.exchange_declare(
                        exchange.name, exchange_type=exchange.type, durable=exchange.durable
                    )
        self._connection, self._socket, self._channel = connection, socket, channel

    async def _open(self) -> tuple[aiormq.Connection, Socket]:
        return await open_connection(self.name, self._config)

    def _closed_on_failure(
        self, connection: aiormq.Connection, socket: Socket, step: Callable[[], str]
    ) -> contextlib.AbstractAsyncContextManager[None]:
        return closed_on_failure(self.name, self._config, connection, socket, step)

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: connect and log in, and find each exchange (a passive declare,
        which creates nothing); exchanges in declare_exchanges are declared at start. Nothing
        is published; what is wrong, one line each."""
        c = self._config
        connection, socket = await self._open()
        declared = {exchange.name for exchange in c.declare_exchanges}
        problems = []
        try:
            for exchange in sorted(set(destinations) - declared):
                if len(exchange.encode()) > _SHORT_STRING:
                    problems.append(
                        f"broker {self.name!r}: exchange name longer than {_SHORT_STRING}"
                        f" bytes: {exchange[:40]!r}..."
                    )
                    continue
                channel = await connection.channel()
                try:
                    await channel.exchange_declare(exchange, passive=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    problems.append(
                        f"broker {self.name!r}: exchange {exchange!r} does not exist: every"
                        " message to it would be retried for ever; declare it (or list it in"
                        " declare_exchanges)"
                    )
                else:
                    await channel.close()
        except CONNECTION_ERRORS as exc:
            raise TransientPublishError(
                f"broker {self.name!r}: {_refusal(exc, c.connect_timeout)}"
            ) from exc
        finally:
            await close_connection(connection, socket, graceful=True)
        return problems

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if not messages:
            return []
        async with self._lock:
            if failed := await connect_or_fail(self.connect, len(messages)):
                self._probe = True
                return failed
            outcomes: list[Outcome] = []
            for segment in _segments(messages, self._probe, self._alone_above):
                outcomes += await self._publish_segment(segment)
                if any(outcomes):
                    break
            self._probe = any(outcomes)
            return outcomes + not_sent(len(messages) - len(outcomes))

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
        assert channel is not None
        # Tasks start in creation order and take the channel's lock in that order,
        # so the wire order (and the delivery tags) follow the batch.
        tasks = [
            asyncio.ensure_future(
                channel.basic_publish(
                    message.body,
                    exchange=message.destination,
                    routing_key=routing_key(message),
                    properties=_properties(message, self._prefix),
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
            await self.close(graceful=False)
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
            elif task.cancelled():  # by aiormq, as its channel closed
                outcomes.append(TransientPublishError(f"broker {self.name!r}: channel closed"))
            elif (exc := task.exception()) is not None:
                outcomes.append(self._classify(exc, message))
            else:
                outcomes.append(None)
        if pending or not self._usable():
            # Confirms may still be owed on this channel: start again on a new connection;
            # a broker that stopped answering is not waited for.
            await self.close(graceful=not pending)
        nacked = [i for i, task in enumerate(tasks) if _nacked(task)]
        if nacked:
            await self._explain_nack(messages[nacked[0]], outcomes, nacked[0])
        return outcomes

    async def _explain_nack(self, message: Message, outcomes: list[Outcome], at: int) -> None:
        """Add the queue's fill level to the first nack, when the queue is known.

        A basic.nack carries no reason. Sent to the default exchange, the routing key is
        the queue's name, so a passive declare (which changes nothing) tells how many
        messages it holds; for other exchanges the relay cannot see the bindings.
        """
        if message.destination != "" or not self._usable():
            return
        queue = routing_key(message)
        held = await self._queue_length(queue)
        if held is not None:
            outcomes[at] = TransientPublishError(
                f"{outcomes[at]}; queue {queue!r} holds {held} message(s): if that is its "
                "x-max-length, it has no room until consumers take some"
            )

    async def _queue_length(self, queue: str) -> int | None:
        """The queue's message count, by a passive declare on a channel of its own."""
        assert self._connection is not None
        try:
            async with asyncio.timeout(self._config.connect_timeout):
                channel = await self._connection.channel()
                try:
                    declared = await channel.queue_declare(queue, passive=True)
                finally:
                    if not channel.is_closed:
                        await channel.close()
        except CONNECTION_ERRORS:
            return None
        count = declared.message_count
        return None if count is None else int(count)

    def dedup_scope(self, destination: str) -> str | None:
        """RabbitMQ keeps every message: its consumers drop duplicates by id, if at all."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`).
        The server's max_message_size is not known until a message goes over it."""
        refused = self._refuse(message)
        return None if refused is None else str(refused)

    def _refuse(self, message: Message) -> UnsendableError | None:
        """Why this message can never be sent (checked before anything is sent)."""
        for what, value in (
            ("exchange name", message.destination),
            ("routing key", routing_key(message)),
            ("message id", message.id),
            ("message type", message.type),
        ):
            if len(value.encode()) > _SHORT_STRING:
                return UnsendableError(
                    f"broker {self.name!r}: {what} longer than {_SHORT_STRING} bytes: "
                    f"{value[:40]!r}..."
                )
        if not message.id:
            return UnsendableError(f"broker {self.name!r}: empty message id")
        return None

    def _classify(self, exc: BaseException, message: Message) -> PublishError:
        text = f"broker {self.name!r}: {_text(exc)}"
        if isinstance(exc, aiormq.exceptions.PublishError):
            return TransientPublishError(
                f"broker {self.name!r}: returned as unroutable ({_text(exc)}): no queue is "
                f"bound to exchange {message.destination!r} for routing key "
                f"{routing_key(message)!r}"
            )
        if isinstance(exc, aiormq.exceptions.DeliveryError):
            return TransientPublishError(f"{text}: {_NACKED}")
        if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
            # The channel closed on every message in flight; the cause is the one over
            # the limit. From now on, such bodies go alone, so that a refusal takes no
            # other message's confirm down with it.
            match = _TOO_LARGE.search(_text(exc))
            if match:
                limit = int(match.group(2))
                self._alone_above = min(self._alone_above, limit)
                if len(message.body) > limit:
                    return PermanentPublishError(
                        f"broker {self.name!r}: message of {len(message.body)} bytes is larger "
                        f"than the server's max_message_size ({limit} bytes)"
                    )
        if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity):
            return TransientPublishError(f"{text} (exchange {message.destination!r} missing)")
        return TransientPublishError(text)

    def _usable(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def close(self, *, graceful: bool = True) -> None:
        connection, socket = self._connection, self._socket
        self._connection, self._socket, self._channel = None, None, None
        if connection is not None and socket is not None:
            await close_connection(connection, socket, graceful=graceful)


async def open_connection(
    name: str, config: RabbitMqBrokerConfig, purpose: str = ""
) -> tuple[aiormq.Connection, Socket]:
    """A connection, logged in within connect_timeout; closed again if that fails or is
    cancelled (for publishing, for `relay check` and for the audit alike). It shows in the
    management UI as `outbox-relay <broker>`, and `purpose` after it."""
    socket = Socket()
    connection = aiormq.Connection(
        URL(config.url.get_secret_value()),
        context=config.tls.context() if config.tls else None,
        transport_factory=socket,
        client_properties={"connection_name": f"outbox-relay {name}{purpose}"},
    )
    async with closed_on_failure(name, config, connection, socket, lambda: "cannot connect"):
        async with asyncio.timeout(config.connect_timeout):
            await connection.connect()
    return connection, socket


@contextlib.asynccontextmanager
async def closed_on_failure(
    name: str,
    config: RabbitMqBrokerConfig,
    connection: aiormq.Connection,
    socket: Socket,
    step: Callable[[], str],
) -> AsyncIterator[None]:
    """Close a connection being set up if a step fails (said as the broker's refusal at
    `step()`, the step reached) or is cancelled half-way."""
    try:
        yield
    except CONNECTION_ERRORS as exc:
        await close_connection(connection, socket, graceful=False)
        refusal = _refusal(exc, config.connect_timeout)
        raise TransientPublishError(f"broker {name!r}: {step()}: {refusal}") from exc
    except BaseException:  # cancelled half-way
        await close_connection(connection, socket, graceful=False)
        raise


class Socket(aiormq.TransportFactory):
    """Opens the connection's socket the way aiormq does, and keeps hold of it."""

    def __init__(self) -> None:
        self._writer: asyncio.StreamWriter | None = None

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        factory = (
            aiormq.connection.TLSTransportFactory()
            if url.scheme == "amqps"
            else aiormq.connection.TCPTransportFactory()
        )
        reader, self._writer = await factory.create(url, **kwargs)
        return reader, self._writer

    def abort(self) -> None:
        """Drop the socket now, with whatever is still buffered for it."""
        if self._writer is not None:
            self._writer.transport.abort()


def _segments(
    messages: Sequence[Message], probe: bool, alone_above: int
) -> list[Sequence[Message]]:
    """The batch in pieces, each sent and confirmed before the next.

    Most batches are one piece. A body over `alone_above` bytes goes alone: if the
    server refuses it for its size, it closes the channel, and the confirms of
    everything else in flight would be lost with it (sent again: duplicates). A
    piece also ends where a message id repeats, since aiormq finds the publish a
    return belongs to by its message id. With `probe` (the last batch failed), the
    head goes alone, so that a message that keeps failing does not take the whole
    batch with it each time.
    """
    segments: list[Sequence[Message]] = []
    start, ids = 0, set[str]()
    for index, message in enumerate(messages):
        alone = len(message.body) > alone_above
        if index > start and (alone or message.id in ids or (probe and index == 1)):
            segments.append(messages[start:index])
            start, ids = index, set[str]()
        ids.add(message.id)
        if alone:
            segments.append(messages[index : index + 1])
            start, ids = index + 1, set[str]()
    if start < len(messages):
        segments.append(messages[start:])
    return segments


def routing_key(message: Message) -> str:
    """The routing key the message is published with: its rule's, else its type."""
    return message.routing_key if message.routing_key is not None else message.type


def _properties(message: Message, prefix: str) -> Basic.Properties:
    """Message properties plus the CloudEvents attributes (binary mode) in headers."""
    headers: dict[str, Any] = {
        **cloudevent_attributes(message, prefix),
        "x-deduplication-header": message.id,
    }
    return Basic.Properties(
        content_type=message.content_type,
        headers=headers,
        delivery_mode=2,  # persistent
        message_id=message.id,
        timestamp=message.time,
        message_type=message.type,
        app_id="outbox-relay",
    )


async def _cancel(tasks: Collection[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def close_connection(
    connection: aiormq.Connection, socket: Socket, *, graceful: bool
) -> None:
    """Close, politely if `graceful`; abort the socket if the broker does not answer.

    aiormq waits until its buffered writes are flushed, for ever if the peer
    stopped reading, so the close runs in a task that is given a deadline.
    """
    if not graceful:
        socket.abort()
    closing = asyncio.ensure_future(connection.close())
    closing.add_done_callback(_retrieve)
    try:
        done, _ = await asyncio.wait({closing}, timeout=_CLOSE_TIMEOUT)
        if not done:
            socket.abort()
            await asyncio.wait({closing}, timeout=_CLOSE_TIMEOUT)
    except BaseException:  # cancelled: the close finishes on its own once the socket is gone
        socket.abort()
        raise
    closing.cancel()


def _nacked(task: asyncio.Future[Any]) -> bool:
    """Whether the broker nacked this publish (a return is not a nack)."""
    if not task.done() or task.cancelled():
        return False
    exc = task.exception()
    return isinstance(exc, aiormq.exceptions.DeliveryError) and not isinstance(
        exc, aiormq.exceptions.PublishError
    )


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A failed close is still a close: its exception is not worth a log line."""
    if not task.cancelled():
        task.exception()


CONNECTION_ERRORS = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    OSError,
    TimeoutError,
    RuntimeError,  # aiormq's "connection closed" on a channel being opened
)


def _refusal(exc: BaseException, timeout: float) -> str:
    """Why connecting failed, in words."""
    why = _text(exc) if str(exc) else f"no answer within {timeout:g}s"
    if isinstance(exc, aiormq.exceptions.InvalidFrameError) and "Connection.Close" in why:
        # aiormq reports the server's Connection.Close here without its reply text.
        why = "refused at Connection.Open: does the vhost exist, may this user use it?"
    return why


def _text(exc: BaseException) -> str:
    if isinstance(exc, aiormq.exceptions.DeliveryError):
        return str(exc)
    if isinstance(exc, aiormq.exceptions.AMQPError) and exc.args:
        return " ".join(str(arg) for arg in exc.args if arg is not None)
    return str(exc) or type(exc).__name__
