"""The batch flow SQS's SendMessageBatch and SNS's PublishBatch share, written once.

Entries, their FIFO layers, the in-adapter retries of failed entries, and what a call's
`Failed` entries mean. The batch shapes are every adapter's (relay.brokers._batch).
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from botocore.exceptions import ClientError, NoCredentialsError

from relay.brokers._aws import (
    CONCURRENCY,
    ENTRY_RETRIES,
    NOT_XML_CHAR,
    SERVER_FAULT,
    THROTTLED,
    AwsPublisher,
    Service,
    client_error_text,
    deduplication_id,
    error_code,
    error_text,
    group_id,
    is_configuration_fault,
    message_attributes,
    strip,
)
from relay.brokers._batch import chunks, layers, not_sent, per_destination, ready
from relay.config.brokers import AwsConfig
from relay.core.publishing import Message, Outcome
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt


@dataclass(frozen=True, slots=True)
class Target:
    """A queue or topic: its name (for messages and errors), its address, its kind."""

    name: str
    address: str  # the queue URL, the topic ARN
    fifo: bool


@dataclass(frozen=True, slots=True)
class BatchService(Service):
    """The rest of what sets SQS and SNS apart in the batch flow they share."""

    body_field: str  # the entry's body: "MessageBody"
    max_message_bytes: int  # body and attributes; a bigger message is not sent
    message_fault: frozenset[str]  # codes of a call refused because of a message
    max_entries: int = 10  # per call (SQS's and SNS's limit)
    # All the entries of one call: SNS's limit, and SQS's before 2025 (now a budget).
    max_call_bytes: int = 256 * 1024


@dataclass(slots=True)
class Entry:
    index: int  # in the batch
    message: Message
    request: dict[str, Any]  # the API's batch request entry; empty when `error`
    size: int
    error: UnsendableError | None = None  # refused before sending


@dataclass(slots=True)
class _Sending:
    """One target's share of a publish."""

    target: Target
    halted: PublishError | None = None  # a call failed as a whole: send no more


@dataclass(frozen=True, slots=True)
class _Result:
    outcome: Outcome
    retry_now: bool = False  # worth an in-adapter retry before returning


class EntryBatchPublisher(AwsPublisher):
    """SQS's SendMessageBatch and SNS's PublishBatch work alike: up to 10 entries a call, each
    entry stored or failed on its own (`Successful`, `Failed` with `SenderFault`). This is
    their publish, written once; a subclass describes its service (`spec`), finds its targets
    and makes its call.

    FIFO targets get the batch in layers (layer n: the n-th message of every group), one after
    the other, and nothing after a layer that failed: a later message of a group is never
    stored before an earlier one that failed. Entries failed for a reason worth retrying at
    once are sent again, alone, before `publish` returns; messages stored after the first
    failure are remembered (Accepted) so that the core's re-send does not send them twice.
    """

    spec: ClassVar[BatchService]

    def __init__(self, name: str, config: AwsConfig) -> None:
        super().__init__(name, config)
        self._slots: asyncio.Semaphore | None = None
        self._targets: dict[str, Target] = {}

    def name_problem(self, destination: str) -> str | None:
        """Why `destination` cannot name a target of this service; None when it can."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`).
        A queue's own MaximumMessageSize only the service knows."""
        destination = message.destination
        if (problem := self.name_problem(destination)) is not None:
            return f"broker {self.name!r}: {problem}"
        entry = self._entry(0, message, destination.rstrip("/").endswith(".fifo"))
        return None if entry.error is None else str(entry.error)

    def dedup_scope(self, destination: str) -> str | None:
        """A FIFO queue or topic drops a message whose deduplication id (the message id) it
        saw within five minutes; a standard one keeps every message."""
        if not destination.rstrip("/").endswith(".fifo"):
            return None
        return f"broker {self.name!r}, {destination.rstrip('/')}"

    @abstractmethod
    async def _find(self, destination: str) -> Target:
        """The target a destination names; raises PublishError."""

    @abstractmethod
    async def _batch_call(self, target: Target, requests: list[dict[str, Any]]) -> Any:
        """One batch call's response."""

    def _opened(self) -> None:
        self._slots = asyncio.Semaphore(CONCURRENCY)

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if (done := await ready(self.connect, len(messages))) is not None:
            return done
        results = not_sent(
            len(messages), f"an earlier message for its FIFO {self.spec.kind} failed", self.name
        )
        await per_destination(messages, self._publish_to, results)
        self._accepted.remember(messages, results)
        return results

    async def _target(self, destination: str) -> Target:
        if (target := self._targets.get(destination)) is None:
            target = self._targets[destination] = await self._find(destination)
        return target

    async def _publish_to(
        self, destination: str, batch: list[tuple[int, Message]], results: list[Outcome]
    ) -> None:
        try:
            target = await self._target(destination)
        except PublishError as exc:
            for index, _ in batch:
                results[index] = exc
            return
        entries: list[Entry] = []
        for index, message in batch:
            if self._accepted.take(message):
                results[index] = None  # stored before; the core re-sends it
                self.duplicates += 1
            else:
                entries.append(self._entry(index, message, target.fifo))
        sending = _Sending(target)
        for layer in layers(entries) if target.fifo else [entries]:
            for entry in layer:
                if entry.error is not None:
                    results[entry.index] = entry.error
            await self._send(sending, [e for e in layer if e.error is None], results)
            if target.fifo and any(results[e.index] is not None for e in layer):
                return  # nothing of a later layer may overtake a failed message

    async def _send(self, sending: _Sending, entries: list[Entry], results: list[Outcome]) -> None:
        """Send `entries` (for FIFO, one per group) and retry those worth retrying at once."""
        for delay in (0.0, *ENTRY_RETRIES):
            if not entries or sending.halted is not None:
                return
            if delay:
                await asyncio.sleep(delay)
            calls = list(chunks(entries, self.spec.max_entries, self.spec.max_call_bytes))
            sent = await asyncio.gather(*(self._send_chunk(sending, chunk) for chunk in calls))
            entries = []
            for chunk, chunk_results in zip(calls, sent, strict=True):
                for entry, result in zip(chunk, chunk_results, strict=True):
                    results[entry.index] = result.outcome
                    if result.retry_now:
                        entries.append(entry)

    async def _send_chunk(self, sending: _Sending, chunk: list[Entry]) -> list[_Result]:
        target = sending.target
        response = await self._call(sending, chunk)
        if isinstance(response, PublishError):
            if response.permanent and len(chunk) > 1:
                # The call failed as a whole because of one of its messages: find which one.
                singles = await asyncio.gather(*(self._send_chunk(sending, [e]) for e in chunk))
                return [result for (result,) in singles]
            if not response.permanent:
                # Unreachable, throttling, no such target...: the calls still waiting
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
                results.append(self._entry_error(failed[entry_id], target))
            else:
                results.append(
                    _Result(self.transient(target.name, "no result for the entry"), True)
                )
        return results

    async def _call(self, sending: _Sending, chunk: list[Entry]) -> dict[str, Any] | PublishError:
        """One batch call: its response, or why it failed as a whole."""
        assert self._slots is not None
        async with self._slots:
            if sending.halted is not None:
                return sending.halted  # not sent
            try:
                response: dict[str, Any] = await self._batch_call(
                    sending.target, [e.request for e in chunk]
                )
            except Exception as exc:  # noqa: BLE001 - classified, not swallowed
                return self.call_error(exc, sending.target.name)
            return response

    def _entry(self, index: int, message: Message, fifo: bool) -> Entry:
        """The batch request entry of a message, or why the service would refuse it."""
        spec = self.spec
        try:
            body = message.body.decode()
        except UnicodeDecodeError:
            return self.invalid(index, message, "the body is not UTF-8 text")
        if not body or NOT_XML_CHAR.search(body):
            return self.invalid(
                index, message, f"the body is empty or has characters {spec.title} does not accept"
            )
        attributes = message_attributes(message)
        size = len(message.body)
        for name, value in attributes.items():
            text = value["StringValue"]
            if NOT_XML_CHAR.search(text):
                return self.invalid(
                    index, message, f"attribute {name} has characters {spec.title} does not accept"
                )
            size += len(name) + len("String") + len(text.encode())
        if size > spec.max_message_bytes:
            limit = f"{spec.title}'s maximum of {_size_text(spec.max_message_bytes)}"
            return self.invalid(
                index, message, f"{size} bytes (body and attributes) is more than {limit}"
            )
        request: dict[str, Any] = {
            "Id": str(index),
            spec.body_field: body,
            "MessageAttributes": attributes,
        }
        if fifo:
            request["MessageGroupId"] = group_id(message.key)
            request["MessageDeduplicationId"] = deduplication_id(message.id)
        return Entry(index, message, request, size)

    def invalid(self, index: int, message: Message, reason: str) -> Entry:
        error = UnsendableError(f"broker {self.name!r}: message {excerpt(message.id)}: {reason}")
        return Entry(index, message, {}, 0, error)

    # -- errors --------------------------------------------------------------------------------

    def call_error(self, exc: BaseException, target: str) -> PublishError:
        """Why a whole call failed: permanent only when a message is to blame."""
        if isinstance(exc, ClientError):
            code, text = error_code(exc), client_error_text(exc)
            if code in self.spec.gone:
                self._forget(target)
                return self.transient(target, f"the {self.spec.kind} does not exist: {text}")
            if code in self.spec.message_fault:
                return self.permanent(target, text)
            return self.transient(target, text)
        if isinstance(exc, NoCredentialsError):
            return self.transient(target, "no AWS credentials found in the standard chain")
        return self.transient(target, error_text(exc))

    def _entry_error(self, failure: dict[str, Any], target: Target) -> _Result:
        code = strip(str(failure.get("Code", "")))
        text = f"{code}: {failure.get('Message') or 'no message'}"
        if code in THROTTLED or code in SERVER_FAULT or not failure.get("SenderFault"):
            return _Result(self.transient(target.name, text), retry_now=True)
        if code in self.spec.gone:
            self._forget(target.name)
            return _Result(self.transient(target.name, text))
        if is_configuration_fault(code):
            return _Result(self.transient(target.name, text))  # configuration, not the message
        return _Result(self.permanent(target.name, text))

    def transient(self, target: str, text: str) -> TransientPublishError:
        return TransientPublishError(f"broker {self.name!r}: {self.spec.kind} {target!r}: {text}")

    def permanent(self, target: str, text: str) -> PermanentPublishError:
        return PermanentPublishError(f"broker {self.name!r}: {self.spec.kind} {target!r}: {text}")

    def _forget(self, target: str) -> None:
        for destination, known in list(self._targets.items()):
            if target in (destination, known.name):
                del self._targets[destination]


def _size_text(size: int) -> str:
    return f"{size // (1024 * 1024)} MiB" if size % (1024 * 1024) == 0 else f"{size // 1024} KiB"
