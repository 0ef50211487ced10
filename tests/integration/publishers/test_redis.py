"""The Redis Streams adapter against real redis-server 7: what every publisher does (base.py),
and the relay's own deduplication (a set of recent ids per stream, checked in the script that
adds the entry) through a failover, its window, two lanes on one stream, order through a
refused entry, limits, MAXLEN, ACL users, and an outage of a private server mid-drain.

Outages and limits use PRIVATE servers (`redis_factory`); the shared one is only written to
under unique stream names.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import pytest

from relay.brokers.redis import MAX_CALL_MESSAGES, RedisPublisher
from relay.brokers.redis_readback import RedisReader
from relay.config import RedisBrokerConfig
from relay.core.publishing import Message, to_structured
from relay.errors import PermanentPublishError, ReadBackError, TransientPublishError
from tests.contract.brokers import redis as redis_harness
from tests.contract.brokers.redis import RedisHarness
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import message
from tests.support.net import free_port
from tests.support.redis_server import (
    DEDUP_PREFIX,
    RedisFactory,
    delete_stream,
    read_stream,
    redis_client,
    unique_stream,
)
from tests.support.scenario import eventually


class RedisKit(base.PublisherKit[RedisHarness]):
    name = "redis"
    options = {"ack_timeout": 5.0, "connect_timeout": 5.0}
    batches = (300, MAX_CALL_MESSAGES * 2 + 100)  # the second takes three script calls
    oversized = 1024 * 1024 + 1  # the body alone is over max_message_bytes (1 MiB)
    oversize_says = "is more than max_message_bytes (1,048,576)"
    invalid_destination = ""
    invalid_destination_says = "the destination is empty"
    time_attribute = "ce_time"
    timed_attributes = {
        "ce_specversion": "1.0",
        "ce_id": "book/b1@1",
        "ce_type": "library.book-lent.v1",
        "ce_source": "/outbox-relay/loans",
        "ce_time": "2026-11-29T08:30:15.250000+00:00",
        "ce_partitionkey": "b1",
        "content-type": "application/json",
    }
    counts_duplicates = True
    duplicate_window = 120.0  # the adapter's dedup_window, by default
    start = staticmethod(redis_harness.start)

    def unreachable(self) -> dict[str, Any]:
        return {"url": f"redis://127.0.0.1:{free_port()}/0"}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'redis': cannot connect: ", "Connect call failed")

    def carried(self, consumed: Consumed) -> dict[str, str]:
        _, fields = consumed.raw
        return {name: value.decode() for name, value in fields.items() if name != "body"}

    def content_type(self, consumed: Consumed) -> str:
        _, fields = consumed.raw
        return str(fields["content-type"].decode())

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        entry_id, fields = consumed.raw
        assert re.fullmatch(r"\d+-\d+", entry_id)  # numbered by Redis
        assert list(fields)[-1] == "body"
        assert fields["body"] == sent.body


class TestRedisPublisher(base.PublisherTestcase, base.DeduplicationTestcase, base.ReadBackTestcase):
    Kit = RedisKit


def config(url: str, **options: Any) -> RedisBrokerConfig:
    return RedisBrokerConfig(
        type="redis", url=url, **{"ack_timeout": 2.0, "connect_timeout": 2.0, **options}
    )


def ids(entries: list[tuple[str, dict[str, bytes]]]) -> list[str]:
    return [fields["ce_id"].decode() for _, fields in entries]


@pytest.fixture
async def stream(redis_url: str) -> Any:
    name = unique_stream("adapter")
    yield name
    await delete_stream(redis_url, name)


async def test_a_new_holder_resending_a_crashed_holders_batch_stores_each_id_once(
    redis_url: str, stream: str
) -> None:
    """A lease failover: the first instance stored part of a batch and died before its
    checkpoint moved; the second, with no memory of it, sends the whole batch again."""
    batch = [message(stream, f"k{n % 7}", n) for n in range(1, 401)]
    first = RedisPublisher("redis", config(redis_url))
    assert await first.publish(batch[:250]) == [None] * 250
    await first.close()  # crashed: nothing of it survives but what Redis holds

    second = RedisPublisher("redis", config(redis_url))
    try:
        assert await second.publish(batch) == [None] * 400
        assert second.duplicates == 250
        assert list(second.last_duplicates) == list(range(250))
    finally:
        await second.close()
    assert ids(await read_stream(redis_url, stream)) == [m.id for m in batch]


async def test_two_lanes_on_one_stream_each_fail_over_without_duplicates(
    redis_url: str, stream: str
) -> None:
    """Position-derived entry ids would refuse one lane's entries below the other's; the id
    set does not care who wrote last."""
    lane_a = [message(stream, "a", n, position=n * 2) for n in range(1, 101)]
    lane_b = [message(stream, "b", n, position=n * 2 + 1) for n in range(1, 101)]
    pubs = [RedisPublisher("redis", config(redis_url)) for _ in range(4)]
    try:
        assert await pubs[0].publish(lane_a[:60]) == [None] * 60
        assert await pubs[1].publish(lane_b) == [None] * 100
        # Lane a's holder dies; its successor repeats the whole batch after lane b's writes.
        assert await pubs[2].publish(lane_a) == [None] * 100
        assert pubs[2].duplicates == 60
        # And lane b's successor repeats all of its own, interleaved with nothing new.
        assert await pubs[3].publish(lane_b) == [None] * 100
        assert pubs[3].duplicates == 100
    finally:
        for pub in pubs:
            await pub.close()
    stored = ids(await read_stream(redis_url, stream))
    assert sorted(stored) == sorted(m.id for m in lane_a + lane_b)
    assert [i for i in stored if "/a@" in i] == [m.id for m in lane_a]
    assert [i for i in stored if "/b@" in i] == [m.id for m in lane_b]


async def test_the_dedup_window_is_redis_time_and_the_set_expires_with_it(
    redis_url: str, stream: str
) -> None:
    pub = RedisPublisher("redis", config(redis_url, dedup_window=0.5))
    batch = [message(stream, "k", n) for n in range(1, 4)]
    try:
        assert await pub.publish(batch) == [None] * 3
        async with redis_client(redis_url) as client:
            assert 0 < await client.pttl(DEDUP_PREFIX + stream) <= 500
            members: list[bytes] = await client.zrange(DEDUP_PREFIX + stream, 0, -1)  # type: ignore[assignment]
            assert [m.decode() for m in members] == [m.id for m in batch]
            assert await pub.publish(batch[:1]) == [None]
            assert pub.duplicates == 1

            async def forgotten() -> bool:
                return not await client.exists(DEDUP_PREFIX + stream)

            await eventually(forgotten, timeout=5)
        # After the window a re-send is a new entry: at least once, as documented.
        assert await pub.publish(batch[:1]) == [None]
        assert pub.duplicates == 1
    finally:
        await pub.close()
    assert ids(await read_stream(redis_url, stream)) == [m.id for m in [*batch, batch[0]]]


async def test_a_key_of_another_type_is_parked_in_redis_words_and_nothing_after_it_is_sent(
    redis_url: str, stream: str
) -> None:
    """Order through a failure: the script stops at the refused entry, in any call."""
    taken = stream + ":string"
    async with redis_client(redis_url) as client:
        await client.set(taken, "not a stream")
    try:
        count = MAX_CALL_MESSAGES + 50
        batch = [message(stream, f"k{n % 3}", n) for n in range(1, count + 1)]
        bad = MAX_CALL_MESSAGES + 10  # in the second call
        batch[bad] = replace(batch[bad], destination=taken)
        async with base_publisher(redis_url) as pub:
            outcomes = await pub.publish(batch)
            assert outcomes[:bad] == [None] * bad
            refused = outcomes[bad]
            assert isinstance(refused, PermanentPublishError)
            assert "WRONGTYPE Operation against a key holding the wrong kind of value" in str(
                refused
            )
            assert f"stream {taken!r}" in str(refused)
            assert all(isinstance(o, TransientPublishError) for o in outcomes[bad + 1 :])
            # The relay parks it and goes on with the rest.
            assert await pub.publish(batch[bad + 1 :]) == [None] * (count - bad - 1)
        assert ids(await read_stream(redis_url, stream)) == [
            m.id for i, m in enumerate(batch) if i != bad
        ]
    finally:
        await delete_stream(redis_url, taken)


def base_publisher(url: str, **options: Any) -> Any:
    return _Publishing(RedisPublisher("redis", config(url, **options)))


class _Publishing:
    def __init__(self, pub: RedisPublisher) -> None:
        self.pub = pub

    async def __aenter__(self) -> RedisPublisher:
        return self.pub

    async def __aexit__(self, *exc: object) -> None:
        await self.pub.close()


async def test_maxlen_trims_approximately_and_keeps_the_newest(redis_url: str, stream: str) -> None:
    async with base_publisher(redis_url, maxlen=100) as pub:
        for start in range(0, 1000, 250):
            batch = [message(stream, "k", n) for n in range(start + 1, start + 251)]
            assert await pub.publish(batch) == [None] * 250
    stored = ids(await read_stream(redis_url, stream))
    assert 100 <= len(stored) < 1000  # `~`: whole nodes go, so about 100 stay
    assert stored[-1] == "book/k@1000"
    assert stored == [f"book/k@{n}" for n in range(1001 - len(stored), 1001)]


async def test_ids_keys_and_bodies_arrive_byte_for_byte(redis_url: str, stream: str) -> None:
    """Stream fields are binary-safe: nothing a header-based broker would alter is refused."""
    odd = ["alice\nsmith", " alice smith", "ключ", ""]
    batch = [message(stream, key, 1, body=b"\x00\xff not utf-8") for key in odd]
    async with base_publisher(redis_url) as pub:
        assert await pub.publish(batch) == [None] * len(batch)
    stored = await read_stream(redis_url, stream)
    assert [f["ce_partitionkey"].decode() for _, f in stored] == odd
    assert ids(stored) == [m.id for m in batch]
    assert {f["body"] for _, f in stored} == {b"\x00\xff not utf-8"}


async def test_out_of_memory_is_transient_and_delivery_resumes_when_there_is_room(
    redis_factory: RedisFactory,
) -> None:
    server = redis_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    stream = unique_stream("oom")
    body = b"x" * 200_000
    async with base_publisher(server.url) as pub:
        sent = 0
        while True:
            outcome = (await pub.publish([message(stream, "k", sent + 1, body=body)]))[0]
            if outcome is not None:
                break
            sent += 1
            assert sent < 100, "maxmemory never refused a write"
        assert isinstance(outcome, TransientPublishError)
        assert "OOM command not allowed" in str(outcome)
        async with redis_client(server.url) as client:
            await client.config_set("maxmemory", "64mb")
        assert await pub.publish([message(stream, "k", sent + 1, body=body)]) == [None]
    assert len(await read_stream(server.url, stream)) == sent + 1


async def test_an_acl_user_logs_in_and_a_wrong_password_is_transient_and_never_shown(
    redis_factory: RedisFactory,
) -> None:
    secret = "s3cret-Tr0ub4dor"
    server = redis_factory()
    async with redis_client(server.url) as client:
        await client.acl_setuser(
            "relay",
            enabled=True,
            passwords=[f"+{secret}"],
            keys=["*"],
            commands=["+@all", "-@dangerous"],
        )
    stream = unique_stream("acl")
    batch = [message(stream, "k", 1)]
    async with base_publisher(server.url, username="relay", password=secret) as pub:
        assert await pub.publish(batch) == [None]
    async with base_publisher(server.url, username="relay", password="wrong-" + secret) as pub:
        (outcome,) = await pub.publish([message(stream, "k", 2)])
    assert isinstance(outcome, TransientPublishError)
    assert "cannot connect" in str(outcome)
    assert secret not in str(outcome)
    assert ids(await read_stream(server.url, stream)) == ["book/k@1"]


async def test_the_server_killed_mid_drain_loses_and_reorders_nothing(
    redis_factory: RedisFactory,
) -> None:
    """A drain loop as the core runs it (retry from the first unacknowledged message),
    while the private server is killed and started again on its port."""
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    stream = unique_stream("outage")
    messages = [message(stream, f"k{n % 5}", n) for n in range(1, 3001)]
    async with base_publisher(server.url, ack_timeout=1.0, connect_timeout=1.0) as pub:
        done, failures = 0, 0
        killed = asyncio.Event()

        async def drain() -> None:
            nonlocal done, failures
            while done < len(messages):
                if done >= 500 and not killed.is_set():
                    # The kill lands mid-drain whatever the machine's pace: a fast Redis
                    # took the other 2,500 within one poll of `eventually` below.
                    await killed.wait()
                outcomes = await pub.publish(messages[done : done + 100])
                acked = next((i for i, o in enumerate(outcomes) if o is not None), len(outcomes))
                done += acked
                if acked < len(outcomes):
                    failures += 1
                    assert isinstance(outcomes[acked], TransientPublishError)
                    await asyncio.sleep(0.05)  # the outbox's backoff

        task = asyncio.create_task(drain())
        await eventually(lambda: done >= 500, timeout=20)
        server.restart()  # SIGKILL; the append-only file brings the entries back
        killed.set()
        await asyncio.wait_for(task, 60)
    assert failures >= 1, "the kill was noticed"
    stored = ids(await read_stream(server.url, stream))
    assert stored == [m.id for m in messages]


async def test_kill_9_of_the_holder_mid_drain_stores_every_id_once_in_order(
    events_table: str, redis_url: str, tmp_path: Any, relay_process: Any
) -> None:
    """Two real `relay run` replicas; the holder is killed while a writer appends. The new
    holder re-sends what the dead one had stored but not checkpointed; the id set drops it."""
    from tests.integration.test_failover import MESSAGES, Cluster, duplicates_reported, publishes
    from tests.support.delivery import Writer
    from tests.support.scenario import config_dict, migrate_cli, save

    stream = unique_stream("failover")
    data = config_dict(
        events_table, "unused", stream, messages=MESSAGES, batch={"max_messages": 50}
    )
    data["brokers"] = {"redis": {"type": "redis", "url": redis_url, "ack_timeout": "1s"}}
    data["outboxes"]["loans"]["broker"] = "redis"
    data["lease"] = {"retry_interval": "1s"}
    path = save(tmp_path, data)
    migrate_cli(path)
    try:
        async with Writer(events_table, rate=80) as writer:
            cluster = Cluster(relay_process, path, 2)
            old = await cluster.holder()
            await publishes(old)
            old.kill()
            await old.wait_async(10)
            new = await cluster.successor(old)
            await publishes(new)
        expected = sorted(writer.appended)

        async def all_there() -> bool:
            return len(await read_stream(redis_url, f"{stream}.loans")) >= len(expected)

        await eventually(all_there, timeout=30)
        stored = ids(await read_stream(redis_url, f"{stream}.loans"))
        assert sorted(stored) == sorted(writer.appended.values())  # each id once
        per_book: dict[str, list[int]] = {}
        for message_id in stored:
            book, _, version = message_id.rpartition("@")
            per_book.setdefault(book, []).append(int(version))
        assert all(v == sorted(v) for v in per_book.values())
        assert duplicates_reported(new) <= 50
        assert writer.errors == []
    finally:
        await delete_stream(redis_url, f"{stream}.loans")


async def test_tls_verifies_the_server_against_the_ca_file_and_refuses_an_unknown_one(
    redis_factory: RedisFactory, tmp_path: Any
) -> None:
    from tests.support.nats_tls import write_certificates

    ca, cert, key = write_certificates(tmp_path)
    port = free_port()
    redis_factory(
        "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
        "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
        port=port,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0"
    stream = unique_stream("tls")
    async with base_publisher(url, tls={"ca_file": str(ca)}) as pub:
        assert await pub.publish([message(stream, "k", 1)]) == [None]
    async with base_publisher(url) as pub:  # the system's CAs do not know the test CA
        (outcome,) = await pub.publish([message(stream, "k", 2)])
    assert isinstance(outcome, TransientPublishError)
    assert "cannot connect" in str(outcome) and "certificate verify failed" in str(outcome)
    async with base_publisher(url.replace("rediss://", "redis://")) as pub:  # no TLS
        (outcome,) = await pub.publish([message(stream, "k", 2)])
    assert isinstance(outcome, TransientPublishError)
    async with redis_client(url, ssl_ca_certs=str(ca)) as client:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await client.xrange(stream)  # type: ignore[assignment]
    assert [fields[b"ce_id"] for _, fields in entries] == [b"book/k@1"]


async def test_an_acl_that_may_only_read_the_id_sets_refuses_the_call_before_any_write(
    redis_factory: RedisFactory,
) -> None:
    """Redis checks a script's declared keys against the user's ACL before running it: a
    user who may add entries but only read the id sets stores nothing, and is retried."""
    server = redis_factory()
    stream = unique_stream("acl-ids")
    async with redis_client(server.url) as client:
        await client.acl_setuser(
            "relay",
            enabled=True,
            passwords=["+pw"],
            keys=["relay-test:*", "%R~outbox-relay:dedup:*"],
            commands=["+@all", "-@dangerous"],
        )
        batch = [message(stream, "k", n) for n in range(1, 6)]
        async with base_publisher(server.url, username="relay", password="pw") as pub:
            for _ in range(3):  # the outbox's retries
                outcomes = await pub.publish(batch)
                assert all(isinstance(o, TransientPublishError) for o in outcomes)
                assert "no permissions to access one of the keys" in str(outcomes[0])
            assert await client.xlen(stream) == 0
            await client.acl_setuser("relay", keys=["outbox-relay:dedup:*"])  # added to it
            assert await pub.publish(batch) == [None] * 5
            assert await pub.publish(batch) == [None] * 5
            assert pub.duplicates == 5
    assert ids(await read_stream(server.url, stream)) == [m.id for m in batch]


# -- read back by `relay audit` (what only Redis has; the rest is base.ReadBackTestcase) -----


def reader(url: str, **options: Any) -> Any:
    return RedisReader("redis", config(url, **options))


async def test_a_structured_entry_is_read_back_by_the_id_in_its_body(
    redis_url: str, stream: str
) -> None:
    sent = [message(stream, "s", n) for n in range(1, 4)]
    for m in sent:
        to_structured(m)
    async with base_publisher(redis_url) as pub:
        assert await pub.publish(sent) == [None] * 3
    audit = reader(redis_url)
    try:
        await audit.connect()
        got = await base.read_back(audit, stream, None)
        horizon = await audit.horizon(stream)
    finally:
        await audit.close()
    assert [g.id for g in got] == [m.id for m in sent]
    assert horizon.first_id == sent[0].id


async def test_a_read_ends_at_the_last_entry_it_began_with_while_entries_keep_coming(
    redis_url: str, stream: str
) -> None:
    sent = [message(stream, f"k{n % 7}", n) for n in range(1, 2501)]  # three pages and more
    busy, stop = asyncio.Event(), asyncio.Event()
    async with base_publisher(redis_url) as pub, base_publisher(redis_url) as more_pub:
        assert await pub.publish(sent) == [None] * len(sent)

        async def keep_publishing() -> None:
            n = len(sent) + 1
            while not stop.is_set():
                assert await more_pub.publish([message(stream, "k", n)]) == [None]
                busy.set()
                n += 1

        more = asyncio.create_task(keep_publishing())
        audit = reader(redis_url)
        try:
            await busy.wait()
            await audit.connect()
            async with asyncio.timeout(20):
                got = await base.read_back(audit, stream, None)
        finally:
            stop.set()  # not cancel(): Python 3.11's wait_for, in the clients, can swallow it
            await more
            await audit.close()
    held = ids(await read_stream(redis_url, stream))
    assert len(sent) <= len(got) < len(held)  # it stopped; the publishing went on
    assert [g.id for g in got] == held[: len(got)]


async def test_reading_back_leaves_consumer_groups_as_they_were(
    redis_url: str, stream: str
) -> None:
    async with base_publisher(redis_url) as pub:
        assert await pub.publish([message(stream, "g", n) for n in range(1, 11)]) == [None] * 10
    async with redis_client(redis_url) as client:
        await client.xgroup_create(stream, "billing", id="0")
        await client.xreadgroup("billing", "worker", {stream: ">"}, count=4)  # 4 pending
        before = await client.xinfo_groups(stream)
        audit = reader(redis_url)
        try:
            await audit.connect()
            assert len(await base.read_back(audit, stream, None)) == 10
        finally:
            await audit.close()
        assert await client.xinfo_groups(stream) == before
        assert before[0]["pending"] == 4


async def test_a_key_that_holds_no_stream_reads_empty_and_the_horizon_says_why(
    redis_url: str, stream: str
) -> None:
    async with redis_client(redis_url) as client:
        await client.set(stream, "not a stream")
    audit = reader(redis_url, maxlen=1000)
    try:
        await audit.connect()
        assert await base.read_back(audit, stream, None) == []
        horizon = await audit.horizon(stream)
        assert horizon.problem == f"key {stream!r} holds no stream"
        assert (await audit.horizon(stream + ":never")).first is None  # none yet: no problem
    finally:
        await audit.close()


async def test_an_unreachable_server_is_a_read_back_error_that_names_the_broker() -> None:
    audit = reader(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(ReadBackError, match=r"^broker 'redis': cannot connect: "):
        await audit.connect()
    await audit.close()


async def test_the_documented_acl_reads_back_and_a_right_it_lacks_is_named(
    redis_factory: RedisFactory,
) -> None:
    """docs/brokers/redis.md: the relay's rights plus `+xrange +xrevrange +xinfo|stream`."""
    server = redis_factory()
    stream = unique_stream("acl-audit")
    rights = "+ping +client|setname +type +eval +evalsha +xadd +zmscore +zadd"
    rights += " +zremrangebyscore +pexpire +time +xrange +xrevrange +xinfo|stream"
    async with redis_client(server.url) as client:
        await client.acl_setuser(
            "relay",
            enabled=True,
            passwords=["+audit-s3cret"],
            keys=["relay-test:*", "outbox-relay:dedup:*"],
            commands=rights.split(),
        )
        async with base_publisher(server.url, username="relay", password="audit-s3cret") as pub:
            assert await pub.publish([message(stream, "k", n) for n in (1, 2)]) == [None] * 2
        audit = reader(server.url, username="relay", password="audit-s3cret")
        try:
            await audit.connect()
            assert [s.id for s in await base.read_back(audit, stream, None)] == [
                "book/k@1",
                "book/k@2",
            ]
            assert (await audit.horizon(stream)).first_id == "book/k@1"
            await client.acl_setuser("relay", commands=["-xinfo|stream"])
            with pytest.raises(ReadBackError, match="no permissions to run the 'xinfo") as refused:
                await audit.horizon(stream)
            assert str(refused.value).startswith(f"broker 'redis': cannot read stream {stream!r}")
            assert "audit-s3cret" not in str(refused.value)
        finally:
            await audit.close()
