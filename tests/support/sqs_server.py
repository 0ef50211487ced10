"""SQS for tests: a private moto server, fake credentials, and client helpers.

The `sqs_endpoint` fixture starts `python -m moto.server` on a free port of 127.0.0.1 once
per session, and kills it at the end. Moto accepts any credentials, so the session sets fake
ones in the environment: the relay under test finds them through the standard AWS chain,
never a developer's real ones (shared files, profiles and instance metadata are turned off).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest

from tests.support.net import free_port

REGION = "us-east-1"


def moto_broker(kind: str, proxy: Any) -> dict[str, Any]:
    """The config of an AWS broker (`sqs`, `sns`, `kinesis`) reaching moto through `proxy`,
    with the short timeouts the contract suite's outages need."""
    return {
        "type": kind,
        "region": REGION,
        "endpoint_url": f"http://{proxy.host}:{proxy.port}",
        "connect_timeout": "1s",
        "ack_timeout": "1s",
    }


FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SQS")


class MotoServer:
    """One `moto.server` process; its log goes to `log_path`."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MotoServer:
        """Start the server and wait until it answers HTTP."""
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"moto server did not start on port {self.port}:\n"
                    + self.log_path.read_text(errors="replace")
                )
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(10)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    """`endpoint_url` of a private moto server, with fake AWS credentials in the environment."""
    with pytest.MonkeyPatch.context() as env, tempfile.TemporaryDirectory(prefix="moto-") as tmp:
        for name, value in FAKE_ENV.items():
            env.setenv(name, value)
        for name in UNSET_ENV:
            env.delenv(name, raising=False)
        server = MotoServer(Path(tmp) / "moto.log").start()
        try:
            yield server.url
        finally:
            server.kill()


def unique_queue(prefix: str = "test", fifo: bool = True) -> str:
    """A fresh queue name, FIFO (`.fifo`) unless told otherwise."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    return f"{name}.fifo" if fifo else name


@contextlib.asynccontextmanager
async def sqs_client(endpoint: str) -> AsyncIterator[Any]:
    """A plain aioboto3 SQS client for the test's own calls (create, receive, delete)."""
    session = aioboto3.Session(region_name=REGION)
    async with session.client("sqs", endpoint_url=endpoint) as client:
        yield client


async def create_queue(client: Any, name: str, **attributes: str) -> str:
    if name.endswith(".fifo"):
        attributes.setdefault("FifoQueue", "true")
    response = await client.create_queue(QueueName=name, Attributes=attributes)
    url: str = response["QueueUrl"]
    return url


async def receive_all(
    client: Any,
    queue_url: str,
    expected: int = 0,
    timeout: float = 30.0,  # noqa: ASYNC109 - one deadline across many polls
) -> list[dict[str, Any]]:
    """Receive and delete messages until `expected` have come (and the queue looks empty).

    Deleting keeps FIFO groups flowing: SQS holds back a group while a message of it is in
    flight. The result is in delivery order, with all message attributes and MessageGroupId.
    """
    received: list[dict[str, Any]] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        response = await client.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=1 if len(received) < expected else 0,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["All"],
        )
        batch = response.get("Messages", [])
        if batch:
            received += batch
            await client.delete_message_batch(
                QueueUrl=queue_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(batch)
                ],
            )
        elif len(received) >= expected or asyncio.get_running_loop().time() > deadline:
            return received


def attribute(message: dict[str, Any], name: str) -> str | None:
    """A String message attribute of a received message, or None."""
    value = message.get("MessageAttributes", {}).get(name)
    return None if value is None else str(value["StringValue"])
