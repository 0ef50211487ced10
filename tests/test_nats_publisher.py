"""The NATS JetStream adapter against a real server: headers, acks, dedup, error classes."""

from __future__ import annotations

from datetime import UTC, datetime

from relay.brokers.nats import NatsPublisher
from relay.config import NatsBrokerConfig
from relay.errors import PermanentPublishError, TransientPublishError
from relay.publishing import Message
from tests.support.jetstream import connect, create_stream, delete_stream, fetch_all, unique_name
from tests.support.net import free_port


def message(subject: str, n: int, body: bytes = b'{"n":1}') -> Message:
    return Message(
        id=f"book/b{n}@1",
        type="library.book-lent.v1",
        destination=subject,
        key=f"b{n}",
        body=body,
        source="/outbox-relay/loans",
        time=datetime(2026, 11, 29, tzinfo=UTC),
        position=n,
    )


def publisher(url: str) -> NatsPublisher:
    return NatsPublisher("nats", NatsBrokerConfig(type="nats", servers=[url], ack_timeout=2.0))


async def test_publishes_in_order_with_cloudevents_headers(nats_url: str) -> None:
    stream = unique_name("adapter")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    pub = publisher(nats_url)
    try:
        batch = [message(f"{stream}.loans", n) for n in range(1, 301)]
        assert await pub.publish(batch) == [None] * 300
        received = await fetch_all(nats_url, stream, expected=300)
        assert [m.headers["Nats-Msg-Id"] for m in received] == [m.id for m in batch]
        first = received[0].headers
        assert first["ce-id"] == "book/b1@1"
        assert first["ce-type"] == "library.book-lent.v1"
        assert first["ce-source"] == "/outbox-relay/loans"
        assert first["ce-specversion"] == "1.0"
        assert first["ce-time"] == "2026-11-29T00:00:00+00:00"
        assert first["content-type"] == "application/json"
        assert received[0].data == b'{"n":1}'
        # The same ids again: acknowledged as duplicates, stored once.
        assert await pub.publish(batch[:10]) == [None] * 10
        assert pub.duplicates == 10
        assert len(await fetch_all(nats_url, stream)) == 300
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


async def test_oversized_message_is_permanent_and_stops_the_rest(nats_url: str) -> None:
    stream = unique_name("adapter")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    pub = publisher(nats_url)
    try:
        huge = b"x" * (2 * 1024 * 1024)
        batch = [
            message(f"{stream}.a", 1),
            message(f"{stream}.a", 2, huge),
            message(f"{stream}.a", 3),
        ]
        outcomes = await pub.publish(batch)
        assert outcomes[0] is None
        assert isinstance(outcomes[1], PermanentPublishError)
        assert isinstance(outcomes[2], TransientPublishError)  # never sent ahead of #2
        received = await fetch_all(nats_url, stream, expected=1)
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


async def test_no_stream_is_transient(nats_url: str) -> None:
    pub = publisher(nats_url)
    try:
        (outcome,) = await pub.publish([message(unique_name("nowhere"), 1)])
        assert isinstance(outcome, TransientPublishError)
        assert "no stream" in str(outcome)
    finally:
        await pub.close()


async def test_unreachable_server_is_transient_and_names_the_broker() -> None:
    pub = publisher(f"nats://127.0.0.1:{free_port()}")
    try:
        outcomes = await pub.publish([message("x.y", 1), message("x.y", 2)])
        assert all(isinstance(o, TransientPublishError) for o in outcomes)
        assert "broker 'nats': cannot connect" in str(outcomes[0])
    finally:
        await pub.close()


async def test_stream_is_created_from_the_config(nats_url: str) -> None:
    name = unique_name("provisioned")
    config = NatsBrokerConfig(
        type="nats",
        servers=[nats_url],
        stream={"name": name, "subjects": [f"{name}.>"], "duplicate_window": 30},
    )
    pub = NatsPublisher("nats", config)
    try:
        assert await pub.publish([message(f"{name}.loans", 1)]) == [None]
        received = await fetch_all(nats_url, name, expected=1)
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
        await pub.close()
        # An existing stream is verified and reused, not recreated (its message stays).
        assert await pub.publish([message(f"{name}.loans", 2)]) == [None]
        assert len(await fetch_all(nats_url, name, expected=2)) == 2
    finally:
        await pub.close()
        await delete_stream(nats_url, name)


async def test_core_nats_publishes_without_acknowledgements(nats_url: str) -> None:
    subject = unique_name("core")
    pub = NatsPublisher("nats", NatsBrokerConfig(type="nats", servers=[nats_url], jetstream=False))
    async with connect(nats_url) as nc:
        sub = await nc.subscribe(f"{subject}.>")
        await nc.flush()
        try:
            batch = [message(f"{subject}.loans", n) for n in range(1, 6)]
            assert await pub.publish(batch) == [None] * 5
            got = [await sub.next_msg(timeout=5) for _ in range(5)]
            assert [m.headers["ce-id"] for m in got if m.headers] == [m.id for m in batch]
        finally:
            await sub.unsubscribe()
            await pub.close()
