"""Amazon Kinesis Data Streams publisher, with aioboto3's PutRecords.

A message's `destination` is a stream name or a stream ARN; its key is the record's
partition key (hashed when Kinesis would refuse it: empty, or longer than 256 characters),
so one aggregate's records share a shard. Kinesis records have no headers, so every record
is a CloudEvent in structured mode (JSON event format): `id`, `type`, `source`, `time` and
the others beside `data`. Kinesis has no deduplication: consumers deduplicate on `id`.

Order. PutRecords fails records one by one, and a record that fails does not stop the ones
after it, so two records of one key in one call can be stored out of order. So a call holds
at most one record per key: the first unsent record of every key of the batch, as many keys
as a call takes. A record that fails for a reason worth retrying at once (throughput
exceeded, a Kinesis-side fault) is sent again, alone of its key, a couple of times before
`publish` returns; nothing of its key after it is sent until it lands, while the other keys
go on. A record that keeps failing stops its key for this publish; the core re-sends the
batch from the first failed message, and records after it that Kinesis already stored are
remembered and acknowledged without being sent again (so not stored twice in this process).

Credentials come from the standard AWS chain and are never logged (see relay.brokers._aws).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import re
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from botocore.exceptions import ClientError, NoCredentialsError

from relay.brokers._aws import (
    ENTRY_RETRIES,
    AwsPublisher,
    Service,
    client_error_text,
    error_code,
    error_text,
    no_code_is_fine,
)
from relay.brokers._batch import chunks, not_sent, per_destination, ready
from relay.config import KinesisBrokerConfig
from relay.core.publishing import STRUCTURED, Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt

MAX_RECORDS = 500  # per PutRecords call (a Kinesis limit)
MAX_CALL_BYTES = 5 * 1024 * 1024  # data and partition keys of one call (a Kinesis limit)
MAX_RECORD_BYTES = 1024 * 1024  # data and partition key of one record (the default limit)
MAX_PARTITION_KEY = 256  # characters
_STREAMED_BODY = 512 * 1024  # a request body at least this big goes to aiohttp as a stream

_STREAM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_STREAM_ARN = re.compile(r"arn:aws[a-z-]*:kinesis:[a-z0-9-]+:[0-9]{12}:stream/([A-Za-z0-9_.-]+)")

_STREAM_GONE = frozenset({"ResourceNotFoundException"})
# A call refused because of what it carries: sending the same again cannot help.
_MESSAGE_FAULT = {"ValidationException", "InvalidArgumentException"}


@dataclass(frozen=True, slots=True)
class _Stream:
    name: str  # for messages
    param: dict[str, str]  # StreamName or StreamARN


@dataclass(slots=True)
class _Record:
    index: int  # in the batch
    message: Message
    request: dict[str, Any]  # a PutRecordsRequestEntry
    size: int
    tries: int = 0


class KinesisPublisher(AwsPublisher):
    spec = Service("kinesis", "Kinesis", "stream", _STREAM_GONE)

    def __init__(self, name: str, config: KinesisBrokerConfig) -> None:
        super().__init__(name, config)  # its duplicates: re-sends acknowledged from memory
        # A whole call, both of botocore's attempts: ack_timeout bounds only the reads, and
        # a body of megabytes can wait on its writes for ever while the network drops packets.
        self._deadline = 2 * (config.connect_timeout + config.ack_timeout) + 1.0

    def _opened(self) -> None:
        self._client.meta.events.register("before-send.kinesis.PutRecords", _stream_body)

    def _listing(self) -> tuple[Awaitable[Any], Callable[[str], bool]]:
        """ListStreams: any error is a problem."""
        return self._client.list_streams(Limit=1), no_code_is_fine

    async def _lookup(self, destination: str) -> Any:
        """DescribeStreamSummary of the stream."""
        return self._client.describe_stream_summary(**self._stream(destination).param)

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if (done := await ready(self.connect, len(messages))) is not None:
            return done
        results = not_sent(
            len(messages), "an earlier message with its key failed", broker=self.name
        )
        await per_destination(messages, self._publish_to, results)
        self._accepted.remember(messages, results)
        return results

    # -- one stream ----------------------------------------------------------------------------

    def dedup_scope(self, destination: str) -> str | None:
        """Kinesis keeps every message: its consumers drop duplicates by id, if at all."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`)."""
        try:
            self._stream(message.destination)
        except UnsendableError as exc:
            return str(exc)
        record = self._record(0, message)
        return str(record) if isinstance(record, UnsendableError) else None

    def _stream(self, destination: str) -> _Stream:
        stream = stream_of(destination)
        if stream is None:
            raise UnsendableError(
                f"broker {self.name!r}: {destination!r} is neither a stream ARN nor a stream"
                " name (1-128 letters, digits, '_', '-' or '.')"
            )
        return _Stream(*stream)

    async def _publish_to(
        self, destination: str, batch: list[tuple[int, Message]], results: list[Outcome]
    ) -> None:
        try:
            stream = self._stream(destination)
        except PublishError as exc:
            for index, _ in batch:
                results[index] = exc
            return
        queues: dict[str, deque[_Record]] = {}
        stopped: set[str] = set()  # keys with a message that cannot be sent: nothing after it
        for index, message in batch:
            if message.key in stopped:
                continue
            if self._accepted.take(message):
                results[index] = None  # Kinesis stored it before; the core re-sends it
                self.duplicates += 1
                continue
            record = self._record(index, message)
            if isinstance(record, UnsendableError):
                results[index] = record  # the key's records before it still go: they come first
                stopped.add(message.key)
            else:
                queues.setdefault(message.key, deque()).append(record)
        await self._send_in_rounds(stream, queues, results)

    async def _send_in_rounds(
        self, stream: _Stream, queues: dict[str, deque[_Record]], results: list[Outcome]
    ) -> None:
        """Each round sends the first unsent record of every key (one per key per call) and
        retries at once what is worth it; a key stops at its first lasting failure."""
        while queues:
            heads = [queue[0] for queue in queues.values()]
            sent, halted = await self._send(stream, heads)
            delay = 0.0
            for record, (outcome, retry_now) in zip(heads, sent, strict=True):
                key = record.message.key
                results[record.index] = outcome
                if outcome is None:
                    queues[key].popleft()
                    if not queues[key]:
                        del queues[key]
                elif retry_now and record.tries < len(ENTRY_RETRIES):
                    delay = max(delay, ENTRY_RETRIES[record.tries])
                    record.tries += 1
                else:
                    del queues[key]  # nothing of its key after it in this publish
            if halted:
                return  # the stream cannot be reached or does not exist: stop every key
            if delay and queues:
                await asyncio.sleep(delay)

    async def _send(
        self, stream: _Stream, heads: list[_Record]
    ) -> tuple[list[tuple[Outcome, bool]], bool]:
        """One call per chunk of `heads`, one after the other: per record, its outcome and
        whether it is worth sending again at once; and whether a call failed as a whole for a
        reason that stops every call (unreachable, no stream: the rest are not made).

        A round has more than one call only with more than 500 keys or 5 MiB, and a shard
        takes 1 MB/s whatever the calls; moto loses records of concurrent calls to a shard."""
        halted: list[PublishError] = []
        results: list[tuple[Outcome, bool]] = []
        for call in chunks(heads, MAX_RECORDS, MAX_CALL_BYTES):
            results += await self._send_chunk(stream, call, halted)
        return results, bool(halted)

    async def _send_chunk(
        self, stream: _Stream, chunk: list[_Record], halted: list[PublishError]
    ) -> list[tuple[Outcome, bool]]:
        response = await self._call(stream, chunk, halted)
        if isinstance(response, PublishError):
            if response.permanent and len(chunk) > 1:
                # Refused as a whole because of one of its records: find which one.
                return [(await self._send_chunk(stream, [r], halted))[0] for r in chunk]
            if not response.permanent and not halted:
                halted.append(response)  # the calls still waiting would fail the same way
            return [(response, False)] * len(chunk)
        answers = response.get("Records", [])
        results: list[tuple[Outcome, bool]] = []
        for position, _ in enumerate(chunk):
            answer = answers[position] if position < len(answers) else {"ErrorCode": "None"}
            code = answer.get("ErrorCode")
            if not code:
                results.append((None, False))
                continue
            # ProvisionedThroughputExceededException or InternalFailure: worth another try.
            text = f"{code}: {answer.get('ErrorMessage') or 'no result for the record'}"
            results.append((self._transient(stream.name, text), True))
        return results

    async def _call(
        self, stream: _Stream, chunk: list[_Record], halted: list[PublishError]
    ) -> dict[str, Any] | PublishError:
        """One PutRecords: its response, or why it failed as a whole."""
        if halted:
            return halted[0]  # not sent
        try:
            async with asyncio.timeout(self._deadline):
                response: dict[str, Any] = await self._client.put_records(
                    Records=[r.request for r in chunk], **stream.param
                )
        except TimeoutError:
            text = f"no answer within {self._deadline:g}s (a call of {len(chunk)} records)"
            return self._transient(stream.name, text)
        except Exception as exc:  # noqa: BLE001 - classified, not swallowed
            return self.call_error(exc, stream.name)
        return response

    # -- messages to records -------------------------------------------------------------------

    def _record(self, index: int, message: Message) -> _Record | UnsendableError:
        data = record_data(message)
        key = partition_key(message.key)
        size = len(data) + len(key.encode())
        if size > MAX_RECORD_BYTES:
            return UnsendableError(
                f"broker {self.name!r}: message {excerpt(message.id)}: {size} bytes (the event and"
                " its partition key) is more than Kinesis's maximum of 1 MiB per record"
            )
        return _Record(index, message, {"Data": data, "PartitionKey": key}, size)

    # -- errors --------------------------------------------------------------------------------

    def call_error(self, exc: BaseException, stream: str) -> PublishError:
        """Why a whole call failed: permanent only when what it carries is to blame."""
        if isinstance(exc, ClientError):
            code, text = error_code(exc), client_error_text(exc)
            if code in _STREAM_GONE:
                return self._transient(stream, f"the stream does not exist: {text}")
            if code in _MESSAGE_FAULT:
                return PermanentPublishError(f"broker {self.name!r}: stream {stream!r}: {text}")
            return self._transient(stream, text)
        if isinstance(exc, NoCredentialsError):
            return self._transient(stream, "no AWS credentials found in the standard chain")
        return self._transient(stream, error_text(exc))

    def _transient(self, stream: str, text: str) -> TransientPublishError:
        return TransientPublishError(f"broker {self.name!r}: stream {stream!r}: {text}")


def stream_of(destination: str) -> tuple[str, dict[str, str]] | None:
    """The stream a destination names: its name (for messages) and the parameter a call
    takes (StreamName or StreamARN); None when it names none (the audit reads it too)."""
    if match := _STREAM_ARN.fullmatch(destination):
        return match.group(1), {"StreamARN": destination}
    if _STREAM_NAME.fullmatch(destination):
        return destination, {"StreamName": destination}
    return None


def _stream_body(request: Any, **_: Any) -> None:
    """Hand aiohttp a big PutRecords body (up to about 7 MB: the records in base64) as a
    stream, as it asks: sent in one piece, it would hold the event loop while it is written
    (and aiohttp warns of it)."""
    if isinstance(request.body, bytes) and len(request.body) > _STREAMED_BODY:
        request.body = io.BytesIO(request.body)


def record_data(message: Message) -> bytes:
    """The record's bytes: the message as a structured CloudEvent (Kinesis has no headers),
    built as `to_structured` builds it, without the copy of the message that would cost
    (a third of the adapter's own CPU per message when measured)."""
    if message.content_type == STRUCTURED:
        return message.body
    attributes = cloudevent_attributes(message)
    attributes["datacontenttype"] = message.content_type
    head = orjson.dumps(attributes)
    return b"".join((head[:-1], b',"data":', message.body, b"}"))


def partition_key(key: str) -> str:
    """The key itself when Kinesis takes it (1 to 256 characters), else `~sha256:` and its
    digest: the same every time, so the key's records still share a shard."""
    if 0 < len(key) <= MAX_PARTITION_KEY:
        return key
    return "~sha256:" + hashlib.sha256(key.encode()).hexdigest()
