"""Reading Kinesis Data Streams back for an audit: GetRecords on every shard, from a time.

A destination is a stream (a name or an ARN). Every shard ListShards returns is read,
closed parents included (after a reshard a key's older records stay in its parent until
they expire), parents before their children so that each key's records come in order. A
shard is read from a shard iterator at the audit's start time (`AT_TIMESTAMP`; from the
oldest record, `TRIM_HORIZON`, without one) until GetRecords says it is caught up with the
shard's tip (`MillisBehindLatest` 0 on a page that was not full) or the shard ends (a
closed shard has no next iterator). Records are CloudEvents in structured mode: the id is
the event's `id`, the time Kinesis's `ApproximateArrivalTimestamp`.

Nothing is taken from a consumer: shard iterators are the consumers' own reads. They share
each shard's read limits (5 GetRecords a second, 2 MB a second) with every consumer not on
enhanced fan-out, so the audit keeps to a share of them (READ_SHARE) and waits out a
throttled call. Kinesis has no deduplication: `duplicate_window` is None.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from datetime import UTC, datetime
from typing import Any

import aioboto3
from botocore.exceptions import ClientError, NoCredentialsError

from relay.brokers._aws import client_error_text, error_code, error_text, open_client
from relay.brokers.kinesis import stream_of
from relay.config import KinesisBrokerConfig
from relay.core.readback import Horizon, Stored, structured_id
from relay.errors import ReadBackError

PAGE = 10_000  # records a GetRecords call returns at most (Kinesis's limit)
MIN_CALL_INTERVAL = 0.2  # seconds between two GetRecords of a shard: 5 a second at most
READ_SHARE = 1024 * 1024  # bytes a second the audit reads of a shard: half its 2 MB/s
THROTTLE_WAITS = (0.5, 1.0, 2.0, 4.0)  # waits after a throttled call, then it gives up

_THROTTLED = {"ProvisionedThroughputExceededException", "LimitExceededException"}
_GONE = {"ResourceNotFoundException"}
_NO_CREDENTIALS = "no AWS credentials found in the standard chain"


class KinesisReader:
    def __init__(self, name: str, config: KinesisBrokerConfig) -> None:
        self.name = name
        self._session = aioboto3.Session(region_name=config.region)
        self._endpoint_url = config.endpoint_url
        self._timeouts = (config.connect_timeout, config.ack_timeout)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def connect(self) -> None:
        """Create the client (as the publisher does); no request is made."""
        if self._client is not None:
            return
        try:
            self._client, self._stack = await open_client(
                self._session, "kinesis", self._endpoint_url, *self._timeouts
            )
        except Exception as exc:
            raise ReadBackError(
                f"broker {self.name!r}: cannot create the Kinesis client: {error_text(exc)}"
            ) from exc

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        if since is not None and since > datetime.now(UTC):
            return  # nothing was stored at that time yet
        for destination in sorted(set(destinations)):
            stream = stream_of(destination)
            if stream is None:
                continue  # no stream: the horizon says so
            shards = await self._shards(*stream)
            for shard in shards or []:
                async for stored in self._read_shard(destination, stream, shard, since):
                    yield stored

    async def horizon(self, destination: str) -> Horizon:
        stream = stream_of(destination)
        if stream is None:
            return Horizon(None, problem=f"{destination!r} is neither a stream name nor an ARN")
        name, param = stream
        try:
            summary = (await self._client_call("describe_stream_summary", name, **param))[
                "StreamDescriptionSummary"
            ]
        except _Gone:
            return Horizon(None, problem=f"stream {name!r} does not exist")
        max_age = float(summary["RetentionPeriodHours"]) * 3600.0
        status = summary.get("StreamStatus", "ACTIVE")
        problem = None if status in ("ACTIVE", "UPDATING") else f"stream {name!r} is {status}"
        oldest: tuple[datetime, str | None, str] | None = None
        for shard in await self._shards(name, param) or []:
            first = await self._first_record(name, param, shard)
            if first is not None and (oldest is None or first[0] < oldest[0]):
                oldest = first
        if oldest is None:
            return Horizon(None, max_age=max_age, where=f"stream {name}", problem=problem)
        first_time, first_id, where = oldest
        return Horizon(first_time, first_id, max_age=max_age, where=where, problem=problem)

    async def duplicate_window(self, destination: str) -> float | None:
        return None  # Kinesis stores every record it is sent

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    # -- shards ------------------------------------------------------------------------------

    async def _shards(self, name: str, param: dict[str, str]) -> list[str] | None:
        """The stream's shards, closed ones included, each after its parents; None when the
        stream does not exist."""
        shards: list[dict[str, Any]] = []
        request: dict[str, Any] = dict(param)
        try:
            while True:
                page = await self._client_call("list_shards", name, **request)
                shards += page.get("Shards", [])
                token = page.get("NextToken")
                if not token:
                    break
                request = {"NextToken": token}  # with a token, ListShards takes no stream
        except _Gone:
            return None
        return lineage_order(shards)

    async def _iterator(
        self, name: str, param: dict[str, str], shard: str, since: datetime | None, **at: str
    ) -> str | None:
        """A shard iterator: after a sequence number (`at`), else at `since`, else the
        shard's oldest record."""
        if at:
            start: dict[str, Any] = {"ShardIteratorType": "AFTER_SEQUENCE_NUMBER", **at}
        elif since is not None:
            start = {"ShardIteratorType": "AT_TIMESTAMP", "Timestamp": since.astimezone(UTC)}
        else:
            start = {"ShardIteratorType": "TRIM_HORIZON"}
        try:
            answer = await self._client_call(
                "get_shard_iterator", name, ShardId=shard, **param, **start
            )
        except _Gone:
            return None  # the stream, or the shard (expired), is gone since it was listed
        iterator: str | None = answer.get("ShardIterator")
        return iterator

    async def _pages(
        self, name: str, param: dict[str, str], shard: str, since: datetime | None
    ) -> AsyncGenerator[list[dict[str, Any]]]:
        """GetRecords pages of a shard from `since`, until it is caught up with the shard's
        tip or the shard ends, at a pace that leaves most of its read limits to consumers."""
        iterator = await self._iterator(name, param, shard, since)
        last: str | None = None  # the last sequence number read, to go on after an expiry
        while iterator:
            try:
                page = await self._client_call(
                    "get_records", name, ShardIterator=iterator, Limit=PAGE
                )
            except _Expired:  # the iterator is 5 minutes old: a slow reader of the pages
                at = {"StartingSequenceNumber": last} if last else {}
                iterator = await self._iterator(name, param, shard, since, **at)
                continue
            except _Gone:
                return
            records: list[dict[str, Any]] = page.get("Records", [])
            if records:
                last = records[-1]["SequenceNumber"]
                yield records
            iterator = page.get("NextShardIterator")
            if page.get("MillisBehindLatest") == 0 and len(records) < PAGE:
                return  # caught up with the tip as of this call
            if iterator:
                size = sum(len(r["Data"]) + len(r["PartitionKey"]) for r in records)
                await asyncio.sleep(max(MIN_CALL_INTERVAL, size / READ_SHARE))

    async def _read_shard(
        self,
        destination: str,
        stream: tuple[str, dict[str, str]],
        shard: str,
        since: datetime | None,
    ) -> AsyncIterator[Stored]:
        name, param = stream
        async for records in self._pages(name, param, shard, since):
            for record in records:
                when = _utc(record.get("ApproximateArrivalTimestamp"))
                if since is not None and when is not None and when < since:
                    continue  # botocore sends AT_TIMESTAMP in whole seconds: up to 1s early
                yield Stored(
                    structured_id(record["Data"]),
                    destination,
                    when,
                    f"shard {shard} seq {record['SequenceNumber']}",
                )

    async def _first_record(
        self, name: str, param: dict[str, str], shard: str
    ) -> tuple[datetime, str | None, str] | None:
        """The time, id and address of the shard's oldest record; None when it holds none."""
        async with contextlib.aclosing(self._pages(name, param, shard, None)) as pages:
            records = await anext(pages, None)
        if not records:
            return None
        record = records[0]
        when = _utc(record.get("ApproximateArrivalTimestamp"))
        if when is None:
            return None
        where = f"stream {name} shard {shard} seq {record['SequenceNumber']}"
        return when, structured_id(record["Data"]), where

    # -- calls -------------------------------------------------------------------------------

    async def _client_call(self, operation: str, stream: str, **params: Any) -> dict[str, Any]:
        """One call; a throttled one is made again after a wait. _Gone when the stream (or
        the shard) does not exist, _Expired for an old iterator, else ReadBackError."""
        if self._client is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        waits = iter(THROTTLE_WAITS)
        while True:
            try:
                answer: dict[str, Any] = await getattr(self._client, operation)(**params)
            except ClientError as exc:
                code = error_code(exc)
                if code in _GONE:
                    raise _Gone from exc
                if code == "ExpiredIteratorException":
                    raise _Expired from exc
                wait = next(waits, None) if code in _THROTTLED else None
                if wait is None:
                    raise self._failed(stream, client_error_text(exc)) from exc
                await asyncio.sleep(wait)
            except NoCredentialsError as exc:
                raise self._failed(stream, _NO_CREDENTIALS) from exc
            except Exception as exc:
                raise self._failed(stream, error_text(exc)) from exc
            else:
                return answer

    def _failed(self, stream: str, text: str) -> ReadBackError:
        return ReadBackError(f"broker {self.name!r}: cannot read stream {stream!r}: {text}")


class _Gone(Exception):
    """The stream or the shard does not exist (any more)."""


class _Expired(Exception):
    """A shard iterator older than five minutes."""


def lineage_order(shards: Sequence[dict[str, Any]]) -> list[str]:
    """Shard ids with every shard after its parents (a split's or a merge's): a key's older
    records, in a closed parent, are read before its newer ones."""
    known = {shard["ShardId"] for shard in shards}
    parents = {
        shard["ShardId"]: {
            parent
            for parent in (shard.get("ParentShardId"), shard.get("AdjacentParentShardId"))
            if parent in known
        }
        for shard in shards
    }
    ordered: list[str] = []
    placed: set[str] = set()
    waiting = sorted(known)
    while waiting:
        ready = [shard for shard in waiting if parents[shard] <= placed]
        if not ready:  # a cycle cannot happen; should one, read the rest as listed
            ready = waiting
        ordered += ready
        placed.update(ready)
        waiting = [shard for shard in waiting if shard not in placed]
    return ordered


def _utc(when: datetime | None) -> datetime | None:
    if when is None:
        return None
    return when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)
