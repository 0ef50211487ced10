"""Reading Google Cloud Pub/Sub back for an audit, through a subscription of its own.

A topic keeps nothing a reader can ask for: messages are kept by subscriptions. So the
operator gives the audit a subscription on each topic (`audit_subscription`, a template
with `{topic}`), made for it alone, with `retain_acked_messages` (or topic retention),
message ordering, no filter and pull delivery; the reader checks all of it first and
refuses (CannotReadBack) what would make it miss messages.

A read seeks the subscription to the audit's start time (Seek: every message it keeps from
then on is marked unacknowledged), then pulls and acknowledges until it is drained: no
message for DRAINED seconds over at least two pulls that waited for one, or two pulls in a
row bringing only messages published after the read began (a topic the relay keeps
publishing to is never empty). Pub/Sub tells no subscriber how many messages it holds (the
backlog is a Cloud Monitoring metric), so that is as exact as a read can be. The id is the
`ce-id` attribute, or the body's `id` in structured mode; the time is `publish_time`. A
message delivered twice to the audit (an acknowledgement lost) is counted once.

The emulator does not implement Seek to a time. There, a read keeps the subscription's
state with a snapshot instead: it snapshots the subscription, reads and acknowledges
everything it holds, and seeks back to the snapshot (which the emulator does implement).
That needs every message of the subscription left unacknowledged, which the reader sees to;
it reads the whole subscription every time, so it is for the emulator, not for production.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import grpc
from google.api_core import exceptions as api_exceptions
from google.pubsub_v1 import SubscriberClient
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from relay.brokers.pubsub import connected_channel, error_text, topic_path
from relay.config.brokers import PubSubBrokerConfig
from relay.core.publishing import STRUCTURED
from relay.core.readback import Horizon, Stored, structured_id
from relay.errors import CannotReadBack, ReadBackError, TransientPublishError

PULL_MAX = 1_000  # messages a Pull returns at most (Pub/Sub's limit)
PULL_WAIT = 2.0  # seconds a Pull may wait for a message (the emulator answers [] after 1)
DRAINED = 2.0  # seconds without a message, over two pulls at least, that end a read
SEEN_KEPT = 100_000  # Pub/Sub message ids remembered, to count a re-delivery once

T = TypeVar("T")


class PubSubReader:
    def __init__(self, name: str, config: PubSubBrokerConfig) -> None:
        if config.audit_subscription is None:
            raise CannotReadBack(
                f"broker {name!r} (pubsub) cannot be read back without a subscription of its"
                " own: a topic keeps nothing a reader can ask for; create a subscription for"
                " the audit on each topic, with retain_acked_messages and message ordering,"
                f' and name it in brokers.{name}.audit_subscription (for example "{{topic}}'
                '-audit")'
            )
        self.name = name
        self._config = config
        self._template = config.audit_subscription
        self._channel: grpc.Channel | None = None
        self._client: SubscriberClient | None = None
        self._seeks_by_time: bool | None = None  # None until a Seek to a time was tried

    async def connect(self) -> None:
        if self._client is not None:
            return
        try:
            self._channel = await connected_channel(self.name, self._config)
        except TransientPublishError as exc:
            raise ReadBackError(str(exc)) from exc
        self._client = SubscriberClient(transport=SubscriberGrpcTransport(channel=self._channel))

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        for destination in sorted(set(destinations)):
            subscription, retention = await self._checked(destination)
            async with self._rewound(subscription, since, retention):
                async for stored in self._drain(destination, subscription, since):
                    yield stored

    async def horizon(self, destination: str) -> Horizon:
        """Pub/Sub keeps messages by age alone: the oldest a subscription can hold was
        published its retention ago, and that is the horizon's time once it holds any (to
        find the oldest one itself would be to read it all)."""
        subscription, retention = await self._checked(destination)
        where = f"subscription {subscription} (keeps {retention})"
        max_age = retention.total_seconds()
        async with self._rewound(subscription, None, retention):
            received = await self._pull(subscription, wait=PULL_WAIT)
            if received:  # not left leased: the next read would wait out its deadline
                await self._acknowledge(subscription, [r.ack_id for r in received])
        if not received:
            return Horizon(None, max_age=max_age, where=where)
        return Horizon(datetime.now(UTC) - retention, max_age=max_age, where=where)

    async def duplicate_window(self, destination: str) -> float | None:
        return None  # Pub/Sub stores every message it is sent

    async def close(self) -> None:
        channel, self._channel, self._client = self._channel, None, None
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()

    # -- the audit's subscription ------------------------------------------------------------

    def _subscription_of(self, topic: str) -> str:
        """The audit's subscription of a topic (its full name), from the template."""
        name = self._template.replace("{topic}", topic.rpartition("/")[2])
        if name.startswith("projects/"):
            return name
        return f"projects/{self._config.project}/subscriptions/{name}"

    async def _checked(self, destination: str) -> tuple[str, timedelta]:
        """The audit's subscription of the destination's topic and how long it keeps
        messages, once it is known to receive all of them and to keep what is
        acknowledged; CannotReadBack otherwise."""
        topic = topic_path(destination, self._config.project)
        if topic is None:
            raise CannotReadBack(f"broker {self.name!r}: {destination!r} names no topic")
        subscription = self._subscription_of(topic)
        try:
            info = await self._call(
                subscription,
                lambda c: c.get_subscription(
                    subscription=subscription, timeout=self._config.ack_timeout
                ),
                (api_exceptions.NotFound,),
            )
        except api_exceptions.NotFound as exc:
            raise self._refused(
                subscription,
                f"does not exist: create it on topic {topic!r}, with retain_acked_messages",
            ) from exc
        problem = _unfit(info, topic)
        if problem is not None:
            raise self._refused(subscription, problem)
        retention = max(
            _duration(info.message_retention_duration),
            _duration(info.topic_message_retention_duration),
        )
        return subscription, retention or timedelta(days=7)  # Pub/Sub's default

    def _refused(self, subscription: str, why: str) -> CannotReadBack:
        return CannotReadBack(
            f"broker {self.name!r}: the audit's subscription {subscription!r} {why}"
            f" (brokers.{self.name}.audit_subscription)"
        )

    # -- reading -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _rewound(
        self, subscription: str, since: datetime | None, retention: timedelta
    ) -> AsyncIterator[None]:
        """The subscription with every message it keeps from `since` on unacknowledged
        (from the oldest it keeps without one): a Seek to that time. Where Seek takes no
        time (the emulator), a snapshot keeps its state while it is read and acknowledged,
        and it is put back after."""
        if self._seeks_by_time is not False:
            oldest = datetime.now(UTC) - retention - timedelta(hours=1)
            try:
                await self._seek(
                    subscription, (api_exceptions.MethodNotImplemented,), time=since or oldest
                )
            except api_exceptions.MethodNotImplemented:
                self._seeks_by_time = False
            else:
                self._seeks_by_time = True
                yield
                return
        snapshot = _snapshot_of(subscription)
        try:
            await self._create_snapshot(subscription, snapshot)
        except api_exceptions.AlreadyExists:  # left by a read that did not end
            await self._put_back(subscription, snapshot)
            await self._create_snapshot(subscription, snapshot)
        try:
            yield
        finally:
            await self._put_back(subscription, snapshot)

    async def _put_back(self, subscription: str, snapshot: str) -> None:
        """The subscription as it was when the snapshot was made; the snapshot deleted."""
        await self._seek(subscription, snapshot=snapshot)
        await self._call(
            subscription,
            lambda c: c.delete_snapshot(snapshot=snapshot, timeout=self._config.ack_timeout),
        )

    async def _create_snapshot(self, subscription: str, snapshot: str) -> None:
        request = {"name": snapshot, "subscription": subscription}
        await self._call(
            subscription,
            lambda c: c.create_snapshot(request=request, timeout=self._config.ack_timeout),
            (api_exceptions.AlreadyExists,),
        )

    async def _seek(
        self, subscription: str, passing: tuple[type[Exception], ...] = (), **target: Any
    ) -> None:
        request = {"subscription": subscription, **target}
        await self._call(
            subscription,
            lambda c: c.seek(request=request, timeout=self._config.ack_timeout),
            passing,
        )

    async def _acknowledge(self, subscription: str, ack_ids: list[str]) -> None:
        await self._call(
            subscription,
            lambda c: c.acknowledge(
                subscription=subscription, ack_ids=ack_ids, timeout=self._config.ack_timeout
            ),
        )

    async def _drain(
        self, destination: str, subscription: str, since: datetime | None
    ) -> AsyncIterator[Stored]:
        """Pull and acknowledge until the subscription is drained (see the module)."""
        loop = asyncio.get_running_loop()
        began = datetime.now(UTC)
        quiet_since, empty_pulls, only_new = loop.time(), 0, 0
        seen: set[str] = set()
        order: deque[str] = deque()
        while True:
            received = await self._pull(subscription, wait=PULL_WAIT)
            if not received:
                empty_pulls += 1
                if empty_pulls >= 2 and loop.time() - quiet_since >= DRAINED:
                    return
                continue
            await self._acknowledge(subscription, [r.ack_id for r in received])
            quiet_since, empty_pulls = loop.time(), 0
            new = 0
            for item in received:
                message = item.message
                published = _utc(message.publish_time)
                new += published is not None and published > began
                if message.message_id in seen:
                    continue  # delivered again: an acknowledgement was lost
                seen.add(message.message_id)
                order.append(message.message_id)
                if len(order) > SEEN_KEPT:
                    seen.discard(order.popleft())
                if since is not None and published is not None and published < since:
                    continue  # Seek may bring back a little before its time
                yield Stored(
                    _message_id(message),
                    destination,
                    published,
                    f"subscription {subscription.rpartition('/')[2]} message {message.message_id}",
                )
            only_new = only_new + 1 if new == len(received) else 0
            if only_new >= 2:
                return  # a topic still published to: what came before the read is read

    async def _pull(self, subscription: str, wait: float) -> list[Any]:
        """One Pull; [] when it ends without a message."""
        try:
            response = await self._call(
                subscription,
                lambda c: c.pull(
                    subscription=subscription, max_messages=PULL_MAX, timeout=wait, retry=None
                ),
                (api_exceptions.DeadlineExceeded,),
            )
        except api_exceptions.DeadlineExceeded:
            return []
        return list(response.received_messages)

    async def _call(
        self,
        subscription: str,
        call: Callable[[SubscriberClient], T],
        passing: tuple[type[Exception], ...] = (),
    ) -> T:
        """A blocking client call in a thread. An error of `passing` is the caller's to
        read; any other is a ReadBackError naming the subscription."""
        client = self._client
        if client is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        try:
            return await asyncio.to_thread(call, client)
        except passing:
            raise
        except Exception as exc:
            raise ReadBackError(
                f"broker {self.name!r}: subscription {subscription!r}: {error_text(exc)}"
            ) from exc


def _unfit(info: Any, topic: str) -> str | None:
    """Why a subscription cannot serve the audit, if it cannot."""
    if info.topic != topic:
        return f"is on topic {info.topic!r}, not {topic!r}"
    if info.detached:
        return "is detached from its topic: it receives nothing"
    if info.filter:
        return f"has a filter ({info.filter!r}): it does not receive every message of the topic"
    if (
        info.push_config.push_endpoint
        or info.bigquery_config.table
        or info.cloud_storage_config.bucket
    ):
        return "delivers by push or export: the audit pulls; give it a pull subscription"
    if not info.retain_acked_messages and not _duration(info.topic_message_retention_duration):
        return (
            "does not keep acknowledged messages: the audit acknowledges what it reads and"
            " seeks back to read it again; set retain_acked_messages on it"
            " (gcloud pubsub subscriptions update ... --retain-acked-messages)"
        )
    return None


def _snapshot_of(subscription: str) -> str:
    """The snapshot a read keeps the subscription's state in, where Seek takes no time."""
    project, _, name = subscription.removeprefix("projects/").partition("/subscriptions/")
    if len(name) > 200:
        name = name[:180] + hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"projects/{project}/snapshots/{name}-relay-audit"


def _message_id(message: Any) -> str | None:
    """The relay's id: the `ce-id` attribute, or the body's `id` in structured mode."""
    attributes = message.attributes
    if "ce-id" in attributes:
        return str(attributes["ce-id"])
    if attributes.get("content-type") == STRUCTURED:
        return structured_id(message.data)
    return None


def _duration(value: Any) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(0)


def _utc(when: datetime | None) -> datetime | None:
    if when is None:
        return None
    return when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)
