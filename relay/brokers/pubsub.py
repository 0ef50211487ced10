"""Google Cloud Pub/Sub publisher, with google-cloud-pubsub's PublisherClient.

A message's `destination` is a topic id of the configured project (`loans`) or a topic's
full name (`projects/<project>/topics/<topic>`). The message key is the ordering key, with
message ordering on, so each key's messages are stored in publish order. The id and the
CloudEvents attributes travel as message attributes (the Pub/Sub binding: `ce-` prefix,
binary mode; `content-type` holds the data's content type).

The client is thread based: `publish` hands each message to the client, which batches
them per topic and ordering key (`max_messages`, `max_bytes`, `max_latency`) and sends
each key's batches one after the other from its own threads. Its futures are awaited with
`asyncio.wrap_future`, all of a batch within `ack_timeout`.

Retries are the outbox's, as for every broker: each Publish call is made once
(`retry=None`; with ordering on, the client would otherwise retry for ever). When a call
fails the client pauses its ordering key: later messages of the key fail at once, until
`resume_publish`. The publisher resumes every key that failed before `publish` returns, and
a key whose call was still in flight when the batch gave up is resumed when the call ends,
so a failure never leaves a key stuck; the outbox sends again from the first failure, in
order.

Pub/Sub has no publisher-side deduplication: a re-sent message is stored again, and
consumers deduplicate on the `ce-id` attribute. Messages of a batch stored after the first
failure are remembered for a while and not sent again when the outbox re-sends them.

The Pub/Sub limits no emulator enforces are checked before sending, so that such a
message is refused for good, naming the limit, instead of failing in production only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
from google.api_core import exceptions as api_exceptions
from google.cloud.pubsub_v1 import PublisherClient
from google.cloud.pubsub_v1.publisher import exceptions as publisher_exceptions
from google.cloud.pubsub_v1.types import BatchSettings, PublisherOptions
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport

from relay.brokers._batch import Accepted, not_sent, ready
from relay.config.brokers import PubSubBrokerConfig
from relay.core.publishing import Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt

MAX_MESSAGE_BYTES = 10_000_000  # data, attributes and ordering key (the client's own limit)
MAX_ATTRIBUTES = 100
MAX_ATTRIBUTE_NAME_BYTES = 256
MAX_ATTRIBUTE_VALUE_BYTES = 1024
MAX_ORDERING_KEY_BYTES = 1024
REMEMBER_FOR = 600.0  # seconds an accepted message is remembered, so not sent again
DEFAULT_ENDPOINT = "pubsub.googleapis.com:443"

# A topic id: 3-255 characters, a letter first, not starting with `goog`.
_TOPIC_ID = re.compile(r"(?!goog)[A-Za-z][A-Za-z0-9._~+%-]{2,254}")
_TOPIC_PATH = re.compile(r"projects/([^/]+)/topics/([^/]+)")
_HASHED_KEY = re.compile(r"~sha256:[0-9a-f]{64}")
# The channel reconnects by itself; after an outage, within 2 s rather than gRPC's 2 min.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
# The topic, the project or the caller's rights are wrong: the operator's to fix, so
# retried for ever like a missing stream or queue, never parked (`relay check` names them).
_SETUP_FAULTS = (
    api_exceptions.NotFound,
    api_exceptions.PermissionDenied,
    api_exceptions.Unauthenticated,
)
_MESSAGE_FAULTS = (api_exceptions.InvalidArgument, publisher_exceptions.MessageTooLargeError)


@dataclass(frozen=True, slots=True)
class _Prepared:
    topic: str
    data: bytes
    ordering_key: str
    attributes: dict[str, str]


class PubSubPublisher:
    def __init__(self, name: str, config: PubSubBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._client: PublisherClient | None = None
        self._channel: grpc.Channel | None = None
        self._stuck: set[tuple[str, str]] = set()  # keys paused after `publish` returned
        self._stuck_lock = threading.Lock()
        self._accepted = Accepted(REMEMBER_FOR)
        self._topics: dict[str, str | PublishError] = {}
        self.duplicates = 0
        self.last_duplicates: tuple[int, ...] = ()  # Pub/Sub cannot tell

    # -- the client ----------------------------------------------------------------------------

    async def connect(self) -> None:
        """Make the client and wait until its channel is connected (TLS and all)."""
        if self._client is not None:
            return
        c = self._config
        channel = await connected_channel(self.name, c)
        self._channel = channel
        self._client = PublisherClient(
            batch_settings=BatchSettings(
                max_bytes=c.max_bytes, max_latency=c.max_latency, max_messages=c.max_messages
            ),
            publisher_options=PublisherOptions(enable_message_ordering=True),
            transport=PublisherGrpcTransport(channel=channel),
        )

    async def close(self) -> None:
        """Close the channel: calls in flight end at once (cancelled), nothing waits."""
        channel, self._channel, self._client = self._channel, None, None
        with self._stuck_lock:
            self._stuck.clear()  # they belong to the old client
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: connect (credentials included) and ask for each topic
        (GetTopic); without one, list the project's topics. Publishes nothing."""
        await self.connect()
        try:
            if not destinations:
                problem = await self._probe_call(
                    f"projects/{self._config.project}",
                    lambda: self._admin().list_topics(
                        request={"project": f"projects/{self._config.project}", "page_size": 1},
                        timeout=self._config.ack_timeout,
                    ),
                )
                return [problem] if problem else []
            problems = []
            for destination in sorted(destinations):
                topic = self._topic(destination)
                if isinstance(topic, PublishError):
                    problems.append(str(topic))
                elif problem := await self._probe_call(topic, self._get_topic(topic)):
                    problems.append(problem)
            return problems
        finally:
            await self.close()

    def _admin(self) -> PublisherClient:
        assert self._client is not None
        return self._client

    def _get_topic(self, topic: str) -> Any:
        return lambda: self._admin().get_topic(topic=topic, timeout=self._config.ack_timeout)

    async def _probe_call(self, what: str, call: Any) -> str | None:
        try:
            await asyncio.to_thread(call)
        except api_exceptions.NotFound:
            return (
                f"broker {self.name!r}: topic {what!r} does not exist: every message to it"
                " would be retried for ever; create it"
            )
        except Exception as exc:  # noqa: BLE001 - each becomes a line of the report
            return str(self._error(exc, what))
        return None

    # -- publishing ----------------------------------------------------------------------------

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if (done := await ready(self.connect, len(messages))) is not None:
            return done
        client = self._admin()
        self._resume_stuck(client)
        outcomes: list[Outcome] = [None] * len(messages)
        pending: list[tuple[int, _Prepared, asyncio.Future[Any]]] = []
        refused_at = len(messages)
        for index, message in enumerate(messages):
            if self._accepted.take(message):
                self.duplicates += 1  # stored before: the outbox re-sends after a failure
                continue
            prepared = self._prepare(message)
            if isinstance(prepared, PublishError):
                # Nothing after it is sent, so that no later message overtakes it.
                outcomes[index], refused_at = prepared, index
                break
            try:
                future = self._send(client, prepared)
            except Exception as exc:  # noqa: BLE001 - classified, not swallowed
                outcomes[index], refused_at = self._error(exc, prepared.topic), index
                break
            pending.append((index, prepared, asyncio.wrap_future(future)))
        for index in range(refused_at + 1, len(messages)):
            outcomes[index] = not_sent(1, broker=self.name)[0]
        await self._await_acks(client, pending, outcomes)
        self._accepted.remember(messages, outcomes)
        return outcomes

    def _send(self, client: PublisherClient, prepared: _Prepared) -> Future[str]:
        future: Future[str] = client.publish(
            prepared.topic,
            prepared.data,
            ordering_key=prepared.ordering_key,
            retry=None,  # the outbox retries; with ordering on, the client would for ever
            timeout=self._config.ack_timeout,
            **prepared.attributes,
        )
        return future

    async def _await_acks(
        self,
        client: PublisherClient,
        pending: list[tuple[int, _Prepared, asyncio.Future[Any]]],
        outcomes: list[Outcome],
    ) -> None:
        """Every acknowledgement within `ack_timeout`; every key that failed resumed."""
        if not pending:
            return
        waiting = [future for _, _, future in pending]
        try:
            _, late = await asyncio.wait(waiting, timeout=self._config.ack_timeout)
        except asyncio.CancelledError:
            for future in waiting:
                future.cancel()
            with self._stuck_lock:  # their calls may still fail and pause their keys
                self._stuck.update((p.topic, p.ordering_key) for _, p, _ in pending)
            raise
        failed: set[tuple[str, str]] = set()
        for index, prepared, future in pending:
            if future in late:
                future.cancel()
                outcomes[index] = TransientPublishError(
                    f"broker {self.name!r}: topic {prepared.topic!r}: no acknowledgement"
                    f" within {self._config.ack_timeout}s"
                )
                failed.add((prepared.topic, prepared.ordering_key))
            elif (exc := future.exception()) is not None:
                outcomes[index] = self._error(exc, prepared.topic)
                failed.add((prepared.topic, prepared.ordering_key))
        for topic, key in failed:
            if key:
                self._resume(client, topic, key)

    def _resume(self, client: PublisherClient, topic: str, key: str) -> None:
        """Resume a paused key; a key whose call is still in flight is not paused yet, and
        is remembered, to be resumed before the next batch."""
        try:
            client.resume_publish(topic, key)
        except RuntimeError:  # "not paused": a call of the key is still in flight
            with self._stuck_lock:
                self._stuck.add((topic, key))

    def _resume_stuck(self, client: PublisherClient) -> None:
        with self._stuck_lock:
            stuck, self._stuck = self._stuck, set()
        for topic, key in stuck:
            with contextlib.suppress(RuntimeError, ValueError):  # not paused (any more)
                client.resume_publish(topic, key)

    # -- messages to Pub/Sub messages ----------------------------------------------------------

    def dedup_scope(self, destination: str) -> str | None:
        """Pub/Sub keeps every message: its consumers drop duplicates by id, if at all."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`)."""
        prepared = self._prepare(message)
        return str(prepared) if isinstance(prepared, PublishError) else None

    def _prepare(self, message: Message) -> _Prepared | PublishError:
        topic = self._topic(message.destination)
        if isinstance(topic, PublishError):
            return topic
        attributes = message_attributes(message)
        if problem := attribute_problem(attributes):
            return self._refused(message, problem)
        key = ordering_key(message.key)
        key_size = len(key.encode())
        if key_size > MAX_ORDERING_KEY_BYTES:  # structured mode: no ce-partitionkey to refuse
            return self._refused(
                message,
                f"the key is {key_size:,} bytes; Pub/Sub takes an ordering key of at most"
                f" {MAX_ORDERING_KEY_BYTES:,}",
            )
        size = len(message.body) + key_size
        size += sum(len(n.encode()) + len(v.encode()) for n, v in attributes.items())
        if size > MAX_MESSAGE_BYTES:
            return self._refused(
                message,
                f"{size:,} bytes (data, attributes and ordering key) is more than Pub/Sub's"
                f" maximum of {MAX_MESSAGE_BYTES:,}",
            )
        return _Prepared(topic, message.body, key, attributes)

    def _topic(self, destination: str) -> str | PublishError:
        """The topic's full name, or why `destination` cannot be one (checked once each)."""
        known = self._topics.get(destination)
        if known is None:
            known = self._topics[destination] = self._topic_of(destination)
            if len(self._topics) > 10_000:  # destinations from templates: keep it bounded
                self._topics.clear()
        return known

    def _topic_of(self, destination: str) -> str | PublishError:
        full = topic_path(destination, self._config.project)
        if full is None:
            return UnsendableError(
                f"broker {self.name!r}: {destination!r} is not a topic id nor a topic's full"
                " name (a topic id has 3-255 letters, digits or - _ . ~ + %, starts with a"
                " letter and not with 'goog')"
            )
        return full

    def _refused(self, message: Message, reason: str) -> UnsendableError:
        return UnsendableError(f"broker {self.name!r}: message {excerpt(message.id)}: {reason}")

    # -- errors --------------------------------------------------------------------------------

    def _error(self, exc: BaseException, topic: str) -> PublishError:
        text = f"broker {self.name!r}: topic {topic!r}: {error_text(exc)}"
        if isinstance(exc, _MESSAGE_FAULTS):
            return PermanentPublishError(text)
        if isinstance(exc, api_exceptions.NotFound):
            return TransientPublishError(f"{text} (the topic does not exist)")
        if isinstance(exc, publisher_exceptions.PublishToPausedOrderingKeyException) or (
            isinstance(exc, RuntimeError) and "prior ordered message" in str(exc)
        ):
            return TransientPublishError(
                f"broker {self.name!r}: topic {topic!r}: not sent: an earlier message of its"
                " ordering key failed"
            )
        return TransientPublishError(text)


async def connected_channel(name: str, config: PubSubBrokerConfig) -> grpc.Channel:
    """A gRPC channel to Pub/Sub (or the emulator), connected within connect_timeout: the
    publisher's and the audit's. TransientPublishError when it cannot be made."""
    try:
        channel = await asyncio.to_thread(open_channel, config)
    except Exception as exc:  # credentials, files: each is named
        raise TransientPublishError(f"broker {name!r}: cannot connect: {error_text(exc)}") from exc
    ready = grpc.channel_ready_future(channel)
    try:
        await asyncio.to_thread(ready.result, config.connect_timeout)
    except grpc.FutureTimeoutError as exc:
        ready.cancel()
        channel.close()
        where = config.emulator_host or config.endpoint or DEFAULT_ENDPOINT
        raise TransientPublishError(
            f"broker {name!r}: cannot connect to {where} within {config.connect_timeout}s"
        ) from exc
    except BaseException:
        ready.cancel()
        channel.close()
        raise
    return channel


def open_channel(config: PubSubBrokerConfig) -> grpc.Channel:
    """Plaintext to an emulator; else TLS with the credentials (blocking: ADC may ask the
    metadata server). The publisher's scopes serve the subscriber too (cloud-platform and
    pubsub)."""
    c = config
    if c.emulator_host is not None:
        return grpc.insecure_channel(c.emulator_host, options=_CHANNEL_OPTIONS)
    if c.credentials_file is not None:
        from google.oauth2 import service_account  # noqa: PLC0415 - only when configured

        credentials: Any = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
            c.credentials_file, scopes=PublisherGrpcTransport.AUTH_SCOPES
        )
    else:
        import google.auth  # noqa: PLC0415 - only without a key file

        credentials, _ = google.auth.default(scopes=PublisherGrpcTransport.AUTH_SCOPES)
    channel: grpc.Channel = PublisherGrpcTransport.create_channel(
        c.endpoint or DEFAULT_ENDPOINT, credentials=credentials, options=_CHANNEL_OPTIONS
    )
    return channel


def topic_path(destination: str, project: str) -> str | None:
    """The full name of the topic a destination names (a topic id of `project`, or a full
    name); None when it names none."""
    if match := _TOPIC_PATH.fullmatch(destination):
        topic_id, full = match.group(2), destination
    else:
        topic_id, full = destination, f"projects/{project}/topics/{destination}"
    return full if _TOPIC_ID.fullmatch(topic_id) else None


def message_attributes(message: Message) -> dict[str, str]:
    """The CloudEvents Pub/Sub binding, binary mode: `ce-` attributes, and `content-type`."""
    attributes = cloudevent_attributes(message, "ce-")
    attributes["content-type"] = message.content_type
    return attributes


def attribute_problem(attributes: dict[str, str]) -> str | None:
    """Why Pub/Sub would refuse these attributes (the emulator does not check), or None."""
    if len(attributes) > MAX_ATTRIBUTES:
        return f"{len(attributes)} attributes; Pub/Sub takes at most {MAX_ATTRIBUTES}"
    for name, value in attributes.items():
        if len(name.encode()) > MAX_ATTRIBUTE_NAME_BYTES:
            return f"attribute name {name[:40]!r}... is over {MAX_ATTRIBUTE_NAME_BYTES} bytes"
        if name.startswith("goog"):
            return f"attribute name {name!r}: names starting with 'goog' are Google's"
        size = len(value.encode())
        if size > MAX_ATTRIBUTE_VALUE_BYTES:
            return (
                f"attribute {name} is {size:,} bytes; Pub/Sub takes at most"
                f" {MAX_ATTRIBUTE_VALUE_BYTES:,} bytes per attribute value"
            )
    return None


def ordering_key(key: str) -> str:
    """The message key as the ordering key. An empty key (which Pub/Sub reads as "no
    order") and a key of the hashed shape become `~sha256:` and the key's digest, so that
    they keep their order and share no other key's; `ce-partitionkey` holds the key as is.
    A key over 1 KiB never gets here: its `ce-partitionkey` is refused first."""
    if key and not _HASHED_KEY.fullmatch(key):
        return key
    return "~sha256:" + hashlib.sha256(key.encode()).hexdigest()


def error_text(exc: BaseException) -> str:
    """A Pub/Sub error in one line: its gRPC status and its message."""
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        status = exc.grpc_status_code
        return f"{status.name if status is not None else exc.code}: {exc.message}"
    return str(exc) or type(exc).__name__
