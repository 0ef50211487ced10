"""The RabbitMQ adapter against a real server: what every publisher does (base.py), and
properties, confirms, returns and error classes as RabbitMQ has them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiormq
import pytest
from cloudevents.core.bindings import amqp, rabbitmq
from cloudevents.core.exceptions import CloudEventValidationError
from cloudevents.core.formats.json import JSONFormat

from relay.brokers import create_reader
from relay.brokers.rabbitmq import RabbitMqPublisher
from relay.config import RabbitMqBrokerConfig
from relay.core.publishing import Message, to_structured
from relay.errors import CannotReadBack, PermanentPublishError, TransientPublishError
from tests.contract.brokers.rabbitmq import RabbitMqHarness
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import TIME, TYPE
from tests.support.net import free_port
from tests.support.proxy import TcpProxy
from tests.support.rabbitmq_server import (
    SMALL_MAX_MESSAGE_SIZE,
    QueueReader,
    admin,
    bind,
    create_stream,
    create_topology,
    delete_topology,
    unique_name,
)
from tests.support.scenario import eventually


def message(exchange: str, n: int, body: bytes = b'{"n":1}', **changes: Any) -> Message:
    return base.message(exchange, f"b{n}", 1, body, position=n, **changes)


def publisher(url: str, **options: Any) -> RabbitMqPublisher:
    config = RabbitMqBrokerConfig(
        type="rabbitmq", url=url, ack_timeout=2.0, connect_timeout=1.0, **options
    )
    return RabbitMqPublisher("rabbit", config)


@pytest.fixture
async def exchange(rabbitmq_url: str) -> AsyncIterator[str]:
    """A fresh topic exchange, and a queue of the same name bound to it with `#`."""
    name = unique_name("adapter")
    await create_topology(rabbitmq_url, name, queue=name)
    try:
        yield name
    finally:
        await delete_topology(rabbitmq_url, name, name)


class AuditedHarness(RabbitMqHarness):
    """The contract's exchange and the consumers' queue bound to it, and a stream queue bound
    to it too (`<exchange>-audit`): what the audit reads back (`audit_streams`)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.stream = f"{self.exchange}-audit"

    async def prepare(self) -> None:
        await super().prepare()
        await create_stream(self.url, self.stream, self.exchange)

    async def close(self) -> None:
        await super().close()
        await delete_topology(self.url, None, self.stream)


class RabbitMqKit(base.PublisherKit[RabbitMqHarness]):
    name = "rabbit"
    options = {"ack_timeout": 2.0, "connect_timeout": 1.0}
    batches = (300, 300, 300)
    oversized = SMALL_MAX_MESSAGE_SIZE + 1
    oversize_says = "larger than the server's max_message_size (1048576 bytes)"
    invalid_destination = "x" * 256
    invalid_destination_says = "exchange name longer than 255 bytes"
    time_attribute = "cloudEvents:time"
    timed_attributes = {
        "cloudEvents:specversion": "1.0",
        "cloudEvents:id": "book/b1@1",
        "cloudEvents:type": TYPE,
        "cloudEvents:source": "/outbox-relay/loans",
        "cloudEvents:time": "2026-11-29T08:30:15.250000+00:00",
        "cloudEvents:partitionkey": "b1",
        "x-deduplication-header": "book/b1@1",
    }
    missing_destination_says = "NOT_FOUND"
    stored_times = False  # RabbitMQ does not tell an AMQP 0-9-1 consumer when it stored one
    seek_resolution = 1.0  # x-stream-offset takes an AMQP timestamp: whole seconds

    @staticmethod
    async def start(request: pytest.FixtureRequest) -> RabbitMqHarness:
        """The machine's server (the contract suite's harness is on the private node), with
        a stream queue bound to the exchange for the audit."""
        return AuditedHarness(request.getfixturevalue("rabbitmq_url"))

    def broker_config(self, **options: Any) -> Any:
        """The audit reads the harness's stream queue, unless the test names another."""
        stream = getattr(self.harness, "stream", None)
        audited = {"audit_streams": {self.destination: stream}} if stream else {}
        return super().broker_config(**{**audited, **options})

    @asynccontextmanager
    async def oversize_kit(self) -> AsyncIterator[base.PublisherKit[Any]]:
        """The machine's server takes bodies up to 128 MiB and is shared: a private node
        with a 1 MiB max_message_size refuses one for good."""
        small = RabbitMqHarness(self.request.getfixturevalue("rabbitmq_small_url"))
        async with RabbitMqKit.opened(self.request, small, prepared=True) as kit:
            yield kit

    def unreachable(self) -> dict[str, Any]:
        return {"url": f"amqp://guest:guest@127.0.0.1:{free_port()}/"}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'rabbit': cannot connect",)

    def carried(self, consumed: Consumed) -> dict[str, str]:
        return consumed.raw.headers  # type: ignore[no-any-return]

    def content_type(self, consumed: Consumed) -> str:
        return str(consumed.raw.properties.content_type)

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert consumed.raw.routing_key == TYPE  # no routing_key: the message type
        p = consumed.raw.properties
        assert p.message_id == "book/b1@1"
        assert p.message_type == TYPE
        assert p.delivery_mode == 2
        assert p.app_id == "outbox-relay"
        assert p.timestamp == datetime(2026, 11, 29, 8, 30, 15, tzinfo=UTC)  # whole seconds


class TestRabbitMqPublisher(
    base.PublisherTestcase, base.MissingDestinationTestcase, base.ReadBackTestcase
):
    Kit = RabbitMqKit


async def test_a_large_body_goes_alone_and_keeps_its_place(
    rabbitmq_url: str, exchange: str
) -> None:
    pub = publisher(rabbitmq_url)
    try:
        large = b"z" * (3 * 1024 * 1024 // 2)  # above 1 MiB: confirmed on its own
        batch = [message(exchange, n, large if n in (2, 3) else b"{}") for n in range(1, 6)]
        assert await pub.publish(batch) == [None] * 5
        received = await QueueReader(rabbitmq_url, exchange).fetch(expected=5)
        assert [r.properties.message_id for r in received] == [m.id for m in batch]
        assert [len(r.body) for r in received] == [len(m.body) for m in batch]
    finally:
        await pub.close()


async def test_routing_key_and_the_default_exchange(rabbitmq_url: str) -> None:
    queue = unique_name("adapter")
    exchange = unique_name("adapter")
    await create_topology(rabbitmq_url, exchange, queue=queue, binding="loans.eu.*")
    pub = publisher(rabbitmq_url)
    try:
        batch = [
            message(exchange, 1, routing_key="loans.eu.lent"),
            message("", 2, routing_key=queue),  # the default exchange: routed by queue name
            message(exchange, 3, time=None, routing_key="loans.eu.returned"),
        ]
        assert await pub.publish(batch) == [None, None, None]
        received = await QueueReader(rabbitmq_url, queue).fetch(expected=3)
        assert [(r.properties.message_id, r.routing_key) for r in received] == [
            ("book/b1@1", "loans.eu.lent"),
            ("book/b2@1", queue),
            ("book/b3@1", "loans.eu.returned"),
        ]
        assert received[2].properties.timestamp is None
        assert "cloudEvents:time" not in received[2].headers
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, exchange, queue)


async def test_unroutable_is_retried_not_dropped_and_delivered_once_bound(
    rabbitmq_url: str,
) -> None:
    exchange = unique_name("adapter")
    await create_topology(rabbitmq_url, exchange)  # no queue bound yet
    pub = publisher(rabbitmq_url)
    try:
        batch = [message(exchange, n) for n in range(1, 4)]
        outcomes = await pub.publish(batch)
        assert all(isinstance(o, TransientPublishError) for o in outcomes)
        assert "returned as unroutable" in str(outcomes[0])
        assert "NO_ROUTE" in str(outcomes[0])
        # The relay retries the same messages; once a queue is bound they get through.
        await bind(rabbitmq_url, exchange, exchange)
        assert await pub.publish(batch) == [None, None, None]
        received = await QueueReader(rabbitmq_url, exchange).fetch(expected=3, timeout=2)
        assert [r.properties.message_id for r in received] == [m.id for m in batch]
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, exchange, exchange)


async def test_mandatory_off_drops_unroutable_messages(rabbitmq_url: str) -> None:
    exchange = unique_name("adapter")
    await create_topology(rabbitmq_url, exchange)
    pub = publisher(rabbitmq_url, mandatory=False)
    try:
        assert await pub.publish([message(exchange, 1)]) == [None]
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, exchange)


async def test_a_return_is_matched_to_its_own_message_when_ids_repeat(
    rabbitmq_url: str, exchange: str
) -> None:
    """aiormq matches a return to its publish by message id; a repeated id must not hide it."""
    pub = publisher(rabbitmq_url)
    try:
        unroutable = message("", 1)  # the default exchange, and no queue of that name
        twin = message(exchange, 1)
        outcomes = await pub.publish([message(exchange, 0), unroutable, twin])
        assert outcomes[0] is None
        assert isinstance(outcomes[1], TransientPublishError)
        assert "unroutable" in str(outcomes[1])
    finally:
        await pub.close()


async def test_confirms_are_awaited_and_a_nack_is_transient(rabbitmq_url: str) -> None:
    """A queue that refuses what overflows it nacks: the publisher must wait for that answer."""
    exchange, queue = unique_name("adapter"), unique_name("adapter")
    await create_topology(rabbitmq_url, exchange)
    async with admin(rabbitmq_url) as channel:
        await channel.queue_declare(
            queue, durable=True, arguments={"x-max-length": 2, "x-overflow": "reject-publish"}
        )
        await channel.queue_bind(queue, exchange, routing_key="#")
    pub = publisher(rabbitmq_url)
    try:
        outcomes = await pub.publish([message(exchange, n) for n in range(1, 5)])
        assert outcomes[:2] == [None, None]
        assert all(isinstance(o, TransientPublishError) for o in outcomes[2:])
        assert "Basic.Nack" in str(outcomes[2])
        assert "x-overflow: reject-publish" in str(outcomes[2])
        assert "holds" not in str(outcomes[2]), "the exchange's bindings are not known"
        # Acknowledged means stored: both are in the queue the moment publish returns.
        received = await QueueReader(rabbitmq_url, queue).fetch(expected=0, timeout=0)
        assert [r.properties.message_id for r in received] == ["book/b1@1", "book/b2@1"]
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, exchange, queue)


async def test_a_nack_from_a_full_queue_says_how_full_the_queue_is(rabbitmq_url: str) -> None:
    """Sent through the default exchange, the routing key names the queue that nacked."""
    queue = unique_name("adapter")
    async with admin(rabbitmq_url) as channel:
        await channel.queue_declare(
            queue, durable=True, arguments={"x-max-length": 3, "x-overflow": "reject-publish"}
        )
    pub = publisher(rabbitmq_url)
    try:
        batch = [message("", n, routing_key=queue) for n in range(1, 6)]
        outcomes = await pub.publish(batch)
        assert outcomes[:3] == [None] * 3
        full = str(outcomes[3])
        assert isinstance(outcomes[3], TransientPublishError)
        assert "refused the message (basic.nack, which carries no reason)" in full
        assert "x-max-length" in full
        assert f"queue {queue!r} holds 3 message(s)" in full
        # The passive declare left the publisher's channel usable: the queue drains, the
        # retry goes through.
        await QueueReader(rabbitmq_url, queue).fetch(expected=3)
        assert await pub.publish(batch[3:]) == [None, None]
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, None, queue)


async def test_declares_exchanges_at_connect(rabbitmq_url: str) -> None:
    name = unique_name("adapter")
    pub = publisher(rabbitmq_url, declare_exchanges=[{"name": name, "type": "direct"}])
    try:
        await pub.connect()
        async with admin(rabbitmq_url) as channel:
            await channel.exchange_declare(name, exchange_type="direct", passive=True)
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, name)


async def test_declaring_an_exchange_of_another_type_is_transient(
    rabbitmq_url: str, exchange: str
) -> None:
    pub = publisher(rabbitmq_url, declare_exchanges=[{"name": exchange, "type": "fanout"}])
    try:
        (outcome,) = await pub.publish([message(exchange, 1)])
        assert isinstance(outcome, TransientPublishError)
        assert f"cannot declare exchange {exchange!r}" in str(outcome)
        assert "PRECONDITION_FAILED" in str(outcome)
    finally:
        await pub.close()


async def test_what_amqp_cannot_carry_is_permanent_and_stops_the_rest(
    rabbitmq_url: str, exchange: str
) -> None:
    pub = publisher(rabbitmq_url)
    try:
        batch = [
            message(exchange, 1),
            message(exchange, 2, routing_key="k" * 256),
            message(exchange, 3),
        ]
        outcomes = await pub.publish(batch)
        assert outcomes[0] is None
        assert isinstance(outcomes[1], PermanentPublishError)
        assert "routing key longer than 255 bytes" in str(outcomes[1])
        assert isinstance(outcomes[2], TransientPublishError)
        (outcome,) = await pub.publish([message(exchange, 4, id="é" * 128)])
        assert isinstance(outcome, PermanentPublishError)
        assert "message id longer than 255 bytes" in str(outcome)
    finally:
        await pub.close()


@pytest.mark.parametrize(
    ("url_of", "said"),
    [
        (lambda url: url.replace("guest:guest", "guest:wrong"), "cannot connect"),
        (
            lambda url: url.rstrip("/") + "/" + unique_name("no-such-vhost"),
            "does the vhost exist",
        ),
    ],
    ids=["wrong-credentials", "missing-vhost"],
)
async def test_a_refused_log_in_is_transient_and_says_why(
    rabbitmq_url: str, url_of: Callable[[str], str], said: str
) -> None:
    pub = publisher(url_of(rabbitmq_url))
    try:
        (outcome,) = await pub.publish([message("x", 1)])
        assert isinstance(outcome, TransientPublishError)
        assert said in str(outcome)
    finally:
        await pub.close()


async def test_silent_broker_times_out_and_a_new_connection_is_made(
    rabbitmq_url: str, exchange: str
) -> None:
    server = urlsplit(rabbitmq_url)
    with TcpProxy(server.hostname or "127.0.0.1", server.port or 5672) as proxy:
        pub = publisher(f"amqp://guest:guest@127.0.0.1:{proxy.port}/")
        try:
            assert await pub.publish([message(exchange, 1)]) == [None]
            proxy.pause()  # a black hole: the connection stays open, nothing comes back
            started = time.monotonic()
            outcomes = await pub.publish([message(exchange, n, b"y" * 65536) for n in range(50)])
            assert time.monotonic() - started < 4
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            assert "no confirm within 2s" in str(outcomes[0])
            (outcome,) = await pub.publish([message(exchange, 2)])  # cannot reconnect either
            assert "cannot connect: no answer within 1s" in str(outcome)
            proxy.resume()
            assert await pub.publish([message(exchange, 3)]) == [None]
            proxy.cut()  # the connection drops: transient (unless noticed first), then reconnect
            (outcome,) = await pub.publish([message(exchange, 4)])
            if outcome is not None:
                assert isinstance(outcome, TransientPublishError)
                assert await pub.publish([message(exchange, 4)]) == [None]
        finally:
            started = time.monotonic()
            await pub.close()
            assert time.monotonic() - started < 6
    ids = [r.properties.message_id for r in await QueueReader(rabbitmq_url, exchange).fetch()]
    assert ids[0] == "book/b1@1" and ids[-2:] == ["book/b3@1", "book/b4@1"]


@pytest.mark.parametrize("style", ["amqp", "ce"])
async def test_header_style_is_the_one_the_consumers_binding_reads(
    rabbitmq_url: str, exchange: str, style: str
) -> None:
    """`amqp` is read by the SDK's AMQP binding, `ce` by its RabbitMQ binding; each binding
    misses the other style's attributes, so the style must match the consumers."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = message(
        exchange,
        1,
        dataschema="https://schemas.example.com/book-lent.json",
        traceparent=traceparent,
        tracestate="congo=t61rcWkgMzE",
    )
    structured = message(exchange, 2, traceparent=traceparent)
    to_structured(structured)
    pub = publisher(rabbitmq_url, cloudevents_headers=style)
    try:
        assert await pub.publish([sent, structured]) == [None, None]
        received = await QueueReader(rabbitmq_url, exchange).fetch(expected=2)
    finally:
        await pub.close()
    binary_in, structured_in = received
    prefix = "cloudEvents:" if style == "amqp" else "ce-"
    assert binary_in.headers[prefix + "id"] == "book/b1@1"
    assert binary_in.headers["x-deduplication-header"] == "book/b1@1"
    assert not any(name.startswith(("ce-", "cloudEvents:")) for name in structured_in.headers)

    def with_amqp(r: Any) -> Any:
        raw = amqp.AMQPMessage({"content-type": r.properties.content_type}, r.headers, r.body)
        return amqp.from_amqp(raw, JSONFormat())

    def with_rabbitmq(r: Any) -> Any:
        raw = rabbitmq.RabbitMQMessage(r.headers, r.properties.content_type, r.body)
        return rabbitmq.from_rabbitmq(raw, JSONFormat())

    right, wrong = (with_amqp, with_rabbitmq) if style == "amqp" else (with_rabbitmq, with_amqp)
    event = right(binary_in)
    assert (event.get_id(), event.get_type()) == ("book/b1@1", TYPE)
    assert event.get_source() == "/outbox-relay/loans"
    assert event.get_time() == sent.time
    assert event.get_dataschema() == "https://schemas.example.com/book-lent.json"
    assert event.get_extension("traceparent") == traceparent
    assert event.get_extension("tracestate") == "congo=t61rcWkgMzE"
    assert event.get_data() == {"n": 1}
    with pytest.raises(CloudEventValidationError, match="source"):
        wrong(binary_in)
    for read in (with_amqp, with_rabbitmq):  # structured mode needs no header at all
        event = read(structured_in)
        assert event.get_id() == "book/b2@1"
        assert event.get_extension("traceparent") == traceparent
        assert event.get_data() == {"n": 1}


# -- the audit's reader ----------------------------------------------------------------------


@asynccontextmanager
async def reader(url: str, streams: dict[str, str]) -> AsyncIterator[Any]:
    config = RabbitMqBrokerConfig(type="rabbitmq", url=url, audit_streams=streams)
    audit = create_reader("rabbit", config)
    try:
        await audit.connect()
        yield audit
    finally:
        await audit.close()


@pytest.mark.parametrize("kind", ["classic", "quorum"])
async def test_a_queue_that_is_not_a_stream_is_refused_and_nothing_is_taken(
    rabbitmq_url: str, kind: str
) -> None:
    name = unique_name("adapter")
    async with admin(rabbitmq_url) as channel:
        await channel.exchange_declare(name, exchange_type="topic", durable=True)
        arguments: dict[str, Any] = (
            {"x-queue-type": "quorum"} if kind == "quorum" else {"x-max-length": 100}
        )
        await channel.queue_declare(name, durable=True, arguments=arguments)
        await channel.queue_bind(name, name, routing_key="#")
    pub = publisher(rabbitmq_url)
    try:
        assert await pub.publish([message(name, n) for n in range(3)]) == [None] * 3
        async with reader(rabbitmq_url, {name: name}) as audit:
            with pytest.raises(CannotReadBack) as read:
                await base.read_back(audit, name, None)
            with pytest.raises(CannotReadBack):
                await audit.horizon(name)
        says = str(read.value)
        assert f"queue {name!r}" in says and "reading it would take them away" in says
        assert "not a stream queue" in says
        received = await QueueReader(rabbitmq_url, name).fetch(expected=3)
        assert len(received) == 3 and not any(r.redelivered for r in received)  # untouched
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, name, name)


async def test_without_a_stream_named_for_the_exchange_the_audit_is_refused(
    rabbitmq_url: str,
) -> None:
    config = RabbitMqBrokerConfig(type="rabbitmq", url=rabbitmq_url)
    with pytest.raises(CannotReadBack, match=r"brokers\.rabbit\.audit_streams"):
        create_reader("rabbit", config)
    async with reader(rabbitmq_url, {"library": "library-audit"}) as audit:
        with pytest.raises(CannotReadBack, match="no stream queue is named for exchange 'other'"):
            await base.read_back(audit, "other", None)


async def test_a_missing_stream_queue_reads_empty_and_is_not_created(rabbitmq_url: str) -> None:
    missing = unique_name("missing")
    async with reader(rabbitmq_url, {"": missing}) as audit:
        assert await base.read_back(audit, "", None) == []
        horizon = await audit.horizon("")
    assert horizon.problem == f"stream queue {missing!r} does not exist"
    async with admin(rabbitmq_url) as channel:
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
            await channel.queue_declare(missing, passive=True)


async def test_a_stream_with_retention_arguments_is_read_and_they_make_its_horizon(
    rabbitmq_url: str, exchange: str
) -> None:
    stream = unique_name("audit")
    async with admin(rabbitmq_url) as channel:
        retention: dict[str, Any] = {
            "x-queue-type": "stream",
            "x-max-age": "7D",
            "x-max-length-bytes": 10**9,
        }
        await channel.queue_declare(stream, durable=True, arguments=retention)
        await channel.queue_bind(stream, exchange, routing_key="#")
    pub = publisher(rabbitmq_url)
    try:
        sent = [message(exchange, n) for n in range(4)]
        assert await pub.publish(sent) == [None] * 4
        async with reader(rabbitmq_url, {exchange: stream}) as audit:
            got = await base.read_back(audit, exchange, None)
            horizon = await audit.horizon(exchange)
        assert [g.id for g in got] == [m.id for m in sent]
        assert horizon.max_age == 7 * 86400 and horizon.limits == "x-max-length-bytes 1000000000"
        assert horizon.first_id == sent[0].id and horizon.where == f"stream {stream} offset 0"
        assert horizon.first == TIME.replace(microsecond=0)  # its own timestamp property
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, None, stream)


async def test_a_stream_two_exchanges_feed_is_read_once_each_its_own(
    rabbitmq_url: str, exchange: str
) -> None:
    """A stream bound to an exchange, and reached through the default exchange by its
    name: each message keeps the exchange it was published to."""
    stream = unique_name("audit")
    await create_stream(rabbitmq_url, stream, exchange)
    pub = publisher(rabbitmq_url)
    try:
        through = [message(exchange, n) for n in range(3)]
        direct = [message("", n, routing_key=stream, id=f"direct/{n}") for n in range(3)]
        assert await pub.publish([*through, *direct]) == [None] * 6
        async with reader(rabbitmq_url, {exchange: stream, "": stream}) as audit:
            both = [s async for s in audit.read([exchange, ""], None)]
            only = await base.read_back(audit, "", None)
        assert [(s.id, s.destination) for s in both] == [
            *((m.id, exchange) for m in through),
            *((m.id, "") for m in direct),
        ]
        assert [s.id for s in only] == [m.id for m in direct]
        assert [s.where for s in only] == [f"stream {stream} offset {n}" for n in (3, 4, 5)]
    finally:
        await pub.close()
        await delete_topology(rabbitmq_url, None, stream)


async def test_a_read_ends_while_messages_keep_coming(rabbitmq_url: str, exchange: str) -> None:
    """The relay goes on publishing during an audit: the read ends at the stream's end as of
    when it began (the `next` probe), with everything published before."""
    stream = unique_name("audit")
    await create_stream(rabbitmq_url, stream, exchange)
    pub = publisher(rabbitmq_url)
    stop = asyncio.Event()
    published: list[str] = []

    async def keep_publishing() -> None:
        while not stop.is_set():
            sent = message(exchange, 1000 + len(published))
            assert await pub.publish([sent]) == [None]
            published.append(sent.id)
            await asyncio.sleep(0.01)

    before = [message(exchange, n) for n in range(3000)]  # a read of a few tenths of a second
    try:
        for start in range(0, len(before), 500):
            assert await pub.publish(before[start : start + 500]) == [None] * 500
        busy = asyncio.create_task(keep_publishing())
        await eventually(lambda: len(published) >= 3)
        async with reader(rabbitmq_url, {exchange: stream}) as audit:
            began = len(published)
            got = await asyncio.wait_for(base.read_back(audit, exchange, None), timeout=30)
        ended = len(published)
        await eventually(lambda: len(published) > ended)  # it went on publishing
        stop.set()
        await busy
        ids = [g.id for g in got]
        during = ids[len(before) :]
        assert ids[: len(before)] == [m.id for m in before]
        assert during == published[: len(during)]  # in order, nothing skipped
        # Everything stored when it began, not all that was published while it read.
        assert began <= len(during) < ended
    finally:
        stop.set()
        await pub.close()
        await delete_topology(rabbitmq_url, None, stream)


def test_audit_streams_name_queues_amqp_can_carry() -> None:
    def config(streams: dict[str, str]) -> RabbitMqBrokerConfig:
        url = "amqp://127.0.0.1:1/"
        return RabbitMqBrokerConfig(type="rabbitmq", url=url, audit_streams=streams)

    assert config({"": "loans-audit", "x": "q"}).audit_streams == {"": "loans-audit", "x": "q"}
    for wrong, says in (({"x": ""}, "at least 1 character"), ({"x": "é" * 128}, "255 bytes")):
        with pytest.raises(ValueError, match=says):
            config(wrong)
