"""The SNS adapter against moto: what every publisher does (base.py), and what SNS has of its
own: FIFO topics' groups and deduplication, order through partial failures, its limits (256
KiB per message and per call, 10 entries a call, 10 attributes), topic names and ARNs.

Every message is read as a consumer would: from an SQS queue subscribed to the topic with
RawMessageDelivery (a FIFO queue for a FIFO topic). Moto fails no single entry of a good
PublishBatch call, so `EntryFaults` makes it do what SNS may do, by hooking the publisher's
botocore client, as tests/integration/publishers/test_sqs.py does for SQS.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from relay.brokers._aws import CONCURRENCY
from relay.brokers.sns import MAX_MESSAGE_BYTES, SnsPublisher
from relay.config import SnsBrokerConfig
from relay.core.publishing import Message
from relay.errors import PermanentPublishError, TransientPublishError
from tests.contract.brokers import sns as sns_harness
from tests.contract.brokers.sns import SnsHarness
from tests.integration.publishers import base
from tests.integration.publishers.aws import AwsKit, EntryFaults, by_group
from tests.integration.publishers.base import interleaved, message
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import REGION, attribute, receive_all


@asynccontextmanager
async def publisher(endpoint: str, ack_timeout: float = 5.0) -> AsyncIterator[SnsPublisher]:
    config = SnsBrokerConfig(
        type="sns", region=REGION, endpoint_url=endpoint, ack_timeout=ack_timeout
    )
    pub = SnsPublisher("sns", config)
    try:
        yield pub
    finally:
        await pub.close()


@asynccontextmanager
async def topic(endpoint: str, fifo: bool = True) -> AsyncIterator[SnsHarness]:
    """A topic with its subscribed queue, on moto directly (no proxy in the way)."""
    harness = SnsHarness(endpoint, fifo)
    try:
        await harness.prepare()
        yield harness
    finally:
        await harness.close()


class SnsKit(AwsKit[SnsHarness]):
    name = "sns"
    oversized = MAX_MESSAGE_BYTES + 1  # the relay does not even send it
    oversize_says = "more than SNS's maximum of 256 KiB"
    invalid_destination_says = "neither a topic ARN nor a topic name"
    start = staticmethod(sns_harness.start)

    def unreachable_says(self) -> tuple[str, ...]:
        return (f"broker 'sns': topic {self.harness.topic!r}: ", "Could not connect")


class TestSnsPublisher(
    base.PublisherTestcase, base.DeduplicationTestcase, base.MissingDestinationTestcase
):
    Kit = SnsKit


async def test_failed_entries_alone_are_retried_and_no_group_is_reordered(
    sqs_endpoint: str,
) -> None:
    async with topic(sqs_endpoint) as t, publisher(sqs_endpoint) as pub:
        await pub.connect()
        faults = EntryFaults(
            pub,
            {
                # SNS-side hiccups: retried at once, alone, before publish returns.
                "book/b@2": [("InternalError", False)],
                "book/c@4": [("Throttled", True), ("KMSThrottling", True)],
                # A failure that stays: a@3 fails, nothing after it in its group is sent.
                "book/a@3": [("InvalidParameter", True)],
            },
        )
        batch = interleaved(t.topic_arn, "abc", 5)  # a1 b1 c1 a2 b2 c2 a3 ... c5
        outcomes = await pub.publish(batch)
        ids = [m.id for m in batch]
        a3 = ids.index("book/a@3")
        assert outcomes[:a3] == [None] * a3
        assert isinstance(outcomes[a3], PermanentPublishError)
        assert "InvalidParameter" in str(outcomes[a3]) and t.topic in str(outcomes[a3])
        assert outcomes[a3 + 1 : a3 + 3] == [None, None]  # b3, c3: in a3's layer
        assert all(isinstance(o, TransientPublishError) for o in outcomes[a3 + 3 :])
        assert faults.sent("book/b@2") == 2 and faults.sent("book/c@4") == 0
        assert all(len(set(call)) == len(call) for call in faults.calls)  # one per group

        # The core retries from a3 with the rest of the batch: only what SNS lacks is sent.
        before = len(faults.calls)
        assert await pub.publish(batch[a3:]) == [None] * len(batch[a3:])
        resent = [i for call in faults.calls[before:] for i in call]
        assert set(resent) == {ids[a3], *ids[a3 + 3 :]}
        assert faults.sent("book/c@4") == 3  # throttled twice, then published
        assert pub.duplicates == 2  # b3 and c3, which SNS already had

        received = await receive_all(t.sqs, t.queue_url, expected=len(batch))
        assert by_group(received) == {key: [i for i in ids if f"/{key}@" in i] for key in "abc"}


async def test_a_fifo_topic_drops_an_id_it_has_seen_even_from_a_new_publisher(
    sqs_endpoint: str,
) -> None:
    """What a restart between publish and checkpoint does: a publisher with no memory sends
    the batch again, and the MessageDeduplicationId (the message id) drops it."""
    async with topic(sqs_endpoint) as t:
        batch = interleaved(t.topic_arn, "ab", 3)
        for _ in range(2):
            async with publisher(sqs_endpoint) as pub:
                assert await pub.publish(batch) == [None] * len(batch)
        received = await receive_all(t.sqs, t.queue_url, expected=len(batch))
        assert sorted(attribute(m, "ce_id") or "" for m in received) == sorted(m.id for m in batch)


async def test_calls_carry_10_entries_and_256_kib_at_most(sqs_endpoint: str) -> None:
    async with topic(sqs_endpoint, fifo=False) as t, publisher(sqs_endpoint) as pub:
        await pub.connect()
        faults = EntryFaults(pub, {})
        small = [message(t.topic_arn, f"k{n}", 1) for n in range(25)]
        assert await pub.publish(small) == [None] * 25
        assert sorted(len(call) for call in faults.calls) == [5, 10, 10]
        big = [message(t.topic_arn, f"b{n}", 1, body=b"x" * 100_000) for n in range(5)]
        faults.calls.clear()
        faults.sizes.clear()
        assert await pub.publish(big) == [None] * 5
        assert sorted(len(call) for call in faults.calls) == [1, 2, 2]
        assert all(size <= 256 * 1024 for size in faults.sizes)
        received = await receive_all(t.sqs, t.queue_url, expected=30)
        assert len(received) == 30


async def test_a_message_of_exactly_256_kib_goes_one_byte_more_is_parked(
    sqs_endpoint: str,
) -> None:
    async with topic(sqs_endpoint) as t, publisher(sqs_endpoint) as pub:
        await pub.connect()
        faults = EntryFaults(pub, {})
        probe = message(t.topic_arn, "k", 1, body=b"x")
        attributes_size = _attributes_size(probe)
        fits = replace(probe, body=b"x" * (MAX_MESSAGE_BYTES - attributes_size))
        over = message(t.topic_arn, "k", 2, body=b"x" * (MAX_MESSAGE_BYTES - attributes_size + 1))
        outcomes = await pub.publish([fits, over])
        assert outcomes[0] is None
        assert isinstance(outcomes[1], PermanentPublishError)
        assert f"{MAX_MESSAGE_BYTES + 1} bytes" in str(outcomes[1])
        assert "book/k@2" in str(outcomes[1])
        assert faults.sizes == [MAX_MESSAGE_BYTES]
        (received,) = await receive_all(t.sqs, t.queue_url, expected=1)
        assert len(received["Body"]) == len(fits.body)


def _attributes_size(sent: Message) -> int:
    from relay.brokers._aws import message_attributes

    return sum(
        len(name) + len("String") + len(value["StringValue"].encode())
        for name, value in message_attributes(sent).items()
    )


async def test_a_message_with_every_attribute_arrives_with_ten(sqs_endpoint: str) -> None:
    async with topic(sqs_endpoint) as t, publisher(sqs_endpoint) as pub:
        full = message(
            t.topic_arn,
            "k",
            1,
            dataschema="https://schemas.example/book-lent.json",
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            tracestate="vendor=1",
        )
        assert await pub.publish([full]) == [None]
        (received,) = await receive_all(t.sqs, t.queue_url, expected=1)
        assert len(received["MessageAttributes"]) == 10
        assert attribute(received, "ce_traceparent") == full.traceparent


async def test_a_topic_name_is_a_destination_as_is_its_arn(sqs_endpoint: str) -> None:
    async with topic(sqs_endpoint) as fifo, topic(sqs_endpoint, fifo=False) as standard:
        async with publisher(sqs_endpoint) as pub:
            batch = [message(fifo.topic, "k", 1), message(standard.topic, "k", 1)]
            assert await pub.publish(batch) == [None, None]
        (first,) = await receive_all(fifo.sqs, fifo.queue_url, expected=1)
        (second,) = await receive_all(standard.sqs, standard.queue_url, expected=1)
        assert first["Attributes"]["MessageGroupId"] == "k"
        assert attribute(second, "ce_id") == "book/k@1"
        assert "MessageGroupId" not in second["Attributes"]


async def test_a_standard_topic_gets_no_duplicates_after_a_partial_failure(
    sqs_endpoint: str,
) -> None:
    async with topic(sqs_endpoint, fifo=False) as t, publisher(sqs_endpoint) as pub:
        await pub.connect()
        faults = EntryFaults(pub, {"book/b@2": [("InvalidParameter", True)]})
        batch = interleaved(t.topic_arn, "ab", 15)
        outcomes = await pub.publish(batch)
        failed = [m.id for m, o in zip(batch, outcomes, strict=True) if o is not None]
        assert failed == ["book/b@2"]  # standard topics have no order: everything else went
        assert await pub.publish(batch[3:]) == [None] * len(batch[3:])
        assert sum(len(call) for call in faults.calls) == len(batch) + 1
        received = await receive_all(t.sqs, t.queue_url, expected=len(batch))
        assert sorted(attribute(m, "ce_id") or "" for m in received) == sorted(m.id for m in batch)


async def test_an_outage_stops_the_calls_still_waiting(sqs_endpoint: str) -> None:
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    async with topic(sqs_endpoint, fifo=False) as t:
        with TcpProxy(host, int(port)) as proxy:
            async with publisher(f"http://{proxy.host}:{proxy.port}", ack_timeout=0.3) as pub:
                await pub.connect()
                faults = EntryFaults(pub, {})
                proxy.pause()  # a black hole: every call waits for its read timeout
                batch = [message(t.topic_arn, f"k{n}", 1) for n in range(40 * CONCURRENCY)]
                outcomes = await pub.publish(batch)
                assert all(isinstance(o, TransientPublishError) for o in outcomes)
                assert "Read timeout" in str(outcomes[0])
                assert len(faults.calls) == CONCURRENCY  # the rest were never made
            proxy.cut()
            proxy.resume()
            async with publisher(f"http://{proxy.host}:{proxy.port}") as pub:
                assert await pub.publish(batch) == [None] * len(batch)  # once it is back
        received = await receive_all(t.sqs, t.queue_url, expected=len(batch))
        assert len({attribute(m, "ce_id") for m in received}) == len(batch)
