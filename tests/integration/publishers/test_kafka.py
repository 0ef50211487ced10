"""The Kafka adapter against tansu (Kafka protocol): what every publisher does (base.py), and
partitions and order, outages and rejections as Kafka has them; its transaction handling is
tested against a scripted producer, since tansu has no transactions (nor idempotence: every
real-broker test runs with it off)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, ProducerFenced
from aiokafka.partitioner import murmur2
from pydantic import ValidationError

from relay.brokers.kafka import KafkaPublisher
from relay.brokers.kafka_readback import KafkaReader
from relay.config import KafkaBrokerConfig
from relay.config import brokers as brokers_config
from relay.core.publishing import Message, to_structured
from relay.errors import PermanentPublishError, ReadBackError, TransientPublishError
from tests.contract.brokers import kafka as kafka_harness
from tests.contract.brokers.kafka import KafkaHarness
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import message
from tests.support.db import NewEvent, append_many, connect
from tests.support.kafka_server import (
    TansuServer,
    consume,
    create_topic,
    headers,
    relay_config,
    unique_topic,
    version,
)
from tests.support.net import free_port
from tests.support.scenario import eventually, load_and_migrate, running, status


def publisher(bootstrap: str, **options: Any) -> KafkaPublisher:
    config: dict[str, Any] = {
        "type": "kafka",
        "bootstrap_servers": [bootstrap],
        "enable_idempotence": False,
        "ack_timeout": 2.0,
        "connect_timeout": 1.0,
        **options,
    }
    return KafkaPublisher("kafka", KafkaBrokerConfig(**config))


class KafkaKit(base.PublisherKit[KafkaHarness]):
    name = "kafka"
    options = {"ack_timeout": 2.0, "connect_timeout": 1.0}  # idempotence off: the harness's
    total_order = False  # per key: a key's partition
    # tansu stores records of several MB: what refuses this one is the producer's
    # max_request_size (1 MiB by default). The third key is in another partition than the
    # refused one's, and still held back.
    oversized = 2 * 1024 * 1024
    oversize_keys = ("ok", "big", "ok")
    oversize_says = "MessageSizeTooLargeError"
    invalid_destination = "not a topic!"
    invalid_destination_says = "invalid topic"
    time_attribute = "ce_time"
    timed_attributes = {  # no ce_partitionkey: the record's key is the partition key
        "ce_specversion": "1.0",
        "ce_id": "book/b1@1",
        "ce_type": "library.book-lent.v1",
        "ce_source": "/outbox-relay/loans",
        "ce_time": "2026-11-29T08:30:15.250000+00:00",
        "content-type": "application/json",
    }
    duplicate_window = None  # Kafka drops no re-sent id
    start = staticmethod(kafka_harness.start)  # a private tansu behind a proxy

    def unreachable(self) -> dict[str, Any]:
        return {"bootstrap_servers": [f"127.0.0.1:{free_port()}"]}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'kafka': cannot connect",)

    def carried(self, consumed: Consumed) -> dict[str, str]:
        return headers(consumed.raw)

    def content_type(self, consumed: Consumed) -> str:
        return headers(consumed.raw)["content-type"]

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert consumed.raw.key == b"b1"
        assert consumed.raw.value == sent.body


class TestKafkaPublisher(base.PublisherTestcase, base.ReadBackTestcase):
    Kit = KafkaKit


def test_tansu_is_the_expected_broker() -> None:
    assert version().startswith("tansu ")


async def test_keys_keep_their_partition_and_their_order(
    tansu: TansuServer, kafka_topic: str
) -> None:
    keys, versions = 97, 12
    batch = [message(kafka_topic, f"b{k}", v) for v in range(1, versions + 1) for k in range(keys)]
    pub = publisher(tansu.bootstrap)
    try:
        for start in range(0, len(batch), 500):
            chunk = batch[start : start + 500]
            assert await pub.publish(chunk) == [None] * len(chunk)
    finally:
        await pub.close()
    records = await consume(tansu.bootstrap, kafka_topic, expected=len(batch))
    assert len(records) == len(batch)
    partition_of: dict[str, set[int]] = defaultdict(set)
    order: dict[tuple[int, str], list[int]] = defaultdict(list)
    for record in records:
        key = record.key.decode()
        partition_of[key].add(record.partition)
        order[(record.partition, key)].append(int(headers(record)["ce_id"].split("@")[1]))
    # Every key in one partition, the one the Java client's murmur2 partitioner picks...
    for key, partitions in partition_of.items():
        assert partitions == {(murmur2(key.encode()) & 0x7FFFFFFF) % 3}, key
    # ...keys spread over all three, each key's versions strictly increasing in its partition.
    assert {p for ps in partition_of.values() for p in ps} == {0, 1, 2}
    for (_, key), seen in order.items():
        assert seen == list(range(1, versions + 1)), key


async def test_a_partition_share_above_one_record_batch_goes_in_order_waves(
    tansu: TansuServer, kafka_topic: str
) -> None:
    body = b"x" * 300
    batch = [message(kafka_topic, "one-key", v, body) for v in range(1, 101)]
    batch += [message(kafka_topic, "other", v, body) for v in range(1, 101)]
    pub = publisher(tansu.bootstrap, max_request_size=4096)  # about ten records per batch
    try:
        assert await pub.publish(batch) == [None] * len(batch)
    finally:
        await pub.close()
    records = await consume(tansu.bootstrap, kafka_topic, expected=len(batch))
    for key in ("one-key", "other"):
        ids = [headers(r)["ce_id"] for r in records if r.key == key.encode()]
        assert ids == [f"book/{key}@{v}" for v in range(1, 101)]


async def test_silent_broker_is_transient_within_connect_timeout(
    tansu: TansuServer, kafka_topic: str
) -> None:
    assert tansu.proxy is not None
    tansu.proxy.pause()  # TCP connects, the Kafka handshake never answers
    pub = publisher(tansu.bootstrap, connect_timeout=0.5)
    try:
        started = asyncio.get_running_loop().time()
        (outcome,) = await pub.publish([message(kafka_topic, "b1", 1)])
        assert isinstance(outcome, TransientPublishError)
        assert "no answer within 0.5s" in str(outcome)
        assert asyncio.get_running_loop().time() - started < 2
        tansu.proxy.resume()
        assert await pub.publish([message(kafka_topic, "b1", 1)]) == [None]
    finally:
        await pub.close()


def first_deliveries(records: list[Any]) -> list[str]:
    """ce_ids in consumed order, re-deliveries left out (at least once allows them)."""
    seen: dict[str, None] = {}
    for record in records:
        seen.setdefault(headers(record)["ce_id"])
    return list(seen)


@pytest.mark.parametrize("cut", [True, False], ids=["connection-cut", "black-hole"])
async def test_outage_mid_batch_is_transient_then_recovers_in_order(
    tansu: TansuServer, kafka_topic: str, cut: bool
) -> None:
    assert tansu.proxy is not None
    pub = publisher(tansu.bootstrap, ack_timeout=1.0)
    try:
        assert await pub.publish([message(kafka_topic, "b1", 1)]) == [None]
        tansu.proxy.pause()
        if cut:
            tansu.proxy.cut()
        outcomes = await pub.publish([message(kafka_topic, "b1", v) for v in (2, 3)])
        assert all(isinstance(o, TransientPublishError) for o in outcomes)
        assert "no answer within 1.0s" in str(outcomes[0])
        tansu.proxy.resume()
        retry = [message(kafka_topic, "b1", v) for v in (2, 3, 4)]
        assert await pub.publish(retry) == [None] * 3
    finally:
        await pub.close()
    records = await consume(tansu.bootstrap, kafka_topic, expected=4)
    assert first_deliveries(records) == [f"book/b1@{v}" for v in (1, 2, 3, 4)]


def test_configuration_the_producer_cannot_use_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def kafka(**options: Any) -> KafkaPublisher:
        config = {"type": "kafka", "bootstrap_servers": ["127.0.0.1:9"], **options}
        return KafkaPublisher("events", KafkaBrokerConfig(**config))

    # Rules on the config alone live in the config model: `relay check --offline` reports them.
    monkeypatch.setattr(brokers_config, "codec_available", lambda codec: codec == "gzip")
    with pytest.raises(ValidationError, match=r"zstd needs the `cramjam` package"):
        kafka(compression_type="zstd")
    with pytest.raises(ValidationError, match="needs sasl_username and sasl_password"):
        kafka(security_protocol="SASL_SSL", sasl_username="relay")
    with pytest.raises(ValidationError, match="tls: needs security_protocol SSL"):
        kafka(tls={})
    with pytest.raises(ValidationError, match=r"tls\n.*cannot load the TLS files: "):
        kafka(security_protocol="SSL", tls={"ca_file": str(tmp_path / "missing.pem")})
    assert kafka(security_protocol="SSL", compression_type="gzip")


async def test_idempotent_producer_on_a_broker_without_it_says_what_to_change(
    tansu: TansuServer,
) -> None:
    pub = publisher(tansu.bootstrap, enable_idempotence=True)
    try:
        (outcome,) = await pub.publish([message(unique_topic(), "b1", 1)])
        assert isinstance(outcome, TransientPublishError)
        assert "enable_idempotence: false" in str(outcome)
    finally:
        await pub.close()


async def test_transactional_producer_on_a_broker_without_it_says_to_remove_the_id(
    tansu: TansuServer,
) -> None:
    """Transactions force the idempotent producer on: `enable_idempotence: false` is no way out."""
    pub = publisher(tansu.bootstrap, transactional_id="relay-loans", enable_idempotence=False)
    try:
        (outcome,) = await pub.publish([message(unique_topic(), "b1", 1)])
        assert isinstance(outcome, TransientPublishError)
        assert "remove transactional_id" in str(outcome)
        assert "set enable_idempotence: false" not in str(outcome)
    finally:
        await pub.close()


async def test_relay_waits_for_a_broker_down_at_start_up_then_delivers_everything(
    tansu_factory: Callable[..., TansuServer], events_table: str, tmp_path: Path
) -> None:
    server = tansu_factory(started=False)
    topic = unique_topic("late")
    payload = {"bookId": "aggregate_id", "version": "version"}
    data = relay_config(events_table, [server.bootstrap], topic, payload=payload, level="warning")
    config = await load_and_migrate(tmp_path, data)
    events = [
        NewEvent("book", f"book-{b}", v, "BookLent", {"loanId": f"{b}-{v}"})
        for v in range(1, 6)
        for b in range(8)
    ]
    async with connect(events_table) as conn:
        await append_many(conn, events)
    async with running(config) as relay:

        async def retrying() -> bool:
            rows = await status(config)
            return rows[0]["state"] == "retrying" and relay.states["loans"].attempts >= 2

        await eventually(retrying, timeout=30)
        assert "cannot connect" in (await status(config))[0]["last_error"]
        server.start()
        await create_topic(server.bootstrap, topic, partitions=3)
        records = await consume(server.bootstrap, topic, expected=len(events), timeout=60)
    first_seen: dict[str, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for record in records:
        ce_id = headers(record)["ce_id"]
        if ce_id not in seen:
            seen.add(ce_id)
            book, v = ce_id.removeprefix("book/").split("@")
            first_seen[book].append(int(v))
    assert seen == {f"book/{e.aggregate_id}@{e.version}" for e in events}
    assert all(versions == [1, 2, 3, 4, 5] for versions in first_seen.values())


async def test_relay_takes_bootstrap_servers_as_one_comma_separated_string(
    tansu: TansuServer, kafka_topic: str, events_table: str, tmp_path: Path
) -> None:
    """As Kafka users write it: the first address answers nothing, the second is tansu."""
    nowhere = f"127.0.0.1:{free_port()}"
    servers = f"{nowhere}, {tansu.bootstrap}"
    config = await load_and_migrate(
        tmp_path, relay_config(events_table, servers, kafka_topic, connect_timeout="5s")
    )
    broker = config.brokers["kafka"]
    assert isinstance(broker, KafkaBrokerConfig)
    assert broker.bootstrap_servers == [nowhere, tansu.bootstrap]
    async with connect(events_table) as conn:
        await append_many(
            conn, [NewEvent("book", f"b{i}", 1, "BookLent", {"loanId": f"L{i}"}) for i in range(5)]
        )
    async with running(config):
        records = await consume(tansu.bootstrap, kafka_topic, expected=5, timeout=60)
    assert sorted(headers(r)["ce_id"] for r in records) == [f"book/b{i}@1" for i in range(5)]


# -- transactions, against a scripted producer ----------------------------------------------


class FakeBuilder:
    def __init__(self) -> None:
        self.records: list[bytes] = []

    def append(self, *, timestamp: Any, key: bytes, value: bytes, headers: Any) -> object:
        self.records.append(key)
        return object()


class FakeProducer:
    """Enough of AIOKafkaProducer for the adapter; `fail` decides each record batch's fate."""

    def __init__(
        self, fail: Callable[[list[bytes]], BaseException | None], hang_commit: bool = False
    ) -> None:
        self.fail = fail
        self.hang_commit = hang_commit
        self.calls: list[str] = []
        self.pending: list[list[bytes]] = []
        self.committed: list[bytes] = []
        self.stopped = False

    async def start(self) -> None:
        self.calls.append("start")

    async def flush(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True

    async def partitions_for(self, topic: str) -> set[int]:
        return {0, 1, 2}

    def create_batch(self) -> FakeBuilder:
        return FakeBuilder()

    async def send_batch(self, builder: FakeBuilder, topic: str, *, partition: int) -> Any:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        error = self.fail(builder.records)
        if error is None:
            self.pending.append(builder.records)
            future.set_result(None)
        else:
            future.set_exception(error)
        return future

    async def begin_transaction(self) -> None:
        self.calls.append("begin")
        self.pending = []

    async def commit_transaction(self) -> None:
        self.calls.append("commit")
        if self.hang_commit:
            await asyncio.sleep(3600)
        self.committed += [key for batch in self.pending for key in batch]

    async def abort_transaction(self) -> None:
        self.calls.append("abort")
        self.pending = []


def transactional(producers: list[FakeProducer]) -> KafkaPublisher:
    pub = publisher(
        "127.0.0.1:9", transactional_id="relay-loans", enable_idempotence=True, ack_timeout=0.5
    )
    queue = iter(producers)
    pub._new_producer = lambda: next(queue)  # type: ignore[method-assign]
    return pub


async def test_each_batch_is_one_committed_transaction() -> None:
    producer = FakeProducer(lambda records: None)
    pub = transactional([producer])
    batch = [message("t", f"b{n}", 1) for n in range(6)]
    assert await pub.publish(batch) == [None] * 6
    assert await pub.publish(batch[:2]) == [None] * 2
    assert producer.calls == ["start", "begin", "commit", "begin", "commit"]
    expected = [m.key.encode() for m in batch + batch[:2]]
    assert sorted(producer.committed) == sorted(expected)
    await pub.close()
    assert producer.stopped


async def test_fenced_producer_is_replaced_and_the_batch_retried() -> None:
    fenced = FakeProducer(lambda records: ProducerFenced())
    fresh = FakeProducer(lambda records: None)
    pub = transactional([fenced, fresh])
    batch = [message("t", "b1", 1), message("t", "b1", 2)]
    outcomes = await pub.publish(batch)
    assert all(isinstance(o, TransientPublishError) for o in outcomes)
    assert "producer fenced" in str(outcomes[0])
    assert fenced.stopped and fenced.committed == []
    assert await pub.publish(batch) == [None, None]
    assert fresh.committed == [b"b1", b"b1"]
    await pub.close()


async def test_rejection_in_a_transaction_commits_what_came_before_it() -> None:
    def fail(records: list[bytes]) -> BaseException | None:
        return MessageSizeTooLargeError() if records == [b"bad"] else None

    keys = {k: (murmur2(k.encode()) & 0x7FFFFFFF) % 3 for k in ("ok", "bad")}
    assert keys["ok"] != keys["bad"], "the test needs them in distinct partitions"
    producer = FakeProducer(fail)
    pub = transactional([producer])
    outcomes = await pub.publish(
        [message("t", "ok", 1), message("t", "bad", 1), message("t", "ok", 2)]
    )
    assert outcomes[0] is None
    assert isinstance(outcomes[1], PermanentPublishError)  # parked in time, not retried
    assert producer.calls == ["start", "begin", "commit"]
    assert producer.committed == [b"ok", b"ok"]  # ok@2 again after the parking: at least once
    # A failure at the head leaves nothing to commit: the transaction is aborted.
    outcomes = await pub.publish([message("t", "bad", 1), message("t", "ok", 3)])
    assert isinstance(outcomes[0], PermanentPublishError)
    assert isinstance(outcomes[1], TransientPublishError)
    assert "transaction aborted" in str(outcomes[1])
    assert producer.calls[-2:] == ["begin", "abort"]
    assert producer.committed == [b"ok", b"ok"]
    await pub.close()


async def test_transaction_without_an_answer_discards_the_producer() -> None:
    silent = FakeProducer(lambda records: None, hang_commit=True)
    fresh = FakeProducer(lambda records: None)
    pub = transactional([silent, fresh])
    (outcome,) = await pub.publish([message("t", "b1", 1)])
    assert isinstance(outcome, TransientPublishError)
    assert "committing the transaction: no answer within 0.5s" in str(outcome)
    assert silent.stopped and silent.committed == []
    assert await pub.publish([message("t", "b1", 1)]) == [None]
    assert fresh.committed == [b"b1"]
    await pub.close()


async def test_producer_whose_sender_stopped_is_replaced() -> None:
    """aiokafka fails every batch once its sender task died of an unexpected error."""
    dead = FakeProducer(lambda records: KafkaError("Unexpected error during batch delivery"))
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    finished.set_result(None)
    dead._sender = type("Sender", (), {"sender_task": finished})()  # type: ignore[attr-defined]
    fresh = FakeProducer(lambda records: None)
    pub = publisher("127.0.0.1:9")
    producers = iter([dead, fresh])
    pub._new_producer = lambda: next(producers)  # type: ignore[method-assign]
    (outcome,) = await pub.publish([message("t", "b1", 1)])
    assert isinstance(outcome, TransientPublishError)
    assert dead.stopped
    assert await pub.publish([message("t", "b1", 1)]) == [None]
    await pub.close()


async def test_batch_too_large_for_the_broker_is_split_not_parked() -> None:
    """A topic whose max.message.bytes is below max_request_size refuses a record batch of
    several records: the batch is retried in smaller batches, never blamed on one record."""
    limit = 3

    def fail(records: list[bytes]) -> BaseException | None:
        return MessageSizeTooLargeError() if len(records) > limit else None

    producer = FakeProducer(fail)
    pub = publisher("127.0.0.1:9", max_request_size=4096)
    pub._new_producer = lambda: producer  # type: ignore[method-assign]
    batch = [message("t", "one", v, b"x" * 200) for v in range(1, 21)]
    for _ in range(10):
        outcomes = await pub.publish(batch)
        assert not any(isinstance(o, PermanentPublishError) for o in outcomes)
        if outcomes == [None] * len(batch):
            break
    else:
        raise AssertionError("the batch never went through")
    await pub.close()


# -- read back by `relay audit` (what only Kafka has; the rest is base.ReadBackTestcase) -----


def reader(bootstrap: str, **options: Any) -> KafkaReader:
    config = {"type": "kafka", "bootstrap_servers": [bootstrap], "connect_timeout": 1.0}
    return KafkaReader("kafka", KafkaBrokerConfig(**{**config, **options}))


async def test_a_structured_record_is_read_back_by_the_id_in_its_value(
    tansu: TansuServer, kafka_topic: str
) -> None:
    sent = [message(kafka_topic, "s", n) for n in range(1, 4)]
    for m in sent:
        to_structured(m)
    pub = publisher(tansu.bootstrap)
    try:
        assert await pub.publish(sent) == [None] * 3
    finally:
        await pub.close()
    audit = reader(tansu.bootstrap)
    try:
        await audit.connect()
        got = await base.read_back(audit, kafka_topic, None)
        horizon = await audit.horizon(kafka_topic)
    finally:
        await audit.close()
    assert [g.id for g in got] == [m.id for m in sent]  # one key: one partition, in order
    assert horizon.first_id == sent[0].id


async def test_a_read_from_a_time_inside_a_record_batch_starts_at_its_first_record_then(
    tansu: TansuServer, kafka_topic: str
) -> None:
    """Kafka finds the first record stamped at the time or later; tansu answers the first
    offset of the record batch holding it (its first): the batch's earlier records are left
    out, and the rest of the partition is read, past the first page of records the consumer
    hands over (1,000)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=tansu.bootstrap, enable_idempotence=False, max_batch_size=1 << 20
    )
    await producer.start()
    t0 = int((datetime.now(UTC) - timedelta(minutes=1)).timestamp() * 1000)
    try:
        for numbers in (range(1, 1201), range(1201, 1204)):  # two record batches
            batch = producer.create_batch()
            for n in numbers:
                header = [("ce_id", f"book/b@{n}".encode())]
                assert batch.append(key=b"b", value=b"{}", timestamp=t0 + n, headers=header)
            await (await producer.send_batch(batch, kafka_topic, partition=0))
    finally:
        await producer.stop()
    audit = reader(tansu.bootstrap)
    try:
        await audit.connect()
        since = datetime.fromtimestamp((t0 + 101) / 1000, UTC)
        got = await base.read_back(audit, kafka_topic, since)
    finally:
        await audit.close()
    assert [g.id for g in got] == [f"book/b@{n}" for n in range(101, 1204)]


async def test_a_read_ends_at_where_the_partitions_ended_while_records_keep_coming(
    tansu: TansuServer, kafka_topic: str
) -> None:
    pub = publisher(tansu.bootstrap)
    sent = [message(kafka_topic, f"k{n % 7}", n) for n in range(1, 301)]
    busy, stop = asyncio.Event(), asyncio.Event()

    async def keep_publishing() -> None:
        n = 301
        while not stop.is_set():
            assert await pub.publish([message(kafka_topic, f"k{n % 7}", n)]) == [None]
            busy.set()
            n += 1

    assert await pub.publish(sent) == [None] * 300
    more = asyncio.create_task(keep_publishing())
    audit = reader(tansu.bootstrap)
    try:
        await busy.wait()
        await audit.connect()
        async with asyncio.timeout(20):
            got = await base.read_back(audit, kafka_topic, None)
    finally:
        stop.set()  # not cancel(): Python 3.11's wait_for, in the clients, can swallow it
        await more
        await audit.close()
        await pub.close()
    assert {m.id for m in sent} <= {g.id for g in got}


async def test_reading_back_joins_no_group_and_moves_no_committed_offset(
    tansu: TansuServer, kafka_topic: str
) -> None:
    pub = publisher(tansu.bootstrap)
    try:
        assert await pub.publish([message(kafka_topic, "g", n) for n in range(1, 6)]) == [None] * 5
    finally:
        await pub.close()
    partition = TopicPartition(kafka_topic, (murmur2(b"g") & 0x7FFFFFFF) % 3)
    billing = AIOKafkaConsumer(
        bootstrap_servers=tansu.bootstrap, group_id="billing", enable_auto_commit=False
    )
    await billing.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu.bootstrap)
    await admin.start()
    try:
        billing.assign([partition])
        await billing.commit({partition: 3})  # billing has read 3 of the 5
        audit = reader(tansu.bootstrap)
        try:
            await audit.connect()
            assert len(await base.read_back(audit, kafka_topic, None)) == 5
            await audit.horizon(kafka_topic)
        finally:
            await audit.close()
        assert await admin.list_consumer_groups() == [("billing", "consumer")]
        assert await billing.committed(partition) == 3
    finally:
        await admin.close()
        await billing.stop()


async def test_a_topic_that_does_not_exist_is_named_by_the_horizon_and_not_created(
    tansu: TansuServer,
) -> None:
    topic = unique_topic("never")
    audit = reader(tansu.bootstrap)
    try:
        await audit.connect()
        assert await base.read_back(audit, topic, None) == []
        assert (await audit.horizon(topic)).problem == f"topic {topic!r} does not exist"
    finally:
        await audit.close()
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu.bootstrap)
    await admin.start()
    try:
        assert topic not in await admin.list_topics()
    finally:
        await admin.close()


async def test_an_unreachable_broker_is_a_read_back_error_that_names_the_broker() -> None:
    audit = reader(f"127.0.0.1:{free_port()}")
    with pytest.raises(ReadBackError, match=r"^broker 'kafka': cannot connect: "):
        await audit.connect()
    await audit.close()
