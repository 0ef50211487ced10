"""Amazon Kinesis harness: a two-shard stream on a private moto server, reached through a
proxy, read back as a consumer would: GetRecords on every shard from TRIM_HORIZON.

Records have no headers, so each is a CloudEvent in structured mode; the harness parses it
with the CloudEvents SDK's JSON format, and its `data` is the message body. The partition
key is the message key. Kinesis keeps order per shard, so per key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import aioboto3
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import REGION, moto_broker

ACCOUNT = "123456789012"  # moto's


def unique_stream(prefix: str = "test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def kinesis_client(endpoint: str) -> AsyncIterator[Any]:
    """A plain aioboto3 Kinesis client for the test's own calls (create, read, delete)."""
    async with aioboto3.Session(region_name=REGION).client("kinesis", endpoint_url=endpoint) as c:
        yield c


def consumed(record: dict[str, Any]) -> Consumed:
    """A record as the contract compares it: the event's id and type, the partition key, and
    its data as the body (JSON, written as json.dumps writes it)."""
    event = json.loads(record["Data"])
    return Consumed(
        id=event["id"],
        type=event["type"],
        key=record["PartitionKey"],
        body=json.dumps(event["data"]).encode(),
        raw=record,
    )


class StreamReader:
    """Reads a stream's shards from the start, as a consumer would, carrying on where the
    last read ended."""

    def __init__(self, client: Any, stream: str) -> None:
        self.client = client
        self.stream = stream
        self.records: list[dict[str, Any]] = []
        self._iterators: dict[str, str] = {}

    async def read(self, expected: int, timeout: float = 30.0) -> list[dict[str, Any]]:  # noqa: ASYNC109 - one deadline across many polls
        """Every record so far, in shard order, once at least `expected` different ones have
        come (or at the deadline); then one more pass, so that a record too many shows too.
        Different: Kinesis stores a re-sent record again (a call that timed out may have been
        carried out), and a consumer deduplicates on the event's id."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            got = await self._poll()
            if len({r["Data"] for r in self.records}) >= expected and not got:
                return list(self.records)
            if loop.time() > deadline:
                return list(self.records)
            if not got:
                await asyncio.sleep(0.05)  # a consumer's poll interval

    async def _poll(self) -> int:
        if not self._iterators:
            shards = await self.client.list_shards(StreamName=self.stream)
            for shard in shards["Shards"]:
                iterator = await self.client.get_shard_iterator(
                    StreamName=self.stream,
                    ShardId=shard["ShardId"],
                    ShardIteratorType="TRIM_HORIZON",
                )
                self._iterators[shard["ShardId"]] = iterator["ShardIterator"]
        got = 0
        for shard, iterator in list(self._iterators.items()):
            response = await self.client.get_records(ShardIterator=iterator, Limit=10_000)
            self._iterators[shard] = response["NextShardIterator"]
            self.records += response["Records"]
            got += len(response["Records"])
        return got


class KinesisHarness:
    kind = "kinesis"
    limit_known_before_sending = True

    def __init__(self, endpoint: str, shards: int = 2) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        self.endpoint = endpoint
        self.proxy = TcpProxy(host, int(port))
        self.stream = unique_stream("contract")
        self.stream_arn = f"arn:aws:kinesis:{REGION}:{ACCOUNT}:stream/{self.stream}"
        self.shards = shards
        self.kinesis: Any = None
        self.reader: StreamReader | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    def broker_config(self) -> dict[str, Any]:
        return moto_broker("kinesis", self.proxy)

    def destination(self) -> str:
        return self.stream

    async def client(self) -> Any:
        if self._stack is None:
            self._stack = contextlib.AsyncExitStack()
            self.kinesis = await self._stack.enter_async_context(kinesis_client(self.endpoint))
        return self.kinesis

    async def prepare(self) -> None:
        kinesis = await self.client()
        await kinesis.create_stream(StreamName=self.stream, ShardCount=self.shards)
        self.reader = StreamReader(kinesis, self.stream)

    async def records(self, expected: int, timeout: float = 30.0) -> list[dict[str, Any]]:  # noqa: ASYNC109
        assert self.reader is not None, "prepare() first"
        return await self.reader.read(expected, timeout)

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        return [consumed(r) for r in await self.records(expected, timeout)]

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The SDK's JSON event format reads the record as it is: Kinesis has no binding."""
        return JSONFormat().read(None, message.raw["Data"])

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 1024 * 1024  # the event around it makes the record more than 1 MiB

    async def close(self) -> None:
        self.proxy.close()
        if self._stack is not None:
            with contextlib.suppress(Exception):
                await self.kinesis.delete_stream(StreamName=self.stream)
            await self._stack.aclose()


async def start(request: Any) -> KinesisHarness:
    return KinesisHarness(request.getfixturevalue("sqs_endpoint"))
