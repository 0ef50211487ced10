"""The Pub/Sub adapter against the emulator: what every publisher does (base.py), and what
is Pub/Sub's own: ordering keys through failures (a failed key is resumed, never left
paused), no publisher-side deduplication, the limits the emulator does not enforce, the
client's batch settings, and the emulator itself going away mid-drain.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from relay.brokers import create_reader
from relay.brokers.pubsub import MAX_MESSAGE_BYTES, PubSubPublisher
from relay.config import PubSubBrokerConfig
from relay.core.publishing import Message
from relay.errors import CannotReadBack, PermanentPublishError, TransientPublishError
from tests.contract.brokers.pubsub import PubSubHarness
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import interleaved, message
from tests.support.net import free_port
from tests.support.pubsub_server import (
    AUDIT_SUBSCRIPTION,
    PROJECT,
    PubSubEmulator,
    admin,
    create_audit_subscription,
    create_topic,
    delete_subscription,
    delete_topic,
    pull_all_async,
    unique_name,
)
from tests.support.scenario import eventually


class AuditedHarness(PubSubHarness):
    """The contract's topic and the consumers' subscription, and the audit's own:
    `<topic>-audit`, ordered, keeping what it acknowledges."""

    def __init__(self, emulator: str) -> None:
        super().__init__(emulator)
        self.audit = AUDIT_SUBSCRIPTION.format(topic=self.topic)

    async def prepare(self) -> None:
        await super().prepare()
        await asyncio.to_thread(create_audit_subscription, self.emulator, self.topic, self.audit)

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(delete_subscription, self.emulator, self.audit)


class PubSubKit(base.PublisherKit[PubSubHarness]):
    name = "pubsub"
    options = {"ack_timeout": 5.0, "connect_timeout": 5.0}
    total_order = False  # per ordering key
    oversized = MAX_MESSAGE_BYTES + 1  # the relay does not even send it
    oversize_says = "more than Pub/Sub's maximum of 10,000,000"
    invalid_destination = "no spaces allowed"
    invalid_destination_says = "is not a topic id nor a topic's full name"
    time_attribute = "ce-time"
    timed_attributes = {
        "ce-specversion": "1.0",
        "ce-id": "book/b1@1",
        "ce-type": "library.book-lent.v1",
        "ce-source": "/outbox-relay/loans",
        "ce-time": "2026-11-29T08:30:15.250000+00:00",
        "ce-partitionkey": "b1",
        "content-type": "application/json",
    }
    missing_destination_says = "the topic does not exist"

    @staticmethod
    async def start(request: pytest.FixtureRequest) -> PubSubHarness:
        """The contract's harness, with the audit's subscription (ReadBackTestcase)."""
        return AuditedHarness(request.getfixturevalue("pubsub_emulator"))

    def broker_config(self, **options: Any) -> Any:
        return super().broker_config(**{"audit_subscription": AUDIT_SUBSCRIPTION, **options})

    def unreachable(self) -> dict[str, Any]:
        return {"emulator_host": f"127.0.0.1:{free_port()}", "connect_timeout": 1.0}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'pubsub': cannot connect", "within 1.0s")

    def carried(self, consumed: Consumed) -> dict[str, str]:
        return dict(consumed.raw.attributes)

    def content_type(self, consumed: Consumed) -> str:
        return str(consumed.raw.attributes.get("content-type", ""))

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert json.loads(bytes(consumed.raw.data)) == {"book": "b1", "v": 1}
        assert consumed.raw.ordering_key == "b1"


class TestPubSubPublisher(
    base.PublisherTestcase, base.MissingDestinationTestcase, base.ReadBackTestcase
):
    Kit = PubSubKit


# -- the adapter's own ---------------------------------------------------------------------


@asynccontextmanager
async def topic(emulator: str) -> AsyncIterator[tuple[str, str]]:
    """(topic, subscription): a fresh topic with an ordered subscription, deleted after."""
    names = unique_name("adapter"), unique_name("reader")
    await asyncio.to_thread(create_topic, emulator, *names)
    try:
        yield names
    finally:
        await asyncio.to_thread(delete_topic, emulator, *names)


@asynccontextmanager
async def publisher(emulator: str, **options: Any) -> AsyncIterator[PubSubPublisher]:
    config = PubSubBrokerConfig(
        type="pubsub", project=PROJECT, emulator_host=emulator, **{"ack_timeout": 5.0, **options}
    )
    pub = PubSubPublisher("pubsub", config)
    try:
        yield pub
    finally:
        await pub.close()


async def read(emulator: str, subscription: str, expected: int) -> list[Any]:
    return [m.message for m in await pull_all_async(emulator, subscription, expected)]


def first_deliveries_by_key(received: Iterable[Any]) -> dict[str, list[str]]:
    """Each key's ids in delivery order, a re-delivered id counted once (at least once)."""
    seen: set[str] = set()
    keys: dict[str, list[str]] = defaultdict(list)
    for m in received:
        message_id = m.attributes["ce-id"]
        if message_id not in seen:
            seen.add(message_id)
            keys[m.attributes["ce-partitionkey"]].append(message_id)
    return dict(keys)


def by_key(sent: Iterable[Message]) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = defaultdict(list)
    for m in sent:
        keys[m.key].append(m.id)
    return dict(keys)


async def test_a_message_sent_again_is_stored_again_with_the_same_id(
    pubsub_emulator: str,
) -> None:
    """Pub/Sub has no publisher-side deduplication: consumers deduplicate on `ce-id`."""
    async with topic(pubsub_emulator) as (name, subscription), publisher(pubsub_emulator) as pub:
        batch = interleaved(name, "ab", 3)
        assert await pub.publish(batch) == [None] * 6
        assert await pub.publish(batch[:2]) == [None, None]  # the outbox re-sends them
        assert pub.duplicates == 0  # Pub/Sub cannot tell
        received = await read(pubsub_emulator, subscription, expected=8)
    ids = [m.attributes["ce-id"] for m in received]
    assert sorted(ids) == sorted([m.id for m in batch] + [m.id for m in batch[:2]])
    assert first_deliveries_by_key(received) == by_key(batch)


async def test_a_failed_key_is_resumed_and_what_pubsub_stored_is_not_sent_again(
    pubsub_emulator: str,
) -> None:
    """A batch over two topics, one missing: its keys fail (the client pauses them), the
    other topic's are stored. Once the topic exists, the outbox's re-send publishes the
    failed keys in order (they were resumed) and not what was already stored."""
    async with topic(pubsub_emulator) as (present, present_sub):
        missing, missing_sub = unique_name("adapter"), unique_name("reader")
        batch = [
            m
            for v in range(1, 4)
            for m in (message(missing, "late", v), message(present, "early", v))
        ]
        try:
            async with publisher(pubsub_emulator) as pub:
                outcomes = await pub.publish(batch)
                failed = [i for i, o in enumerate(outcomes) if o is not None]
                assert failed == [0, 2, 4]  # every message of the missing topic's key
                assert all(isinstance(outcomes[i], TransientPublishError) for i in failed)
                assert "the topic does not exist" in str(outcomes[0])
                await asyncio.to_thread(create_topic, pubsub_emulator, missing, missing_sub)
                # What the outbox does: the batch again from its first failure.
                assert await pub.publish(batch) == [None] * 6
                assert pub.duplicates == 3  # the early ones, stored the first time
            stored = await read(pubsub_emulator, present_sub, expected=3)
            late = await read(pubsub_emulator, missing_sub, expected=3)
        finally:
            await asyncio.to_thread(delete_topic, pubsub_emulator, missing, missing_sub)
    early_ids = [m.id for m in batch if m.key == "early"]
    assert [m.attributes["ce-id"] for m in stored] == early_ids  # once each, in order
    assert [m.attributes["ce-id"] for m in late] == [m.id for m in batch if m.key == "late"]
    assert {m.ordering_key for m in late} == {"late"}


async def test_an_outage_mid_batch_loses_nothing_and_keeps_each_keys_order(
    pubsub_emulator: str, tcp_proxy: Any
) -> None:
    """The emulator black-holed while a batch is in flight: the batch times out, its keys'
    calls end later (failed, pausing the keys); the retries after the outage resume them
    and every key's first deliveries are in order."""
    host, port = pubsub_emulator.split(":")
    proxy = tcp_proxy(host, int(port))
    async with (
        topic(pubsub_emulator) as (name, subscription),
        publisher(f"127.0.0.1:{proxy.port}", ack_timeout=1.0) as pub,
    ):
        batch = interleaved(name, [f"k{n}" for n in range(8)], 25)
        assert await pub.publish(batch[:40]) == [None] * 40
        proxy.pause()
        outcomes = await pub.publish(batch[40:])
        assert outcomes and all(isinstance(o, TransientPublishError) for o in outcomes)
        assert str(outcomes[0]).startswith(f"broker 'pubsub': topic 'projects/{PROJECT}/")
        proxy.cut()
        proxy.resume()
        rest = batch[40:]

        async def delivered() -> bool:  # the outbox's loop: from the first failure, again
            nonlocal rest
            outcomes = await pub.publish(rest)
            first = next((i for i, o in enumerate(outcomes) if o is not None), len(rest))
            rest = rest[first:]
            return not rest

        await eventually(delivered, timeout=30)
        received = await read(pubsub_emulator, subscription, expected=len(batch))
    assert first_deliveries_by_key(received) == by_key(batch)


async def test_the_emulator_going_away_mid_drain_is_transient_and_publishing_resumes(
    tmp_path: Path,
) -> None:
    """A private emulator killed mid-drain and started again on its port (empty: the
    emulator keeps nothing); the publisher keeps its client, the channel reconnects."""
    server = PubSubEmulator(tmp_path / "emulator.log").start()
    try:
        names = unique_name("adapter"), unique_name("reader")
        await asyncio.to_thread(create_topic, server.host, *names)
        async with publisher(server.host, ack_timeout=2.0) as pub:
            batch = interleaved(names[0], "abc", 20)
            assert await pub.publish(batch[:30]) == [None] * 30
            server.kill()
            outcomes = await pub.publish(batch[30:])
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            assert str(outcomes[0]).startswith("broker 'pubsub': topic ")
            server = PubSubEmulator(tmp_path / "emulator.log", server.port).start()
            await asyncio.to_thread(create_topic, server.host, *names)

            async def delivered() -> bool:
                return await pub.publish(batch[30:]) == [None] * 30

            await eventually(delivered, timeout=30)
            received = await read(server.host, names[1], expected=30)
        assert first_deliveries_by_key(received) == by_key(batch[30:])
    finally:
        server.kill()


async def test_attribute_limits_are_checked_before_sending(pubsub_emulator: str) -> None:
    """The emulator stores what Pub/Sub refuses (values over 1 KiB, say); the relay refuses
    it first, for good, naming the attribute, and sends nothing after it."""
    async with topic(pubsub_emulator) as (name, subscription), publisher(pubsub_emulator) as pub:
        long_id = replace(message(name, "a", 1), id="book/" + "i" * 1100)
        long_key = replace(message(name, "b", 1), key="k" * 1025)
        for refused, says in (
            (long_id, "attribute ce-id is 1,105 bytes"),
            (long_key, "ce-partitionkey"),
        ):
            outcomes = await pub.publish([message(name, "ok", 1), refused, message(name, "ok", 2)])
            assert outcomes[0] is None
            assert isinstance(outcomes[1], PermanentPublishError)
            assert says in str(outcomes[1]) and "at most 1,024 bytes" in str(outcomes[1])
            assert isinstance(outcomes[2], TransientPublishError)  # never ahead of it
            assert await pub.publish([message(name, "ok", 2)]) == [None]
            received = await read(pubsub_emulator, subscription, expected=2)
            assert [m.attributes["ce-id"] for m in received] == ["book/ok@1", "book/ok@2"]


async def test_every_attribute_and_the_largest_message_arrive(pubsub_emulator: str) -> None:
    """Ten attributes (Pub/Sub takes 100), and a message just under 10 MB in all."""
    async with topic(pubsub_emulator) as (name, subscription), publisher(pubsub_emulator) as pub:
        full = message(
            name,
            "a",
            1,
            dataschema="https://schemas.example.com/book-lent.json",
            traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            tracestate="congo=t61rcWkgMzE",
        )
        big = message(name, "a", 2, body=b"x" * (MAX_MESSAGE_BYTES - 1000))
        assert await pub.publish([full, big]) == [None, None]
        first, second = await read(pubsub_emulator, subscription, expected=2)
    assert len(first.attributes) == 10
    assert first.attributes["ce-tracestate"] == "congo=t61rcWkgMzE"
    assert len(second.data) == MAX_MESSAGE_BYTES - 1000


@pytest.mark.parametrize(
    ("settings", "keys", "versions"),
    [
        ({"max_messages": 1000}, 3, 800),  # 2,400 messages: calls of up to 1,000
        ({"max_messages": 1}, 4, 25),  # one call per message
        ({"max_bytes": 1024}, 2, 100),  # about 4 messages per call
    ],
)
async def test_batch_settings_keep_each_keys_order(
    pubsub_emulator: str, settings: dict[str, int], keys: int, versions: int
) -> None:
    async with (
        topic(pubsub_emulator) as (name, subscription),
        publisher(pubsub_emulator, **settings) as pub,
    ):
        batch = interleaved(name, [f"k{n}" for n in range(keys)], versions)
        assert await pub.publish(batch) == [None] * len(batch)
        received = await read(pubsub_emulator, subscription, expected=len(batch))
    assert len(received) == len(batch)
    assert first_deliveries_by_key(received) == by_key(batch)


async def test_an_empty_key_keeps_its_order_under_a_hashed_ordering_key(
    pubsub_emulator: str,
) -> None:
    """Pub/Sub reads an empty ordering key as "no order"; the relay hashes it, and a key
    that looks like a hash is hashed too, so no two keys share an ordering key."""
    hashed_shape = "~sha256:" + "0" * 64
    async with topic(pubsub_emulator) as (name, subscription), publisher(pubsub_emulator) as pub:
        batch = interleaved(name, ["", hashed_shape], 5)
        assert await pub.publish(batch) == [None] * 10
        received = await read(pubsub_emulator, subscription, expected=10)
    assert first_deliveries_by_key(received) == by_key(batch)
    ordering = {m.attributes["ce-partitionkey"]: m.ordering_key for m in received}
    assert ordering == {
        "": "~sha256:" + hashlib.sha256(b"").hexdigest(),
        hashed_shape: "~sha256:" + hashlib.sha256(hashed_shape.encode()).hexdigest(),
    }


async def test_a_topics_full_name_works_as_a_destination(pubsub_emulator: str) -> None:
    async with topic(pubsub_emulator) as (name, subscription), publisher(pubsub_emulator) as pub:
        full = f"projects/{PROJECT}/topics/{name}"
        assert await pub.publish([message(full, "a", 1)]) == [None]
        (received,) = await read(pubsub_emulator, subscription, expected=1)
    assert received.attributes["ce-id"] == "book/a@1"


async def test_a_key_file_means_tls_and_a_plaintext_server_is_not_trusted(
    pubsub_emulator: str, tmp_path: Path
) -> None:
    """The path without `emulator_host`: credentials from a service account key file, a TLS
    channel to `endpoint`. The emulator speaks plaintext, so no handshake completes: the
    publisher says it cannot connect (transient), and the key's secret is in no error."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    key_file = tmp_path / "key.json"
    key_file.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": PROJECT,
                "private_key_id": "0123456789abcdef",
                "private_key": pem,
                "client_email": f"relay@{PROJECT}.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": "https://oauth2.googleapis.com/token",
            }
        )
    )
    config = PubSubBrokerConfig(
        type="pubsub",
        project=PROJECT,
        endpoint=pubsub_emulator,
        credentials_file=str(key_file),
        connect_timeout=1.0,
    )
    pub = PubSubPublisher("pubsub", config)
    try:
        (outcome,) = await pub.publish([message("loans", "a", 1)])
    finally:
        await pub.close()
    assert isinstance(outcome, TransientPublishError)
    assert str(outcome) == f"broker 'pubsub': cannot connect to {pubsub_emulator} within 1.0s"
    assert pem.splitlines()[1] not in str(outcome)


# -- the audit's reader ----------------------------------------------------------------------


@asynccontextmanager
async def reader(emulator: str, template: str | None = AUDIT_SUBSCRIPTION) -> AsyncIterator[Any]:
    config = PubSubBrokerConfig(
        type="pubsub", project=PROJECT, emulator_host=emulator, audit_subscription=template
    )
    audit = create_reader("pubsub", config)
    try:
        await audit.connect()
        yield audit
    finally:
        await audit.close()


def snapshots(emulator: str) -> list[str]:
    with admin(emulator) as (_, subscriber):
        return [s.name for s in subscriber.list_snapshots(project=f"projects/{PROJECT}")]


async def test_without_an_audit_subscription_the_audit_is_refused(pubsub_emulator: str) -> None:
    config = PubSubBrokerConfig(type="pubsub", project=PROJECT, emulator_host=pubsub_emulator)
    with pytest.raises(CannotReadBack, match=r"brokers\.pubsub\.audit_subscription"):
        create_reader("pubsub", config)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (None, "does not exist: create it on topic"),
        ({"retain_acked_messages": False}, "set retain_acked_messages on it"),
        ({"filter": 'attributes.ce-type = "x"'}, "does not receive every message"),
    ],
)
async def test_an_audit_subscription_that_would_miss_messages_is_refused(
    pubsub_emulator: str, settings: dict[str, Any] | None, says: str
) -> None:
    async with topic(pubsub_emulator) as (name, _):
        audit_name = AUDIT_SUBSCRIPTION.format(topic=name)
        if settings is not None:
            await asyncio.to_thread(
                create_audit_subscription, pubsub_emulator, name, audit_name, **settings
            )
        try:
            async with reader(pubsub_emulator) as audit:
                with pytest.raises(CannotReadBack) as read:
                    await base.read_back(audit, name, None)
                with pytest.raises(CannotReadBack):
                    await audit.horizon(name)
        finally:
            await asyncio.to_thread(delete_subscription, pubsub_emulator, audit_name)
    assert f"subscription 'projects/{PROJECT}/subscriptions/{audit_name}'" in str(read.value)
    assert says in str(read.value)


async def test_without_seek_to_a_time_a_read_leaves_the_subscription_as_it_found_it(
    pubsub_emulator: str,
) -> None:
    """The emulator does not implement Seek to a time (501). The reader then snapshots the
    audit's subscription, reads and acknowledges it, and seeks back to the snapshot: read
    after read, it holds every message, and no snapshot is left behind."""
    async with topic(pubsub_emulator) as (name, _), publisher(pubsub_emulator) as pub:
        audit_name = AUDIT_SUBSCRIPTION.format(topic=name)
        await asyncio.to_thread(create_audit_subscription, pubsub_emulator, name, audit_name)
        try:
            sent = interleaved(name, "ab", 4)
            assert await pub.publish(sent) == [None] * len(sent)
            async with reader(pubsub_emulator) as audit:
                for _ in range(3):
                    got = await base.read_back(audit, name, None)
                    assert sorted(g.id or "" for g in got) == sorted(m.id for m in sent)
            assert not [s for s in await asyncio.to_thread(snapshots, pubsub_emulator) if name in s]
            left = await read(pubsub_emulator, audit_name, expected=len(sent))
            assert len(left) == len(sent)  # still unacknowledged, each once
        finally:
            await asyncio.to_thread(delete_subscription, pubsub_emulator, audit_name)


async def test_a_structured_message_is_read_back_by_the_id_in_its_body(
    pubsub_emulator: str,
) -> None:
    from relay.core.publishing import to_structured

    async with topic(pubsub_emulator) as (name, _), publisher(pubsub_emulator) as pub:
        audit_name = AUDIT_SUBSCRIPTION.format(topic=name)
        await asyncio.to_thread(create_audit_subscription, pubsub_emulator, name, audit_name)
        try:
            sent = interleaved(name, "s", 3)
            for m in sent:
                to_structured(m)
            assert await pub.publish(sent) == [None] * 3
            async with reader(pubsub_emulator) as audit:
                got = await base.read_back(audit, name, None)
            assert [g.id for g in got] == [m.id for m in sent]
            assert all(g.where.startswith(f"subscription {audit_name} message ") for g in got)
        finally:
            await asyncio.to_thread(delete_subscription, pubsub_emulator, audit_name)


def test_the_audit_subscription_template_names_a_subscription() -> None:
    def config(template: str) -> PubSubBrokerConfig:
        return PubSubBrokerConfig(
            type="pubsub", project=PROJECT, emulator_host="127.0.0.1:1", audit_subscription=template
        )

    assert config("{topic}-audit").audit_subscription == "{topic}-audit"
    assert config("projects/other/subscriptions/{topic}.audit").audit_subscription
    for wrong, says in (("{name}-audit", "{name} is not known"), ("a b", "must make a")):
        with pytest.raises(ValueError, match=says):
            config(wrong)
