"""Reading Kafka back for an audit: each partition of a topic, by offset, without a group.

All partitions of a topic are fetched together, each from the offset for the audit's start
time (ListOffsets by time; from its beginning offset without one) up to where it ended when
the read began (its last stable offset in the first fetch's answer), with `read_committed`:
what a transaction aborted is not counted as stored. The consumer
has no group: partitions are assigned, nothing is committed, and no consumer's offsets or
assignment change. The message id is the `ce_id` header, or the value's `id` in structured
mode. A record's time is its timestamp: the relay's clock when it sent it (CreateTime), or
the broker's with `message.timestamp.type=LogAppendTime`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection
from datetime import UTC, datetime
from itertools import dropwhile
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, KafkaTimeoutError

from relay.brokers.kafka import connection_options, tls_context
from relay.config import KafkaBrokerConfig
from relay.core.publishing import STRUCTURED
from relay.core.readback import Horizon, Stored, structured_id
from relay.errors import ReadBackError

FETCH = 1_000  # records taken from the consumer's buffer at a time
WAIT_MS = 200  # how long the broker holds a fetch that finds nothing (at a partition's end)
FETCH_BYTES = 16 * 1024 * 1024  # per fetch: what the consumer may hold ahead of the audit
STOP_WAIT = 2.0  # seconds `close` gives the consumer to stop before it cancels the stop
STALLED = 30.0  # seconds without a record, below the end offset, before a read gives up
_STRUCTURED = STRUCTURED.encode()
_FAILURES = (KafkaError, OSError, TimeoutError)


class KafkaReader:
    def __init__(self, name: str, config: KafkaBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._consumer: Any = None  # AIOKafkaConsumer, started
        self._admin: Any = None  # AIOKafkaAdminClient, started
        self._partitions: dict[str, list[int]] = {}  # topic -> its partitions, per read

    async def connect(self) -> None:
        if self._consumer is not None:
            return
        c = self._config
        options = {
            **connection_options(c, tls_context(c)),
            "request_timeout_ms": int(c.ack_timeout * 1000),
        }
        consumer = AIOKafkaConsumer(
            **options,
            group_id=None,  # no group: nothing joined, nothing committed
            enable_auto_commit=False,
            isolation_level="read_committed",
            auto_offset_reset="earliest",  # a start removed meanwhile: from the oldest held
            fetch_max_wait_ms=WAIT_MS,
            fetch_max_bytes=FETCH_BYTES,
        )
        admin = AIOKafkaAdminClient(**options)
        try:
            async with asyncio.timeout(c.connect_timeout):
                await consumer.start()
                await admin.start()
        except _FAILURES as exc:
            await _stop(consumer, admin)
            text = f"no answer within {c.connect_timeout}s" if _timeout(exc) else _text(exc)
            raise ReadBackError(f"broker {self.name!r}: cannot connect: {text}") from exc
        except BaseException:
            await asyncio.shield(_stop(consumer, admin))
            raise
        self._consumer, self._admin = consumer, admin

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        await self._topics()
        for topic in sorted(destinations):
            async for stored in self._read_topic(topic, since):
                yield stored

    async def horizon(self, destination: str) -> Horizon:
        partitions = await self._partitions_of(destination)
        if partitions is None:
            return Horizon(None, problem=f"topic {destination!r} does not exist")
        max_age, limits = await self._retention(destination)
        tps = [TopicPartition(destination, p) for p in partitions]
        beginning = await self._beginning(destination, tps)
        # The oldest of the partitions' first records: a loss in one partition is never put
        # down to another's retention. Two as old (one batch of the relay's, sent to several
        # partitions in one millisecond) cannot say which went out first: no id then, and
        # the audit compares times.
        firsts = [f async for f in self._scan(destination, beginning, first_only=True)]
        if not firsts:
            return Horizon(None, max_age=max_age, limits=limits)
        oldest = min(firsts, key=_age)
        tied = sum(_age(f) == _age(oldest) for f in firsts) > 1
        return Horizon(
            oldest.time,
            None if tied else oldest.id,
            max_age=max_age,
            limits=limits,
            where=f"topic {destination} {oldest.where}",
        )

    async def duplicate_window(self, destination: str) -> float | None:
        """Kafka drops no re-sent message by its id: a repair always lands."""
        return None

    async def close(self) -> None:
        consumer, admin, self._consumer, self._admin = self._consumer, self._admin, None, None
        self._partitions = {}
        await _stop(consumer, admin)

    # -- reading ------------------------------------------------------------------------------

    async def _read_topic(self, topic: str, since: datetime | None) -> AsyncIterator[Stored]:
        """The topic's records from `since` (each partition's first record stored then or
        later), up to where each partition ended when the read began."""
        partitions = await self._partitions_of(topic)
        if not partitions:
            return
        tps = [TopicPartition(topic, p) for p in partitions]
        if since is None:
            async for stored in self._scan(topic, await self._beginning(topic, tps)):
                yield stored
            return
        at = max(int(since.timestamp() * 1000), 0)
        async for stored in self._scan(topic, await self._offsets_for(topic, tps, at), at):
            yield stored

    async def _scan(
        self,
        topic: str,
        start: dict[Any, int],
        not_before: int | None = None,
        *,
        first_only: bool = False,
    ) -> AsyncIterator[Stored]:
        """The records of these partitions from their start offsets, fetched together, each
        partition's in offset order; from its first record stamped `not_before` (ms) or
        later, when given; only that first record with `first_only`.

        A partition's end is the last stable offset its first fetch answered, not ListOffsets
        (tansu answers the last record batch's base offset + 1 there, leaving out the rest of
        that batch); nothing later is read, so a read ends however busy the topic."""
        if not start:
            return
        consumer = self._connected()
        what = f"reading topic {topic!r}"
        end: dict[Any, int] = {}
        active = set(start)
        reached = set(start) if not_before is None else set()
        try:
            consumer.assign(list(start))
            for tp, offset in start.items():
                consumer.seek(tp, offset)
            stall = _Stall(self.name, what)
            while active:
                batch = await consumer.getmany(*active, timeout_ms=WAIT_MS, max_records=FETCH)
                for tp, records in batch.items():
                    bound = end.setdefault(tp, _bound(consumer, tp))
                    taken = [r for r in records if r.offset < bound]
                    ended = len(taken) < len(records)
                    if tp not in reached:
                        # The offset for a time may be a record batch's first (tansu's is):
                        # its records stamped earlier are left out here.
                        taken = list(dropwhile(lambda r: r.timestamp < not_before, taken))
                        if taken:
                            reached.add(tp)
                    for record in taken[:1] if first_only else taken:
                        yield _stored(record)
                    if ended or (first_only and taken):
                        active.discard(tp)
                        consumer.pause(tp)
                await _at_end(consumer, active, end)
                stall.check(bool(batch), len(active))
        except _FAILURES as exc:
            raise self._failed(what, exc) from exc
        finally:
            # Paused, the consumer fetches nothing more in the background. (Not unassigned:
            # aiokafka's fetcher then waits for a new assignment in a way that can swallow
            # the cancellation `stop` sends it, and `stop` never returns.)
            with contextlib.suppress(Exception):
                consumer.pause(*start)

    async def _offsets_for(self, topic: str, tps: list[TopicPartition], at: int) -> dict[Any, int]:
        """Each partition's first offset stamped `at` (ms) or later, for those that hold one.
        An answer with an earlier timestamp is no answer (tansu answers offset 0 and
        timestamp -1 where Kafka answers none)."""
        try:
            found = await self._connected().offsets_for_times({tp: at for tp in tps})
        except _FAILURES as exc:
            raise self._failed(f"cannot find offsets by time in topic {topic!r}", exc) from exc
        return {
            tp: answer.offset
            for tp in tps
            if (answer := found.get(tp)) is not None and answer.timestamp >= at
            if answer.offset >= 0
        }

    async def _beginning(self, topic: str, tps: list[TopicPartition]) -> dict[Any, int]:
        try:
            offsets: dict[Any, int] = await self._connected().beginning_offsets(tps)
        except _FAILURES as exc:
            raise self._failed(f"cannot read the offsets of topic {topic!r}", exc) from exc
        return offsets

    # -- metadata -----------------------------------------------------------------------------

    async def _topics(self) -> None:
        """Every topic's partitions, from the cluster's metadata: asking for one topic by name
        would create it where topics are created on first use."""
        try:
            topics = await self._connected_admin().describe_topics()
        except _FAILURES as exc:
            raise self._failed("cannot read the cluster's metadata", exc) from exc
        self._partitions = {
            t["topic"]: sorted(p["partition"] for p in t["partitions"])
            for t in topics
            if t["error_code"] == 0
        }

    async def _partitions_of(self, topic: str) -> list[int] | None:
        if topic not in self._partitions:
            await self._topics()
        return self._partitions.get(topic)

    async def _retention(self, topic: str) -> tuple[float | None, str | None]:
        """`retention.ms` (when old records are deleted) and the limits that remove records
        otherwise, as far as the server tells; nothing when it does not (tansu answers no
        entry), and the audit then calls a lost record missing, never expired."""
        resource = ConfigResource(ConfigResourceType.TOPIC, topic)  # all: tansu takes no names
        try:
            (response,) = await self._connected_admin().describe_configs([resource])
            (answer,) = response.to_object()["resources"]
        except _FAILURES:
            return None, None
        except ValueError:
            return None, None  # not one resource back: nothing it says can be trusted
        if answer["error_code"]:
            return None, None
        entries = {e["config_name"]: e["config_value"] for e in answer["config_entries"]}
        policy = entries.get("cleanup.policy") or ""
        limits = []
        max_age = None
        if "delete" in policy or not policy:
            retention_ms = _number(entries.get("retention.ms"))
            if retention_ms is not None and retention_ms >= 0:
                max_age = retention_ms / 1000
            retention_bytes = _number(entries.get("retention.bytes"))
            if retention_bytes is not None and retention_bytes >= 0:
                limits.append(f"retention.bytes {retention_bytes}")
        if "compact" in policy:
            limits.append("cleanup.policy compact (older records of a key are removed)")
        return max_age, ", ".join(limits) or None

    def _connected(self) -> Any:
        if self._consumer is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        return self._consumer

    def _connected_admin(self) -> Any:
        if self._admin is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        return self._admin

    def _failed(self, what: str, exc: BaseException) -> ReadBackError:
        late = _timeout(exc)
        text = f"no answer within {self._config.ack_timeout}s" if late else _text(exc)
        return ReadBackError(f"broker {self.name!r}: {what}: {text}")


class _Stall:
    """Gives up a read that gets no record for STALLED seconds before its end."""

    def __init__(self, broker: str, what: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._broker, self._what = broker, what
        self._deadline = self._loop.time() + STALLED

    def check(self, progressed: bool, left: int) -> None:
        if progressed:
            self._deadline = self._loop.time() + STALLED
        elif left and self._loop.time() > self._deadline:
            raise ReadBackError(
                f"broker {self._broker!r}: {self._what}: no record for {STALLED:g}s from"
                f" {left} partition(s) below the end they had when the read began"
            )


async def _at_end(consumer: Any, active: set[Any], end: dict[Any, int]) -> None:
    """Take out of `active` (and pause) each partition read up to its end."""
    for tp in list(active):
        if tp not in end:
            if (bound := _bound(consumer, tp)) < 0:
                continue  # no fetch answered yet
            end[tp] = bound
        if await consumer.position(tp) >= end[tp]:
            active.discard(tp)
            consumer.pause(tp)


def _bound(consumer: Any, tp: TopicPartition) -> int:
    """Where the partition ended in the last fetch's answer: its last stable offset (under
    read_committed), else its high watermark; -1 before any answer."""
    lso = consumer.last_stable_offset(tp)
    if lso is not None and lso >= 0:
        return int(lso)
    highwater = consumer.highwater(tp)
    return -1 if highwater is None else int(highwater)


def _age(stored: Stored) -> datetime:
    """What the oldest record is chosen by: its time (without one, it is not the oldest)."""
    return stored.time or datetime.max.replace(tzinfo=UTC)


def _stored(record: Any) -> Stored:
    found = None
    structured = False
    for name, value in record.headers:
        if name == "ce_id":
            found = value.decode(errors="replace")
            break
        if name == "content-type":
            structured = value == _STRUCTURED
    if found is None and structured and record.value is not None:
        found = structured_id(record.value)
    when = datetime.fromtimestamp(record.timestamp / 1000, UTC) if record.timestamp >= 0 else None
    return Stored(found, record.topic, when, f"partition {record.partition} @ {record.offset}")


def _number(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError | KafkaTimeoutError)


async def _stop(consumer: Any, admin: Any) -> None:
    """Stop both clients; never raises. aiokafka's consumer can swallow the cancellation its
    stop sends its fetcher (when that is waiting for a reassignment): cancelling the stop
    again sends the fetcher another."""
    if consumer is not None:
        stopping = asyncio.ensure_future(consumer.stop())
        done, _ = await asyncio.wait([stopping], timeout=STOP_WAIT)
        while not done:
            stopping.cancel()
            done, _ = await asyncio.wait([stopping], timeout=0.05)
        with contextlib.suppress(BaseException):
            stopping.result()
    if admin is not None:
        with contextlib.suppress(Exception):
            await admin.close()


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
