"""Kafka publisher (aiokafka), CloudEvents Kafka binding in binary mode.

The message key is the record key, so one aggregate's messages share a partition (the
Java client's murmur2 partitioner) and keep their order there. A whole batch is written
before any acknowledgement is awaited, as explicit record batches, one per partition:

- A record batch is stored or rejected as a whole, so within one `publish` a later message
  of a partition is never stored while an earlier one is not. A partition's share that does
  not fit one record batch (`max_request_size`) goes out in a further wave, sent once the
  previous one is acknowledged; nothing is sent after a failed wave. This holds with the
  idempotent producer off too (which brokers such as tansu need).
- aiokafka keeps at most one produce request in flight per broker, mutes a partition while
  its batch is in flight, and puts a retried batch back at the head of its queue: its
  internal retries (until `ack_timeout`) do not reorder either.
- A batch not acknowledged within `ack_timeout` is reported transient and stays queued in
  aiokafka, ahead of anything sent to its partition later, so the relay's re-send lands
  after it: duplicates are possible (at least once), a reordering is not.

With `transactional_id`, each `publish` is one transaction: begin, send, commit what was
acknowledged before the first failure (abort if that is nothing). ProducerFenced means a
newer producer with the same id took over: this one is discarded, the batch is reported
transient, and the next attempt starts a new producer, which fences the other in turn.
Any other failure that leaves the producer unusable (a transaction timing out, an
idempotent producer's sequence error) discards it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import ssl
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    BrokerResponseError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumber,
    ProducerFenced,
    RecordListTooLargeError,
    TransactionalIdAuthorizationFailed,
    UnknownProducerId,
)
from aiokafka.partitioner import murmur2
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from relay.brokers._batch import connected, not_sent, ready
from relay.config import KafkaBrokerConfig
from relay.config.base import TlsConfig
from relay.core.publishing import Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError

log = structlog.get_logger("relay.brokers.kafka")

# Kafka's own rule for topic names (kafka.common.internals.Topic).
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _bad_topic(topic: str) -> InvalidTopicError | None:
    """The broker's rule for topic names, checked before anything goes out."""
    if _TOPIC.match(topic) and topic not in (".", ".."):
        return None
    return InvalidTopicError(f"{topic!r} is not a valid Kafka topic name")


def _too_large(size: int, limit: int) -> MessageSizeTooLargeError:
    return MessageSizeTooLargeError(
        f"the message is {size} bytes, above max_request_size ({limit})"
    )


# The record, or the record batch holding it, exceeds a size limit of the broker or topic.
_TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)

# The producer cannot be used any more: aiokafka stops its sender on these.
_FATAL = (
    ProducerFenced,
    OutOfOrderSequenceNumber,
    UnknownProducerId,
    TransactionalIdAuthorizationFailed,
)


@functools.lru_cache(maxsize=1 << 16)
def _key_hash(key: bytes) -> int:
    """The Java client's partitioner hash (aiokafka's DefaultPartitioner), kept per key.

    aiokafka's murmur2 is pure Python: a quarter of the relay's CPU on the Kafka path went
    into it. An aggregate's key comes back with each of its events, so it is hashed once.
    """
    return int(murmur2(key)) & 0x7FFFFFFF


@dataclass
class _Batch:
    """One record batch for one partition, and which messages of the call it holds."""

    topic: str
    partition: int
    builder: Any  # aiokafka.producer.message_accumulator.BatchBuilder
    indexes: list[int] = field(default_factory=list)
    size: int = 0  # the records' estimated size, as counted against the batch budget


class _Discard(Exception):
    """A failure after which the producer must not be used again."""


@dataclass
class _Tally:
    """One outcome per message of a publish, and whether it is final yet."""

    outcomes: list[Outcome]
    done: list[bool]

    @classmethod
    def of(cls, count: int) -> _Tally:
        return cls([None] * count, [False] * count)

    def record(self, indexes: Sequence[int], outcome: Outcome) -> None:
        for i in indexes:
            self.outcomes[i], self.done[i] = outcome, True

    def fill(self, failure: Outcome) -> None:
        """Every message without a final outcome yet gets `failure`."""
        self.record([i for i, final in enumerate(self.done) if not final], failure)

    def reopen_acknowledged(self) -> None:
        """A transaction failed: nothing it held is acknowledged before the commit."""
        for i, outcome in enumerate(self.outcomes):
            if outcome is None:
                self.done[i] = False

    def replace_acknowledged(self, failure: Outcome) -> None:
        for i, outcome in enumerate(self.outcomes):
            if outcome is None:
                self.outcomes[i] = failure


class KafkaPublisher:
    def __init__(self, name: str, config: KafkaBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._producer: AIOKafkaProducer | None = None
        # Bytes per record batch; halved when the broker says a batch of several records
        # is too large (a topic's max.message.bytes below max_request_size).
        self._batch_bytes = config.max_request_size
        self._log = log.bind(broker=name)
        self._stage = "connecting"  # what publish was waiting for, should ack_timeout expire
        self.duplicates = 0  # Kafka does not say when it dropped a duplicate
        self.last_duplicates: tuple[int, ...] = ()  # it cannot tell which
        self._ssl = tls_context(config)
        if config.transactional_id is not None and not config.enable_idempotence:
            self._log.warning(
                "transactional_id implies the idempotent producer; enable_idempotence: "
                "false is overridden"
            )

    # -- connection -------------------------------------------------------------------------

    async def connect(self) -> None:
        if self._producer is not None:
            return
        producer = self._new_producer()
        try:
            async with asyncio.timeout(self._config.connect_timeout):
                await producer.start()
        except (OSError, TimeoutError, KafkaError) as exc:
            await _stop(producer)
            raise TransientPublishError(
                f"broker {self.name!r}: cannot connect: {self._connect_error(exc)}"
            ) from exc
        except BaseException:
            await asyncio.shield(_stop(producer))
            raise
        self._producer = producer

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: connect and authenticate as a producer (never with the
        transactional id, which would fence a running relay's producer), and find each topic
        in the cluster's metadata, which creates none. Nothing is published; what is wrong,
        one line each."""
        c = self._config
        producer = AIOKafkaProducer(**self._options(transactional=False))
        try:
            async with asyncio.timeout(c.connect_timeout):
                await producer.start()
            async with asyncio.timeout(c.ack_timeout):
                metadata = await producer.client.fetch_all_metadata()
        except (OSError, TimeoutError, KafkaError) as exc:
            raise TransientPublishError(
                f"broker {self.name!r}: cannot connect: {self._connect_error(exc)}"
            ) from exc
        finally:
            await _stop(producer)
        topics = metadata.topics()
        problems = []
        for topic in sorted(destinations):
            if not _TOPIC.match(topic) or topic in (".", ".."):
                problems.append(f"broker {self.name!r}: {topic!r} is not a valid Kafka topic name")
            elif topic not in topics:
                problems.append(
                    f"broker {self.name!r}: topic {topic!r} does not exist: every message to it"
                    " would be retried for ever; create it"
                )
        return problems

    def _new_producer(self) -> AIOKafkaProducer:
        return AIOKafkaProducer(**self._options())

    def _options(self, *, transactional: bool = True) -> dict[str, Any]:
        """The producer's settings; `transactional=False` leaves out the transactional id."""
        c = self._config
        # Without its transactional id, a producer that has one is still idempotent.
        idempotent = c.enable_idempotence or (not transactional and c.transactional_id is not None)
        options: dict[str, Any] = {
            **connection_options(c, self._ssl),
            "acks": "all",
            "enable_idempotence": idempotent,
            "transactional_id": c.transactional_id if transactional else None,
            "compression_type": None if c.compression_type == "none" else c.compression_type,
            "max_request_size": c.max_request_size,
            # Explicit record batches are filled up to this (see _plan).
            "max_batch_size": c.max_request_size,
            "linger_ms": 0,
            # A produce request not answered within ack_timeout has failed; without
            # idempotence a queued batch also expires after this long.
            "request_timeout_ms": int(c.ack_timeout * 1000),
        }
        return options

    def _connect_error(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return f"no answer within {self._config.connect_timeout}s"
        text = _text(exc)
        if not isinstance(exc, BrokerResponseError):
            return text
        # Connected, then refused: InitProducerId is what an idempotent or transactional
        # producer asks for on start-up (Kafka-protocol brokers such as tansu lack it).
        if self._config.transactional_id is not None:
            # The client turns idempotence on for transactions whatever enable_idempotence
            # says, so that setting cannot be the way out.
            text += (
                " (a transactional producer needs InitProducerId, and transactions always use"
                " the idempotent producer, whatever enable_idempotence says: if the broker"
                " supports neither, remove transactional_id)"
            )
        elif self._config.enable_idempotence:
            text += (
                " (an idempotent producer also needs InitProducerId: if the broker does not"
                " support it, set enable_idempotence: false)"
            )
        return text

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _stop(producer)

    # -- publishing -------------------------------------------------------------------------

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if (done := await ready(self.connect, len(messages))) is not None:
            return done
        producer = connected(self._producer)
        tally = _Tally.of(len(messages))
        outcomes = tally.outcomes
        try:
            async with asyncio.timeout(self._config.ack_timeout):
                if self._config.transactional_id is None:
                    await self._send(producer, messages, tally)
                else:
                    await self._send_transaction(producer, messages, tally)
        except TimeoutError:
            reason = f"{self._stage}: no answer within {self._config.ack_timeout}s"
            if self._config.transactional_id is not None:
                await self._discard(reason)  # the transaction is still open
            # Otherwise the producer stays: aiokafka keeps retrying what it queued, ahead
            # of anything sent later to the same partition, so order holds either way.
            tally.fill(TransientPublishError(f"broker {self.name!r}: {reason}"))
        except _Discard as exc:
            await self._discard(str(exc))
            tally.fill(TransientPublishError(f"broker {self.name!r}: {exc}"))
        except Exception as exc:  # noqa: BLE001 - logged, reported transient, producer replaced
            self._log.error("unexpected error from the Kafka client", exc_info=True)
            await self._discard(_text(exc))
            tally.fill(
                TransientPublishError(f"broker {self.name!r}: unexpected error: {_text(exc)}")
            )
        except BaseException:
            # Cancelled: the lease was lost, or the shutdown grace is over. Stop publishing
            # now; shielded, so that a second cancellation cannot leave sockets open.
            await asyncio.shield(self._discard("publish cancelled"))
            raise
        if self._producer is producer and _dead(producer) and any(outcomes):
            # aiokafka's sender stopped (an error it does not recover from): every later
            # send would fail the same way.
            await self._discard("the producer's sender stopped")
        return outcomes

    async def _send(
        self, producer: AIOKafkaProducer, messages: Sequence[Message], tally: _Tally
    ) -> None:
        """Send wave after wave; stop at the first wave with a failure."""
        waves, rejected = await self._plan(producer, messages)
        failed = False
        for wave in waves:
            if not await self._send_wave(producer, wave, tally):
                failed = True
                break
        if rejected is not None and not failed and not tally.done[rejected[0]]:
            tally.record([rejected[0]], rejected[1])
        (held,) = not_sent(1, broker=self.name)
        tally.fill(held)

    async def _send_transaction(
        self, producer: AIOKafkaProducer, messages: Sequence[Message], tally: _Tally
    ) -> None:
        """One transaction per call. Everything before the first failure was acknowledged
        inside it, so that prefix is committed (the relay re-sends the rest, as without a
        transaction); with nothing to commit, the transaction is aborted. A producer that
        cannot go on (fenced, or no answer within ack_timeout) is discarded without either:
        the broker aborts the open transaction when the next producer with this id starts
        (or when the transaction times out)."""
        try:
            self._stage = "beginning a transaction"
            await producer.begin_transaction()
            await self._send(producer, messages, tally)
            if tally.outcomes[0] is None:
                self._stage = "committing the transaction"
                await producer.commit_transaction()
                return
            self._stage = "aborting the transaction"
            await producer.abort_transaction()
        except BaseException as exc:
            # Nothing is acknowledged before the commit returns.
            tally.reopen_acknowledged()
            if isinstance(exc, _FATAL):
                raise _Discard(self._fenced(exc)) from exc
            if isinstance(exc, KafkaError):
                raise _Discard(f"{self._stage} failed: {_text(exc)}") from exc
            raise
        aborted = TransientPublishError(
            f"broker {self.name!r}: transaction aborted: the batch's first message failed"
        )
        tally.replace_acknowledged(aborted)

    def _fenced(self, exc: BaseException) -> str:
        if isinstance(exc, ProducerFenced):
            self._log.error(
                "producer fenced: another producer uses the same transactional_id; "
                "starting a new producer, which fences the other one in turn",
                transactional_id=self._config.transactional_id,
            )
            return f"producer fenced (transactional_id {self._config.transactional_id!r})"
        return f"producer failed: {_text(exc)}"

    async def _plan(
        self, producer: AIOKafkaProducer, messages: Sequence[Message]
    ) -> tuple[list[dict[tuple[str, int], _Batch]], tuple[int, PublishError] | None]:
        """Group the messages into waves of record batches, one batch per partition per wave.

        Stops at the first message that no broker would take (an invalid topic name, a record
        above max_request_size): it gets that rejection and nothing after it is sent.
        """
        waves: list[dict[tuple[str, int], _Batch]] = []
        newest: dict[tuple[str, int], tuple[int, _Batch]] = {}  # partition -> (wave, batch)
        partitions: dict[str, list[int]] = {}
        limit = self._config.max_request_size
        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes
        for i, message in enumerate(messages):
            topic = message.destination
            in_topic = partitions.get(topic)
            if in_topic is None and (bad := _bad_topic(topic)) is not None:
                return waves, (i, self._classify(bad, 1, before_sending=True))
            key, body, headers = message.key.encode(), message.body, message_headers(message)
            size = estimate(key, body, headers)
            if size > limit:
                return waves, (i, self._classify(_too_large(size, limit), 1, before_sending=True))
            if in_topic is None:
                self._stage = f"waiting for the metadata of topic {topic!r}"
                try:
                    in_topic = partitions[topic] = sorted(await producer.partitions_for(topic))
                except _FATAL as exc:
                    raise _Discard(self._fenced(exc)) from exc
                except KafkaError as exc:
                    return waves, (i, self._classify(exc, 1))
            tp = (topic, in_topic[_key_hash(key) % len(in_topic)])
            w, batch = newest.get(tp, (-1, None))
            if (
                batch is None
                or batch.size + size > self._batch_bytes
                or batch.builder.append(timestamp=None, key=key, value=body, headers=headers)
                is None
            ):
                # The partition's next batch goes in the next wave: after the full one.
                w, batch = w + 1, _Batch(tp[0], tp[1], producer.create_batch())
                if w == len(waves):
                    waves.append({})
                waves[w][tp] = batch
                newest[tp] = (w, batch)
                appended = batch.builder.append(
                    timestamp=None, key=key, value=body, headers=headers
                )
                assert appended is not None, "an empty record batch takes any record"
            batch.indexes.append(i)
            batch.size += size
        return waves, None

    async def _send_wave(
        self,
        producer: AIOKafkaProducer,
        wave: dict[tuple[str, int], _Batch],
        tally: _Tally,
    ) -> bool:
        """Send one record batch per partition, await them all; False if any failed."""
        sent: list[tuple[_Batch, asyncio.Future[Any]]] = []
        ok = True
        self._stage = "waiting for acknowledgements"
        for batch in wave.values():
            try:
                future = await producer.send_batch(
                    batch.builder, batch.topic, partition=batch.partition
                )
            except _FATAL as exc:
                raise _Discard(self._fenced(exc)) from exc
            except KafkaError as exc:
                tally.record(batch.indexes, self._classify(exc, len(batch.indexes)))
                ok = False
                break
            future.add_done_callback(_consume)
            sent.append((batch, future))
        if sent:
            await asyncio.wait([future for _, future in sent])
        discard: BaseException | None = None
        for batch, future in sent:
            error = future.exception()
            if error is None:
                tally.record(batch.indexes, None)
                continue
            ok = False
            if isinstance(error, _FATAL):
                discard = error
                continue
            tally.record(batch.indexes, self._classify(error, len(batch.indexes)))
        if discard is not None:
            raise _Discard(self._fenced(discard)) from discard
        return ok

    def dedup_scope(self, destination: str) -> str | None:
        """Kafka keeps every message: its consumers drop duplicates by id, if at all."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`):
        its topic name, or its size against max_request_size. A topic's own
        max.message.bytes only the broker knows."""
        exc: KafkaError | None = _bad_topic(message.destination)
        if exc is None:
            key, headers = message.key.encode(), message_headers(message)
            size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, message.body, headers)
            if size <= (limit := self._config.max_request_size):
                return None
            exc = _too_large(size, limit)
        return str(self._classify(exc, 1, before_sending=True))

    def _classify(
        self, exc: BaseException, records: int, *, before_sending: bool = False
    ) -> PublishError:
        """`before_sending`: the adapter found it (a topic name, max_request_size), so no
        retry can mend it (UnsendableError); the same error from the broker stays retried."""
        text = f"broker {self.name!r}: {_text(exc)}"
        refused = UnsendableError if before_sending else PermanentPublishError
        if isinstance(exc, _TOO_LARGE):
            if records == 1:
                return refused(f"{text}: the record is too large")
            # The broker refused the record batch, not necessarily any one of its records:
            # send smaller batches from now on, down to one record each, which the broker
            # then accepts or rejects on the record's own merits.
            self._batch_bytes = max(self._batch_bytes // 2, 1)
            self._log.warning(
                "record batch too large for the broker; sending smaller batches "
                "(set max_request_size to at most the topic's max.message.bytes)",
                records=records,
                batch_bytes=self._batch_bytes,
            )
            return TransientPublishError(f"{text}: a batch of {records} records is too large")
        if isinstance(exc, InvalidTopicError):
            return refused(f"{text}: invalid topic")
        return TransientPublishError(text)

    async def _discard(self, reason: str) -> None:
        if self._producer is not None:
            self._log.info(
                "discarding the producer; the next batch starts a new one", reason=reason
            )
        await self.close()


def message_headers(message: Message) -> list[tuple[str, bytes]]:
    """CloudEvents Kafka binding: binary mode, or only the content type in structured mode."""
    # The record's key is the partition key here.
    attributes = cloudevent_attributes(message, "ce_", partition_key=False)
    headers = [(name, value.encode()) for name, value in attributes.items()]
    headers.append(("content-type", message.content_type.encode()))
    return headers


async def _stop(producer: AIOKafkaProducer) -> None:
    """Stop a producer at once, giving up what it still queues or has in flight; never raises.

    Whatever is left was never reported acknowledged, so the relay sends it again anyway:
    delivering it late would only add duplicates, or, after the lease moved to another
    replica, keep publishing from one that must stop. aiokafka's own stop() would wait for
    every queued batch, for ever while the broker is away if batches never expire (the
    idempotent producer retries until it succeeds).
    """
    with contextlib.suppress(Exception):
        await _abandon(producer)
    try:
        await producer.stop()
    except Exception:  # noqa: BLE001 - close never raises; the sockets are closed either way
        with contextlib.suppress(Exception):
            await producer.client.close()


async def _abandon(producer: AIOKafkaProducer) -> None:
    """Drop what is queued, cancel the sender and any request it awaits, fail the batches
    that were in flight; stop() then has nothing left to wait for.

    aiokafka has no API for this. Its MessageAccumulator.fail_all alone is not safe while
    the sender runs: a request in flight that then fails retriably re-enqueues a failed
    batch, and aiokafka raises KeyError from its sender or from a callback.
    """
    accumulator = producer._message_accumulator
    accumulator._batches.clear()
    task = producer._sender.sender_task
    # The first cancel makes the sender await its requests; the next ones cancel them.
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=0.05)
    accumulator.fail_all(KafkaError("producer discarded"))


def _dead(producer: AIOKafkaProducer) -> bool:
    """Whether the producer's background sender has stopped (aiokafka then fails every batch)."""
    task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    return task is not None and task.done()


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve the exception of a future nobody may await any more (a discarded batch)."""
    if not future.cancelled():
        future.exception()


def tls_context(config: KafkaBrokerConfig) -> ssl.SSLContext | None:
    """The TLS context when TLS is used (the config model checked that its files load)."""
    if config.security_protocol not in ("SSL", "SASL_SSL"):
        return None  # the config model refuses tls without them
    return (config.tls or TlsConfig()).context()


def connection_options(config: KafkaBrokerConfig, tls: ssl.SSLContext | None) -> dict[str, Any]:
    """What any aiokafka client of the broker needs to reach it and log in: the producer's,
    and the audit's consumer."""
    options: dict[str, Any] = {
        "bootstrap_servers": config.bootstrap_servers,
        "client_id": config.client_id,
        "security_protocol": config.security_protocol,
    }
    if tls is not None:
        options["ssl_context"] = tls
    if config.security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = config.sasl_mechanism or "PLAIN"
        options["sasl_plain_username"] = config.sasl_username
        if config.sasl_password is not None:
            options["sasl_plain_password"] = config.sasl_password.get_secret_value()
    return options


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
