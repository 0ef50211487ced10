"""The Kinesis adapter against moto: what every publisher does (base.py), and what Kinesis
has of its own: order per key through records that fail part-way through a call, no
deduplication, its limits (1 MiB per record, 500 records and 5 MiB per call), partition keys,
stream names and ARNs.

Every record is read as a consumer would: GetRecords on every shard from TRIM_HORIZON. Moto
has no throughput limit and never fails one record of a good call, so the failures come from
`KinesisFaults` (tests/support/kinesis_faults.py), an HTTP proxy in front of moto that fails
chosen records of PutRecords calls with ProvisionedThroughputExceededException, as Kinesis
answers: the relay's real HTTP client gets a real partial-failure answer.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest

from relay.brokers import create_reader
from relay.brokers.kinesis import (
    MAX_RECORD_BYTES,
    KinesisPublisher,
    partition_key,
    record_data,
)
from relay.config import KinesisBrokerConfig
from relay.core.publishing import Message
from relay.errors import PermanentPublishError, ReadBackError, TransientPublishError
from tests.contract.brokers import kinesis as kinesis_harness
from tests.contract.brokers.kinesis import KinesisHarness, consumed
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import interleaved, message
from tests.support.kinesis_faults import THROTTLED, KinesisFaults
from tests.support.net import free_port
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import REGION


@asynccontextmanager
async def publisher(
    endpoint: str, ack_timeout: float = 5.0, connect_timeout: float = 5.0
) -> AsyncIterator[KinesisPublisher]:
    config = KinesisBrokerConfig(
        type="kinesis",
        region=REGION,
        endpoint_url=endpoint,
        ack_timeout=ack_timeout,
        connect_timeout=connect_timeout,
    )
    pub = KinesisPublisher("kinesis", config)
    try:
        yield pub
    finally:
        await pub.close()


@asynccontextmanager
async def stream(endpoint: str, shards: int = 2) -> AsyncIterator[KinesisHarness]:
    """A stream and its reader, on moto directly (no proxy in the way)."""
    harness = KinesisHarness(endpoint, shards)
    try:
        await harness.prepare()
        yield harness
    finally:
        await harness.close()


def by_key(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = defaultdict(list)
    for record in records:
        keys[record["PartitionKey"]].append(json.loads(record["Data"])["id"])
    return dict(keys)


class KinesisKit(base.PublisherKit[KinesisHarness]):
    name = "kinesis"
    options = {"ack_timeout": 5.0, "connect_timeout": 5.0}
    batches = (50,)
    total_order = False  # per key: its shard
    oversized = MAX_RECORD_BYTES  # with the event around it, more than 1 MiB: not even sent
    oversize_keys = ("k", "k", "k")  # what is held back is the rest of the key
    oversize_says = "more than Kinesis's maximum of 1 MiB per record"
    invalid_destination = "no spaces allowed"
    invalid_destination_says = "neither a stream ARN nor a stream name"
    connect_reaches_the_broker = False  # the client is made without a request
    time_attribute = "time"
    timed_attributes = {
        "specversion": "1.0",
        "id": "book/b1@1",
        "type": "library.book-lent.v1",
        "source": "/outbox-relay/loans",
        "time": "2026-11-29T08:30:15.250000+00:00",
        "partitionkey": "b1",
        "datacontenttype": "application/json",
    }
    missing_destination_says = "does not exist"
    start = staticmethod(kinesis_harness.start)

    def unreachable(self) -> dict[str, Any]:
        return {"endpoint_url": f"http://127.0.0.1:{free_port()}"}

    def unreachable_says(self) -> tuple[str, ...]:
        return (f"broker 'kinesis': stream {self.destination!r}: ", "Could not connect")

    def carried(self, consumed: Consumed) -> dict[str, str]:
        event = json.loads(consumed.raw["Data"])
        return {name: value for name, value in event.items() if name != "data"}

    def content_type(self, consumed: Consumed) -> str:
        return str(json.loads(consumed.raw["Data"])["datacontenttype"])

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert consumed.raw["PartitionKey"] == "b1"
        assert json.loads(consumed.raw["Data"])["data"] == {"book": "b1", "v": 1}


class TestKinesisPublisher(
    base.PublisherTestcase, base.MissingDestinationTestcase, base.ReadBackTestcase
):
    Kit = KinesisKit  # no DeduplicationTestcase: Kinesis has no deduplication


async def test_a_record_failing_mid_call_is_never_overtaken_by_its_key(
    sqs_endpoint: str,
) -> None:
    """Kinesis fails records one by one; a later record of the key must not land first."""
    async with (
        stream(sqs_endpoint, shards=1) as s,
        KinesisFaults(sqs_endpoint) as faults,
        publisher(faults.url) as pub,
    ):
        faults.plan = {
            "book/b@2": [THROTTLED],  # once: sent again at once, before publish returns
            "book/c@4": [THROTTLED, "InternalFailure"],  # twice: the third try lands
            "book/a@3": [THROTTLED] * 3,  # every try of this publish: its key stops
        }
        batch = interleaved(s.stream, "abc", 5)  # a1 b1 c1 a2 b2 c2 a3 ... c5
        ids = [m.id for m in batch]
        outcomes = await pub.publish(batch)
        a3 = ids.index("book/a@3")
        failed = {ids[i]: o for i, o in enumerate(outcomes) if o is not None}
        assert set(failed) == {"book/a@3", "book/a@4", "book/a@5"}  # b and c went on
        assert all(isinstance(o, TransientPublishError) for o in failed.values())
        assert THROTTLED in str(failed["book/a@3"]) and s.stream in str(failed["book/a@3"])
        assert "not sent" in str(failed["book/a@4"])
        assert faults.sent("book/a@4") == 0 and faults.sent("book/a@3") == 3
        assert faults.sent("book/b@2") == 2 and faults.sent("book/c@4") == 3
        for call in faults.calls:  # one record per key per call
            keys = [i.partition("@")[0] for i in call]
            assert len(keys) == len(set(keys)), call

        # The core re-sends from a3 with the rest of the batch: only what Kinesis lacks goes.
        before = len(faults.calls)
        assert await pub.publish(batch[a3:]) == [None] * len(batch[a3:])
        resent = [i for call in faults.calls[before:] for i in call]
        assert sorted(resent) == ["book/a@3", "book/a@4", "book/a@5"]
        assert pub.duplicates == len(batch[a3:]) - 3

        records = await s.records(expected=len(batch))
        assert len(records) == len(batch)  # nothing twice
        assert by_key(records) == {k: [i for i in ids if f"/{k}@" in i] for k in "abc"}


async def test_a_record_sent_again_is_stored_again_with_the_same_id(sqs_endpoint: str) -> None:
    """Kinesis has no deduplication: a restart between publish and checkpoint (a publisher
    with no memory) stores the batch twice, and consumers drop the second by its id."""
    async with stream(sqs_endpoint) as s:
        batch = interleaved(s.stream, "ab", 3)
        for _ in range(2):
            async with publisher(sqs_endpoint) as pub:
                assert await pub.publish(batch) == [None] * len(batch)
        records = await s.records(expected=len(batch))
        ids = [json.loads(r["Data"])["id"] for r in records]
        assert sorted(ids) == sorted([m.id for m in batch] * 2)
        first_seen = list(dict.fromkeys(ids))  # what a consumer deduplicating on id keeps
        keys = by_key(records)
        assert {k: list(dict.fromkeys(v)) for k, v in keys.items()} == {
            k: [m.id for m in batch if m.key == k] for k in "ab"
        }
        assert len(first_seen) == len(batch)


async def test_calls_carry_500_records_and_5_mib_at_most(sqs_endpoint: str) -> None:
    async with (
        stream(sqs_endpoint) as s,
        KinesisFaults(sqs_endpoint) as faults,
        publisher(faults.url) as pub,
    ):
        many = [message(s.stream, f"k{n}", 1) for n in range(1_001)]
        assert await pub.publish(many) == [None] * len(many)
        assert sorted(len(call) for call in faults.calls) == [1, 500, 500]
        faults.calls.clear()
        big = [message(s.stream, f"b{n}", 1, body=b'"' + b"x" * 900_000 + b'"') for n in range(11)]
        assert await pub.publish(big) == [None] * len(big)
        sizes = [len(call) for call in faults.calls]
        assert sorted(sizes) == [1, 5, 5]  # 5 records of 900 KB make 4.5 MB: a sixth would not fit
        stored = await s.records(expected=len(many) + len(big), timeout=90)
        assert len(stored) == len(many) + len(big)


async def test_a_record_of_exactly_1_mib_goes_one_byte_more_is_parked(sqs_endpoint: str) -> None:
    async with stream(sqs_endpoint) as s, publisher(sqs_endpoint) as pub:
        probe = message(s.stream, "k", 1, body=b'""')
        overhead = len(record_data(probe)) + len(partition_key("k")) - 2
        fits = replace(probe, body=b'"' + b"x" * (MAX_RECORD_BYTES - overhead - 2) + b'"')
        over = message(
            s.stream, "k", 2, body=b'"' + b"x" * (MAX_RECORD_BYTES - overhead - 1) + b'"'
        )
        outcomes = await pub.publish([fits, over])
        assert outcomes[0] is None
        assert isinstance(outcomes[1], PermanentPublishError)
        assert f"{MAX_RECORD_BYTES + 1} bytes" in str(outcomes[1]) and "book/k@2" in str(
            outcomes[1]
        )
        (record,) = await s.records(expected=1)
        assert len(record["Data"]) + len(record["PartitionKey"]) == MAX_RECORD_BYTES


async def test_keys_kinesis_refuses_are_hashed_and_keep_their_order(sqs_endpoint: str) -> None:
    long_key = "tenant-" + "t" * 300
    keys = ["", long_key, "ключ", "plain key"]
    async with stream(sqs_endpoint) as s, publisher(sqs_endpoint) as pub:
        batch = interleaved(s.stream, keys, 3)
        assert await pub.publish(batch) == [None] * len(batch)
        records = await s.records(expected=len(batch))
    hashed = {key: partition_key(key) for key in keys}
    assert hashed[""].startswith("~sha256:") and hashed[long_key].startswith("~sha256:")
    assert hashed["ключ"] == "ключ" and hashed["plain key"] == "plain key"
    assert by_key(records) == {hashed[k]: [m.id for m in batch if m.key == k] for k in keys}
    assert {consumed(r).id: json.loads(r["Data"])["partitionkey"] for r in records}[
        f"book/{long_key}@1"
    ] == long_key  # the event keeps the key as it is


async def test_a_stream_arn_is_a_destination(sqs_endpoint: str) -> None:
    async with stream(sqs_endpoint) as s, publisher(sqs_endpoint) as pub:
        assert await pub.publish([message(s.stream_arn, "k", 1)]) == [None]
        (record,) = await s.records(expected=1)
        assert json.loads(record["Data"])["id"] == "book/k@1"


def test_a_record_is_the_event_to_structured_makes() -> None:
    from relay.core.publishing import to_structured

    for sent in (message("s", "k", 1), message("s", "k", 2, time=None, dataschema="urn:x")):
        expected = replace(sent)
        to_structured(expected)
        assert record_data(sent) == expected.body


async def test_a_structured_message_goes_as_it_is(sqs_endpoint: str) -> None:
    from relay.core.publishing import to_structured

    async with stream(sqs_endpoint) as s, publisher(sqs_endpoint) as pub:
        sent = message(s.stream, "k", 1)
        to_structured(sent)
        assert await pub.publish([sent]) == [None]
        (record,) = await s.records(expected=1)
        assert record["Data"] == sent.body


async def test_an_outage_stops_the_calls_still_waiting(
    sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calls of 10 records (500 in production: moto is slow with thousands), so that the first
    # round (one record per key) needs many calls, one after the other.
    monkeypatch.setattr("relay.brokers.kinesis.MAX_RECORDS", 10)
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    async with stream(sqs_endpoint) as s:
        batch = [message(s.stream, f"k{n}", 1, body=b"1") for n in range(160)]
        with TcpProxy(host, int(port)) as proxy:
            endpoint = f"http://{proxy.host}:{proxy.port}"
            config = KinesisBrokerConfig(
                type="kinesis",
                region=REGION,
                endpoint_url=endpoint,
                ack_timeout=0.3,
                connect_timeout=0.3,
            )
            pub = KinesisPublisher("kinesis", config)
            try:
                await pub.connect()
                calls: list[int] = []
                pub._client.meta.events.register(  # the publisher's own client (tests only)
                    "before-parameter-build.kinesis.PutRecords",
                    lambda params, **_: calls.append(len(params["Records"])),
                )
                proxy.pause()  # a black hole: every call waits for its timeout
                outcomes = await pub.publish(batch)
                assert all(isinstance(o, TransientPublishError) for o in outcomes)
                assert str(outcomes[0]).startswith(f"broker 'kinesis': stream {s.stream!r}: ")
                assert calls == [10], outcomes[0]  # the other calls were never made
            finally:
                await pub.close()
            proxy.cut()
            proxy.resume()
            async with publisher(endpoint) as pub:
                assert await pub.publish(batch) == [None] * len(batch)  # once it is back
        records = await s.records(expected=len(batch))
        assert {json.loads(r["Data"])["id"] for r in records} == {m.id for m in batch}


async def test_a_big_call_into_a_black_hole_ends_at_its_deadline(sqs_endpoint: str) -> None:
    """ack_timeout bounds reads only; a call of megabytes blocks on its writes when nothing
    is read at the other end, and must still end (transient), not hang the relay."""
    host, port = sqs_endpoint.removeprefix("http://").split(":")
    async with stream(sqs_endpoint) as s:
        batch = [message(s.stream, f"k{n}", 1, body=b'"' + b"x" * 900_000 + b'"') for n in range(5)]
        with TcpProxy(host, int(port)) as proxy:
            endpoint = f"http://{proxy.host}:{proxy.port}"
            async with publisher(endpoint, ack_timeout=0.3, connect_timeout=0.3) as pub:
                assert await pub.publish(batch[:1]) == [None]  # a connection is open
                proxy.pause()
                outcomes = await pub.publish(batch[1:])
                assert all(isinstance(o, TransientPublishError) for o in outcomes)
                assert "no answer within 2.2s (a call of 4 records)" in str(outcomes[0])
                proxy.cut()
                proxy.resume()
                assert await pub.publish(batch[1:]) == [None] * 4
        records = await s.records(expected=len(batch))
        assert {json.loads(r["Data"])["id"] for r in records} == {m.id for m in batch}


# -- the audit's reader ----------------------------------------------------------------------


@asynccontextmanager
async def reader(endpoint: str) -> AsyncIterator[Any]:
    config = KinesisBrokerConfig(type="kinesis", region=REGION, endpoint_url=endpoint)
    audit = create_reader("kinesis", config)
    try:
        await audit.connect()
        yield audit
    finally:
        await audit.close()


async def test_a_resharded_stream_is_read_through_its_closed_parent(sqs_endpoint: str) -> None:
    """After a split the parent shard is closed and its children take the keys; the reader
    lists both and reads the parent first. Moto moves a split shard's records into its
    children (Kinesis keeps them in the closed parent until they expire), so what this shows
    is that a closed shard is read without harm and nothing is lost or read twice."""
    async with stream(sqs_endpoint, shards=1) as s, publisher(sqs_endpoint) as pub:
        before = interleaved(s.stream, "abcd", 3)
        assert await pub.publish(before) == [None] * len(before)
        kinesis = await s.client()
        (shard,) = (await kinesis.list_shards(StreamName=s.stream))["Shards"]
        await kinesis.split_shard(
            StreamName=s.stream, ShardToSplit=shard["ShardId"], NewStartingHashKey=str(2**127)
        )
        after = [message(s.stream, k, v) for v in range(4, 6) for k in "abcd"]
        assert await pub.publish(after) == [None] * len(after)
        async with reader(sqs_endpoint) as audit:
            got = await base.read_back(audit, s.stream, None)
            horizon = await audit.horizon(s.stream)
        shards = (await kinesis.list_shards(StreamName=s.stream))["Shards"]
    assert len(shards) == 3 and "EndingSequenceNumber" in shards[0]["SequenceNumberRange"]
    sent = before + after
    keys = {m.id: m.key for m in sent}
    assert sorted(g.id or "" for g in got) == sorted(keys)  # each once
    got_by_key = base.per_key([(g.id or "", keys.get(g.id or "")) for g in got])
    assert got_by_key == base.per_key([(m.id, m.key) for m in sent])  # each key in order
    assert {g.where.split(" seq ")[0] for g in got} <= {f"shard {x['ShardId']}" for x in shards}
    assert horizon.max_age == 24 * 3600  # Kinesis's default retention
    assert horizon.first is not None and horizon.problem is None


async def test_a_shard_is_read_page_after_page_to_its_tip(
    sqs_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of 7 records: a full page is never taken for the tip, whatever
    MillisBehindLatest says (moto says 0 for records stored in the same millisecond)."""
    monkeypatch.setattr("relay.brokers.kinesis_readback.PAGE", 7)
    monkeypatch.setattr("relay.brokers.kinesis_readback.MIN_CALL_INTERVAL", 0.0)
    async with stream(sqs_endpoint, shards=1) as s, publisher(sqs_endpoint) as pub:
        sent = interleaved(s.stream, "xyz", 10)
        assert await pub.publish(sent) == [None] * len(sent)
        async with reader(sqs_endpoint) as audit:
            got = await base.read_back(audit, s.stream, None)
    assert [g.id for g in got] == [m.id for m in sent]  # one shard: the order sent


async def test_a_missing_stream_reads_empty_and_its_horizon_says_so(sqs_endpoint: str) -> None:
    async with reader(sqs_endpoint) as audit:
        assert await base.read_back(audit, "no-such-stream", None) == []
        horizon = await audit.horizon("no-such-stream")
        assert await audit.duplicate_window("no-such-stream") is None
    assert horizon.first is None and horizon.problem == "stream 'no-such-stream' does not exist"


async def test_an_unreachable_endpoint_is_a_read_back_error(sqs_endpoint: str) -> None:
    async with reader(f"http://127.0.0.1:{free_port()}") as audit:
        with pytest.raises(ReadBackError, match="broker 'kinesis': cannot read stream 's'"):
            await base.read_back(audit, "s", None)
