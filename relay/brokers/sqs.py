"""Amazon SQS publisher, standard and FIFO queues, with aioboto3.

A message's `destination` is a queue name (resolved once with GetQueueUrl) or a
queue URL; a name ending in `.fifo` is a FIFO queue. Messages go out with
SendMessageBatch, up to 10 entries and 256 KiB per call. On FIFO queues the
message key is the MessageGroupId (hashed when SQS would refuse it, see
`group_id`) and the message id the MessageDeduplicationId, so a re-send
within SQS's 5-minute window is dropped.

Order. SQS keeps entry order within one call for a group, but nothing orders
concurrent calls, and a batch can fail part-way. For each FIFO queue the
messages are sent in layers: layer n holds the n-th message of every group
of the batch, so a layer has at most one message per group and its calls can
go out together. Layers go out one after the other, and nothing after a
layer that failed is sent: a later message of a group is never stored before
an earlier one that failed, whatever SQS does with the other entries of a
call. Standard queues have no order; their calls all go out together.

Partial failures. Entries that fail for a reason worth retrying at once
(throttling, an SQS-side fault) are sent again, alone, a couple of times
before `publish` returns. When a failure remains, the core re-sends the batch
from the first failed message; messages after it that SQS already accepted
are remembered here and reported acknowledged without being sent again (and
counted in `duplicates`), so only the entries that failed are retried, and a
standard queue does not get them twice. After a restart that memory is
gone: FIFO queues still drop the re-send within 5 minutes, standard queues
may deliver it twice (at least once).

Credentials come from the standard AWS chain and are never logged. botocore
retries a failed call once (stale keep-alive connections); every other retry
is the outbox's backoff, visible in `status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aioboto3
from botocore.exceptions import ClientError, NoCredentialsError

from relay.brokers._aws import (
    CONCURRENCY,
    ENTRY_RETRIES,
    SERVER_FAULT,
    THROTTLED,
    Accepted,
    chunks,
    client_error_text,
    deduplication_id,
    error_code,
    error_text,
    group_id,
    is_configuration_fault,
    layers,
    message_attributes,
    open_client,
    strip,
)
from relay.brokers._batch import connect_or_fail, not_sent
from relay.config import SqsBrokerConfig
from relay.core.publishing import Message, Outcome
from relay.errors import PermanentPublishError, PublishError, TransientPublishError

MAX_ENTRIES = 10  # per SendMessageBatch call (an SQS limit)
MAX_CALL_BYTES = 256 * 1024  # payload budget per call (SQS's limit before 2025: 256 KiB)
MAX_MESSAGE_BYTES = 1024 * 1024  # no queue takes more (body and attributes), so not sent

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,80}|[A-Za-z0-9_-]{1,75}\.fifo")
# Characters SQS accepts in a body or a String attribute (XML 1.0 Char).
_NOT_XML_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

# Error codes, as botocore reports them (the `AWS.SimpleQueueService.` prefix removed).
_QUEUE_GONE = {"QueueDoesNotExist", "NonExistentQueue", "QueueDeletedRecently"}
# The message itself is at fault: sending it again cannot help.
_MESSAGE_FAULT = {
    "InvalidParameterValue",
    "InvalidMessageContents",
    "MessageTooLong",
    "BatchRequestTooLong",
    "InvalidAttributeName",
    "InvalidAttributeValue",
}


@dataclass(frozen=True, slots=True)
class _Queue:
    name: str
    url: str
    fifo: bool


@dataclass(slots=True)
class _Sending:
    """One queue's share of a publish."""

    queue: _Queue
    halted: PublishError | None = None  # a call failed as a whole: send no more


@dataclass(slots=True)
class _Entry:
    index: int  # in the batch
    message: Message
    request: dict[str, Any]  # a SendMessageBatchRequestEntry; empty when `error`
    size: int
    error: PermanentPublishError | None = None


@dataclass(frozen=True, slots=True)
class _Result:
    outcome: Outcome
    retry_now: bool = False  # worth an in-adapter retry before returning


class SqsPublisher:
    def __init__(self, name: str, config: SqsBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._session = aioboto3.Session(region_name=config.region)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._slots: asyncio.Semaphore | None = None
        self._queues: dict[str, _Queue] = {}
        self._accepted = Accepted()
        self.duplicates = 0
        self.last_duplicates: tuple[int, ...] = ()  # it cannot tell which

    async def connect(self) -> None:
        """Create the client; no request is made, so an unreachable SQS shows at publish."""
        if self._client is not None:
            return
        c = self._config
        try:
            self._client, self._stack = await open_client(
                self._session, "sqs", c.endpoint_url, c.connect_timeout, c.ack_timeout
            )
        except Exception as exc:
            raise TransientPublishError(
                f"broker {self.name!r}: cannot create the SQS client: {error_text(exc)}"
            ) from exc
        self._slots = asyncio.Semaphore(CONCURRENCY)

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: ask SQS for each queue (GetQueueUrl, or GetQueueAttributes for a
        URL), which proves the credentials too; with no queue known in advance, ListQueues
        does (an AccessDenied answer also proves them). Nothing is sent; what is wrong, one
        line each."""
        await self.connect()
        try:
            if not destinations:
                problem = await self._probe_call(
                    "(any)", self._client.list_queues(MaxResults=1), denied_is_fine=True
                )
                return [problem] if problem else []
            problems = []
            for destination in sorted(destinations):
                if destination.startswith(("https://", "http://")):
                    call = self._client.get_queue_attributes(
                        QueueUrl=destination, AttributeNames=["QueueArn"]
                    )
                elif _QUEUE_NAME.fullmatch(destination):
                    call = self._client.get_queue_url(QueueName=destination)
                else:
                    problems.append(
                        f"broker {self.name!r}: {destination!r} is neither a queue URL nor a"
                        " queue name"
                    )
                    continue
                if problem := await self._probe_call(destination, call):
                    problems.append(problem)
            return problems
        finally:
            await self.close()

    async def _probe_call(
        self, queue: str, call: Awaitable[Any], *, denied_is_fine: bool = False
    ) -> str | None:
        try:
            await call
        except Exception as exc:  # noqa: BLE001 - each becomes a line of the report
            if isinstance(exc, ClientError) and error_code(exc) in _QUEUE_GONE:
                return (
                    f"broker {self.name!r}: queue {queue!r} does not exist: every message to"
                    " it would be retried for ever; create it"
                )
            if (
                denied_is_fine
                and isinstance(exc, ClientError)
                and "AccessDenied" in error_code(exc)
            ):
                return None  # authenticated, just not allowed to list
            return str(self._call_error(exc, queue))
        return None

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if not messages:
            return []
        if failed := await connect_or_fail(self.connect, len(messages)):
            return failed
        results = not_sent(
            len(messages), "an earlier message for its FIFO queue failed", broker=self.name
        )
        by_destination: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_destination.setdefault(message.destination, []).append(index)
        await asyncio.gather(
            *(
                self._publish_to(destination, [(i, messages[i]) for i in indexes], results)
                for destination, indexes in by_destination.items()
            )
        )
        self._accepted.remember(messages, results)
        return results

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    # -- one queue -----------------------------------------------------------------------------

    async def _publish_to(
        self, destination: str, batch: list[tuple[int, Message]], results: list[Outcome]
    ) -> None:
        try:
            queue = await self._queue(destination)
        except PublishError as exc:
            for index, _ in batch:
                results[index] = exc
            return
        entries: list[_Entry] = []
        for index, message in batch:
            if self._accepted.take(message):
                results[index] = None  # SQS accepted it before; the core re-sends it
                self.duplicates += 1
            else:
                entries.append(self._entry(index, message, queue.fifo))
        sending = _Sending(queue)
        for layer in layers(entries) if queue.fifo else [entries]:
            for entry in layer:
                if entry.error is not None:
                    results[entry.index] = entry.error
            await self._send(sending, [e for e in layer if e.error is None], results)
            if queue.fifo and any(results[e.index] is not None for e in layer):
                return  # nothing of a later layer may overtake a failed message

    async def _queue(self, destination: str) -> _Queue:
        if (queue := self._queues.get(destination)) is not None:
            return queue
        if destination.startswith(("https://", "http://")):
            name = urlsplit(destination).path.rstrip("/").rpartition("/")[2]
            queue = _Queue(name, destination, name.endswith(".fifo"))
        elif _QUEUE_NAME.fullmatch(destination):
            try:
                response = await self._client.get_queue_url(QueueName=destination)
            except Exception as exc:
                raise self._call_error(exc, destination) from exc
            queue = _Queue(destination, response["QueueUrl"], destination.endswith(".fifo"))
        else:
            raise PermanentPublishError(
                f"broker {self.name!r}: {destination!r} is neither a queue URL nor a queue name "
                "(1-80 letters, digits, '-' or '_', FIFO queues ending in '.fifo')"
            )
        self._queues[destination] = queue
        return queue

    async def _send(self, sending: _Sending, entries: list[_Entry], results: list[Outcome]) -> None:
        """Send `entries` (for FIFO, one per group) and retry those worth retrying at once."""
        for delay in (0.0, *ENTRY_RETRIES):
            if not entries or sending.halted is not None:
                return
            if delay:
                await asyncio.sleep(delay)
            calls = list(chunks(entries, MAX_ENTRIES, MAX_CALL_BYTES))
            sent = await asyncio.gather(*(self._send_chunk(sending, chunk) for chunk in calls))
            entries = []
            for chunk, chunk_results in zip(calls, sent, strict=True):
                for entry, result in zip(chunk, chunk_results, strict=True):
                    results[entry.index] = result.outcome
                    if result.retry_now:
                        entries.append(entry)

    async def _send_chunk(self, sending: _Sending, chunk: list[_Entry]) -> list[_Result]:
        queue = sending.queue
        response = await self._call(sending, chunk)
        if isinstance(response, PublishError):
            if response.permanent and len(chunk) > 1:
                # The call failed as a whole because of one of its messages: find which one.
                singles = await asyncio.gather(*(self._send_chunk(sending, [e]) for e in chunk))
                return [result for (result,) in singles]
            if not response.permanent:
                # SQS unreachable, throttling, no such queue...: the calls still waiting
                # would only fail the same way, each after its own timeout.
                sending.halted = sending.halted or response
            return [_Result(response)] * len(chunk)
        accepted = {s["Id"] for s in response.get("Successful", ())}
        failed = {f["Id"]: f for f in response.get("Failed", ())}
        results: list[_Result] = []
        for entry in chunk:
            entry_id = entry.request["Id"]
            if entry_id in accepted:
                results.append(_Result(None))
            elif entry_id in failed:
                results.append(self._entry_error(failed[entry_id], queue))
            else:
                results.append(
                    _Result(self._transient(queue.name, "no result for the entry"), True)
                )
        return results

    async def _call(self, sending: _Sending, chunk: list[_Entry]) -> dict[str, Any] | PublishError:
        """One SendMessageBatch: its response, or why it failed as a whole."""
        assert self._slots is not None
        async with self._slots:
            if sending.halted is not None:
                return sending.halted  # not sent
            try:
                response: dict[str, Any] = await self._client.send_message_batch(
                    QueueUrl=sending.queue.url, Entries=[e.request for e in chunk]
                )
            except Exception as exc:  # noqa: BLE001 - classified, not swallowed
                return self._call_error(exc, sending.queue.name)
            return response

    # -- messages to entries -------------------------------------------------------------------

    def _entry(self, index: int, message: Message, fifo: bool) -> _Entry:
        try:
            body = message.body.decode()
        except UnicodeDecodeError:
            return self._invalid(index, message, "the body is not UTF-8 text")
        if not body or _NOT_XML_CHAR.search(body):
            return self._invalid(
                index, message, "the body is empty or has characters SQS does not accept"
            )
        attributes = message_attributes(message)
        size = len(message.body)
        for name, value in attributes.items():
            text = value["StringValue"]
            if _NOT_XML_CHAR.search(text):
                return self._invalid(
                    index, message, f"attribute {name} has characters SQS does not accept"
                )
            size += len(name) + len("String") + len(text.encode())
        if size > MAX_MESSAGE_BYTES:
            return self._invalid(
                index,
                message,
                f"{size} bytes (body and attributes) is more than SQS's maximum of 1 MiB",
            )
        request: dict[str, Any] = {
            "Id": str(index),
            "MessageBody": body,
            "MessageAttributes": attributes,
        }
        if fifo:
            request["MessageGroupId"] = group_id(message.key)
            request["MessageDeduplicationId"] = deduplication_id(message.id)
        return _Entry(index, message, request, size)

    def _invalid(self, index: int, message: Message, reason: str) -> _Entry:
        error = PermanentPublishError(f"broker {self.name!r}: message {message.id!r}: {reason}")
        return _Entry(index, message, {}, 0, error)

    # -- errors --------------------------------------------------------------------------------

    def _call_error(self, exc: BaseException, queue: str) -> PublishError:
        """Why a whole call failed: permanent only when a message is to blame."""
        if isinstance(exc, ClientError):
            code, text = error_code(exc), client_error_text(exc)
            if code in _QUEUE_GONE:
                self._forget(queue)
                return self._transient(queue, f"the queue does not exist: {text}")
            if code in _MESSAGE_FAULT:
                return self._permanent(queue, text)
            return self._transient(queue, text)
        if isinstance(exc, NoCredentialsError):
            return self._transient(queue, "no AWS credentials found in the standard chain")
        return self._transient(queue, error_text(exc))

    def _entry_error(self, failure: dict[str, Any], queue: _Queue) -> _Result:
        code = strip(str(failure.get("Code", "")))
        text = f"{code}: {failure.get('Message') or 'no message'}"
        if code in THROTTLED or code in SERVER_FAULT or not failure.get("SenderFault"):
            return _Result(self._transient(queue.name, text), retry_now=True)
        if code in _QUEUE_GONE:
            self._forget(queue.name)
            return _Result(self._transient(queue.name, text))
        if is_configuration_fault(code):
            return _Result(self._transient(queue.name, text))  # configuration, not the message
        return _Result(self._permanent(queue.name, text))

    def _transient(self, queue: str, text: str) -> TransientPublishError:
        return TransientPublishError(f"broker {self.name!r}: queue {queue!r}: {text}")

    def _permanent(self, queue: str, text: str) -> PermanentPublishError:
        return PermanentPublishError(f"broker {self.name!r}: queue {queue!r}: {text}")

    def _forget(self, queue: str) -> None:
        for destination, known in list(self._queues.items()):
            if queue in (destination, known.name):
                del self._queues[destination]
