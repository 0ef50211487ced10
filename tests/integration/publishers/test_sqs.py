"""The SQS adapter against moto: what every publisher does (base.py), and attributes, FIFO
order through partial failures and error classes as SQS has them.

Moto validates a whole SendMessageBatch before storing anything, so it never fails one entry
of a good call. `EntryFaults` makes it do what SQS may do: store some entries of a call and
report others under `Failed`, by hooking the publisher's botocore client.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from relay.brokers._aws import CONCURRENCY
from relay.brokers.sqs import SqsPublisher
from relay.config import SqsBrokerConfig
from relay.errors import PermanentPublishError, TransientPublishError
from tests.contract.brokers import sqs as sqs_harness
from tests.contract.brokers.sqs import SqsHarness
from tests.integration.publishers import base
from tests.integration.publishers.aws import AwsKit, EntryFaults, by_group
from tests.integration.publishers.base import interleaved, message
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import (
    REGION,
    attribute,
    create_queue,
    receive_all,
    sqs_client,
    unique_queue,
)


@asynccontextmanager
async def publisher(endpoint: str, ack_timeout: float = 5.0) -> AsyncIterator[SqsPublisher]:
    config = SqsBrokerConfig(
        type="sqs", region=REGION, endpoint_url=endpoint, ack_timeout=ack_timeout
    )
    pub = SqsPublisher("sqs", config)
    try:
        yield pub
    finally:
        await pub.close()


class SqsKit(AwsKit[SqsHarness]):
    name = "sqs"
    oversized = 1024 * 1024 + 2  # the relay does not even send it
    oversize_says = "more than SQS's maximum of 1 MiB"
    invalid_destination_says = "neither a queue URL nor a queue name"
    # Deduplication: moto forgets an id once its message is deleted (SQS keeps it for 5
    # minutes), so DeduplicationTestcase sends again before it reads. `duplicates` cannot tell.
    start = staticmethod(sqs_harness.start)

    def unreachable_says(self) -> tuple[str, ...]:
        return (f"broker 'sqs': queue {self.destination!r}: ", "Could not connect")


class TestSqsPublisher(
    base.PublisherTestcase, base.DeduplicationTestcase, base.MissingDestinationTestcase
):
    Kit = SqsKit


async def test_failed_entries_alone_are_retried_and_no_group_is_reordered(
    sqs_endpoint: str,
) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = await create_queue(sqs, queue)
        await pub.connect()
        faults = EntryFaults(
            pub,
            {
                # SQS-side hiccups: retried at once, alone, before publish returns.
                "book/b@2": [("InternalError", False)],
                "book/c@4": [("RequestThrottled", True), ("ServiceUnavailable", False)],
                # A failure that stays: a@3 fails, nothing after it in its group is sent.
                "book/a@3": [("InvalidParameterValue", True)],
            },
        )
        batch = interleaved(queue, "abc", 5)  # a1 b1 c1 a2 b2 c2 a3 ... c5
        outcomes = await pub.publish(batch)
        ids = [m.id for m in batch]
        a3 = ids.index("book/a@3")
        assert outcomes[:a3] == [None] * a3
        assert isinstance(outcomes[a3], PermanentPublishError)
        assert "InvalidParameterValue" in str(outcomes[a3])
        # b@3 and c@3 went out in a3's call (one message per group each); the 4th and 5th
        # versions, including those of b and c, waited: a later call must not overtake a3.
        assert outcomes[a3 + 1 : a3 + 3] == [None, None]
        assert all(isinstance(o, TransientPublishError) for o in outcomes[a3 + 3 :])
        assert faults.sent("book/b@2") == 2 and faults.sent("book/c@4") == 0
        assert faults.sent("book/a@1") == 1 and faults.sent("book/a@3") == 1
        assert all(len(set(call)) == len(call) for call in faults.calls)

        # The core retries from a3 with the rest of the batch: only what SQS lacks is sent.
        before = len(faults.calls)
        assert await pub.publish(batch[a3:]) == [None] * len(batch[a3:])
        resent = [i for call in faults.calls[before:] for i in call]
        assert set(resent) == {ids[a3], *ids[a3 + 3 :]}
        assert faults.sent("book/c@4") == 3  # throttled, unavailable, stored
        assert len(resent) == len(set(resent)) + 2
        assert pub.duplicates == 2  # b3 and c3, which SQS already had

        received = await receive_all(sqs, url, expected=len(batch))
        assert by_group(received) == {key: [i for i in ids if f"/{key}@" in i] for key in "abc"}


async def test_a_call_rejected_for_one_message_is_split_to_find_it(sqs_endpoint: str) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = await create_queue(sqs, queue, MaximumMessageSize="1024")
        batch = [message(queue, f"k{n}", 1) for n in range(5)]
        batch[2] = message(queue, "k2", 1, body=json.dumps({"pad": "x" * 2000}).encode())
        outcomes = await pub.publish(batch)  # moto fails the whole call: InvalidParameterValue
        assert [o is None for o in outcomes] == [True, True, False, True, True]
        assert isinstance(outcomes[2], PermanentPublishError)
        assert "shorter than 1024 bytes" in str(outcomes[2])
        received = await receive_all(sqs, url, expected=4)
        assert sorted(attribute(m, "ce_id") or "" for m in received) == [
            "book/k0@1",
            "book/k1@1",
            "book/k3@1",
            "book/k4@1",
        ]


async def test_invalid_keys_and_bodies_are_permanent_long_ids_are_hashed(
    sqs_endpoint: str,
) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = await create_queue(sqs, queue)
        long_key = "tenant-" + "t" * 200
        odd_id = dataclasses.replace(message(queue, "ok", 1), id="book/é ok@1")
        batch = [
            message(queue, "bad-body", 1, body=b"\xff\xfe"),
            message(queue, "ctl-body", 1, body=b'"\x01"'),
            message(queue, long_key, 1),
            odd_id,
        ]
        outcomes = await pub.publish(batch)
        assert all(isinstance(o, PermanentPublishError) for o in outcomes[:2])
        assert "not UTF-8" in str(outcomes[0])
        assert outcomes[2:] == [None, None]
        received = {attribute(m, "ce_partitionkey"): m for m in await receive_all(sqs, url, 2)}
        group = received[long_key]["Attributes"]["MessageGroupId"]
        digest = hashlib.sha256(long_key.encode()).hexdigest()
        assert group == f"{long_key[:111]}~{digest[:16]}" and len(group) == 128
        dedup = received["ok"]["Attributes"]["MessageDeduplicationId"]
        assert dedup == "sha256:" + hashlib.sha256("book/é ok@1".encode()).hexdigest()
        assert attribute(received["ok"], "ce_id") == "book/é ok@1"


async def test_keys_sqs_refuses_as_group_ids_are_hashed_and_keep_their_order(
    sqs_endpoint: str,
) -> None:
    """`ключ0` and `bad key0` are not valid MessageGroupIds: they are hashed, not parked."""

    def sha(key: str) -> str:
        return "~sha256:" + hashlib.sha256(key.encode()).hexdigest()

    # A key that looks like a hashed one is hashed too, so it cannot share the group of
    # the key whose hash it spells.
    keys = ["ключ0", "bad key0", "", "plain", sha("ключ0")]
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = await create_queue(sqs, queue)
        batch = interleaved(queue, keys, 4)
        assert await pub.publish(batch) == [None] * len(batch)
        received = await receive_all(sqs, url, expected=len(batch))
    groups = {key: sha(key) for key in keys} | {"plain": "plain"}
    assert len(set(groups.values())) == len(keys)
    assert by_group(received) == {
        groups[key]: [m.id for m in batch if m.key == key] for key in keys
    }
    for m in received:
        assert re.fullmatch(r"[!-~]{1,128}", m["Attributes"]["MessageGroupId"])


async def test_an_id_spelling_another_ids_hash_is_hashed_too(sqs_endpoint: str) -> None:
    """`ключ` is no valid MessageDeduplicationId and goes as `sha256:<its digest>`; an event
    whose id is that very text must not share it, or the FIFO queue drops one of the two."""
    hashed = "sha256:" + hashlib.sha256("ключ".encode()).hexdigest()
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = await create_queue(sqs, queue)
        batch = [
            dataclasses.replace(message(queue, "k", 1), id="ключ"),
            dataclasses.replace(message(queue, "k", 2), id=hashed),
        ]
        assert await pub.publish(batch) == [None, None]
        received = await receive_all(sqs, url, expected=2)
    assert sorted(attribute(m, "ce_id") or "" for m in received) == sorted(["ключ", hashed])
    dedup = {m["Attributes"]["MessageDeduplicationId"] for m in received}
    assert dedup == {hashed, "sha256:" + hashlib.sha256(hashed.encode()).hexdigest()}


async def test_standard_queue_has_attributes_and_no_group(sqs_endpoint: str) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter", fifo=False)
        url = await create_queue(sqs, queue)
        await pub.connect()
        faults = EntryFaults(pub, {"book/b@2": [("InvalidAttributeValue", True)]})
        batch = interleaved(queue, "ab", 30)
        outcomes = await pub.publish(batch)
        failed = [m.id for m, o in zip(batch, outcomes, strict=True) if o is not None]
        assert failed == ["book/b@2"]  # standard queues have no order: everything else went
        # The core re-sends from b@2: the messages after it that SQS stored are not sent twice.
        assert await pub.publish(batch[3:]) == [None] * len(batch[3:])
        assert sum(len(call) for call in faults.calls) == len(batch) + 1
        received = await receive_all(sqs, url, expected=len(batch))
        assert sorted(attribute(m, "ce_id") or "" for m in received) == sorted(m.id for m in batch)
        assert all("MessageGroupId" not in m["Attributes"] for m in received)
        assert {attribute(m, "ce_type") for m in received} == {"library.book-lent.v1"}


async def test_queue_url_is_a_destination(sqs_endpoint: str) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        fifo_url = await create_queue(sqs, unique_queue("adapter"))
        standard_url = await create_queue(sqs, unique_queue("adapter", fifo=False))
        batch = [message(fifo_url, "k", 1), message(standard_url, "k", 1)]
        assert await pub.publish(batch) == [None, None]
        (fifo,) = await receive_all(sqs, fifo_url, expected=1)
        (standard,) = await receive_all(sqs, standard_url, expected=1)
        assert fifo["Attributes"]["MessageGroupId"] == "k"
        assert attribute(standard, "ce_id") == "book/k@1"


async def test_a_queue_url_that_steps_out_of_its_path_is_refused(sqs_endpoint: str) -> None:
    """`.../<account>/{aggregate_id}` with `x/../other`: SQS (moto here) reads the queue from
    the URL's path, so the message would land in `other`. Refused before sending."""
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        other = unique_queue("adapter", fifo=False)
        other_url = await create_queue(sqs, other)
        account = other_url.rstrip("/").rsplit("/", 2)[1]
        escaping = [f"{sqs_endpoint}/{account}/x/{step}/{other}" for step in ("..", "%2E%2E")]
        outcomes = await pub.publish([message(url, "k", 1) for url in escaping])
        assert all(isinstance(o, PermanentPublishError) for o in outcomes), outcomes
        assert "holds the path step '..'" in str(outcomes[0])
        assert pub.refusal(message(escaping[1], "k", 1)) is not None
        assert await pub.publish([message(other_url, "k", 2)]) == [None]
        received = await receive_all(sqs, other_url, expected=1)
        assert [attribute(m, "ce_id") for m in received] == ["book/k@2"]


async def test_missing_queue_is_transient_until_created(sqs_endpoint: str) -> None:
    async with sqs_client(sqs_endpoint) as sqs, publisher(sqs_endpoint) as pub:
        queue = unique_queue("adapter")
        url = f"{sqs_endpoint}/123456789012/{unique_queue('adapter')}"
        batch = [message(queue, "k", 1), message(url, "k", 1), message(queue, "k", 2)]
        outcomes = await pub.publish(batch)
        assert all(isinstance(o, TransientPublishError) for o in outcomes)
        assert "does not exist" in str(outcomes[0]) and "does not exist" in str(outcomes[1])
        await create_queue(sqs, queue)
        await create_queue(sqs, url.rpartition("/")[2])
        assert await pub.publish(batch) == [None, None, None]
        received = await receive_all(sqs, await _url(sqs, queue), expected=2)
        assert [attribute(m, "ce_id") for m in received] == ["book/k@1", "book/k@2"]
        assert len(await receive_all(sqs, url, expected=1)) == 1


async def _url(sqs: Any, name: str) -> str:
    response = await sqs.get_queue_url(QueueName=name)
    return str(response["QueueUrl"])


async def test_an_outage_stops_the_calls_still_waiting(sqs_endpoint: str) -> None:
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    async with sqs_client(sqs_endpoint) as sqs:
        url = await create_queue(sqs, unique_queue("adapter", fifo=False))
    with TcpProxy(host, int(port)) as proxy:
        async with publisher(f"http://{proxy.host}:{proxy.port}", ack_timeout=0.3) as pub:
            await pub.connect()
            faults = EntryFaults(pub, {})
            proxy.pause()  # a black hole: every call waits for its read timeout
            batch = [message(url, f"k{n}", 1) for n in range(40 * CONCURRENCY)]
            outcomes = await pub.publish(batch)
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            assert "Read timeout" in str(outcomes[0])
            # The calls in flight timed out; the other 3 * CONCURRENCY were never made.
            assert len(faults.calls) == CONCURRENCY
            proxy.resume()
