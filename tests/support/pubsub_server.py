"""Google Pub/Sub for tests: a private emulator and a consumer's client helpers.

The emulator (`cloud-pubsub-emulator`, from the Google Cloud SDK, on OpenJDK) takes several
seconds to start, so one per session serves every test (the `pubsub_emulator` fixture in
service_fixtures.py); tests use unique topic and subscription names on it. Tests that stop
a server start their own `PubSubEmulator` or go through a TcpProxy. The helpers here read
messages back as a consumer would: a subscription with message ordering, pulled and acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from google.api_core import exceptions as api_exceptions
from google.cloud.pubsub_v1 import PublisherClient, SubscriberClient
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport

from tests.support.net import free_port, wait_for_port

DEFAULT_EMULATOR = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
EMULATOR = Path(os.environ.get("RELAY_TEST_PUBSUB_EMULATOR", DEFAULT_EMULATOR))
PROJECT = "relay-tests"
NO_EMULATOR = (
    "the Pub/Sub tests need the Google Cloud SDK's Pub/Sub emulator at {path} (Debian and"
    " Ubuntu: `apt-get install google-cloud-cli-pubsub-emulator` from Google's apt source), or"
    " RELAY_TEST_PUBSUB_EMULATOR set to its cloud-pubsub-emulator script; it needs Java 17+"
)
# A pull may bring messages of up to 10 MB; gRPC's default receive limit is 4 MiB.
_UNLIMITED = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))


class PubSubEmulator:
    """One emulator process on 127.0.0.1; its log goes to `log_path`."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """`host:port`, as `emulator_host` takes it."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> PubSubEmulator:
        """Start the emulator and wait until it listens (a JVM: several seconds)."""
        if not EMULATOR.is_file():
            raise RuntimeError(NO_EMULATOR.format(path=EMULATOR))
        command = [str(EMULATOR), "--host=127.0.0.1", f"--port={self.port}"]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the script starts java: kill the whole group
            )
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self._process)
        except (RuntimeError, TimeoutError) as exc:
            self.kill()
            raise RuntimeError(
                f"Pub/Sub emulator did not start on port {self.port} ({exc}):\n"
                + self.log_path.read_text(errors="replace")[-3000:]
            ) from exc
        return self

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, 9)
        process.wait(10)


def unique_name(prefix: str = "test") -> str:
    """A topic or subscription id: 3 characters at least, a letter first."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def topic_path(name: str, project: str = PROJECT) -> str:
    return f"projects/{project}/topics/{name}"


def subscription_path(name: str, project: str = PROJECT) -> str:
    return f"projects/{project}/subscriptions/{name}"


@contextmanager
def admin(host: str) -> Iterator[tuple[Any, Any]]:
    """(publisher, subscriber) GAPIC clients on the emulator, for the test's own calls."""
    publisher_channel = grpc.insecure_channel(host, options=_UNLIMITED)
    subscriber_channel = grpc.insecure_channel(host, options=_UNLIMITED)
    try:
        yield (
            PublisherClient(transport=PublisherGrpcTransport(channel=publisher_channel)),
            SubscriberClient(transport=SubscriberGrpcTransport(channel=subscriber_channel)),
        )
    finally:
        publisher_channel.close()
        subscriber_channel.close()


def create_topic(host: str, topic: str, subscription: str) -> None:
    """The topic, and an ordered subscription to it that receives everything published."""
    with admin(host) as (publisher, subscriber):
        publisher.create_topic(name=topic_path(topic), timeout=10)
        subscriber.create_subscription(
            request={
                "name": subscription_path(subscription),
                "topic": topic_path(topic),
                "enable_message_ordering": True,
                "ack_deadline_seconds": 60,
            },
            timeout=10,
        )


def delete_topic(host: str, topic: str, subscription: str) -> None:
    with admin(host) as (publisher, subscriber):
        for call, name in (
            (subscriber.delete_subscription, {"subscription": subscription_path(subscription)}),
            (publisher.delete_topic, {"topic": topic_path(topic)}),
        ):
            with contextlib.suppress(api_exceptions.GoogleAPICallError):  # never made, or gone
                call(**name, timeout=10)


AUDIT_SUBSCRIPTION = "{topic}-audit"  # the audit's own subscription of a topic, as tests name it


def create_audit_subscription(
    emulator: str, topic: str, subscription: str, **settings: Any
) -> None:
    """A subscription for the audit: ordered, keeping what is acknowledged (unless
    `settings` say otherwise)."""
    with admin(emulator) as (_, subscriber):
        subscriber.create_subscription(
            request={
                "name": subscription_path(subscription),
                "topic": topic_path(topic),
                "enable_message_ordering": True,
                "retain_acked_messages": True,
                **settings,
            },
            timeout=10,
        )


def delete_subscription(emulator: str, subscription: str) -> None:
    with admin(emulator) as (_, subscriber), contextlib.suppress(api_exceptions.GoogleAPICallError):
        subscriber.delete_subscription(subscription=subscription_path(subscription), timeout=10)


def pull_all(host: str, subscription: str, expected: int, timeout: float = 30.0) -> list[Any]:
    """Pull and ack until `expected` messages came and one more pull finds none; in
    delivery order. Each is a ReceivedMessage (`.message.data`, `.attributes`,
    `.ordering_key`)."""
    received: list[Any] = []
    deadline = time.monotonic() + timeout
    with admin(host) as (_, subscriber):
        while True:
            try:  # the emulator holds a pull until a message comes or the call times out
                response = subscriber.pull(
                    subscription=subscription_path(subscription),
                    max_messages=1000,
                    timeout=1 if len(received) >= expected else 3,
                    retry=None,
                )
                batch = list(response.received_messages)
            except api_exceptions.DeadlineExceeded:
                batch = []
            if batch:
                received += batch
                subscriber.acknowledge(
                    subscription=subscription_path(subscription),
                    ack_ids=[m.ack_id for m in batch],
                    timeout=10,
                )
            elif len(received) >= expected or time.monotonic() > deadline:
                return received


async def pull_all_async(
    host: str,
    subscription: str,
    expected: int,
    timeout: float = 30.0,  # noqa: ASYNC109 - one deadline across many pulls
) -> list[Any]:
    return await asyncio.to_thread(pull_all, host, subscription, expected, timeout)
