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

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from relay.brokers._aws import MESSAGE_FAULT
from relay.brokers._aws_batch import BatchService, EntryBatchPublisher, Target
from relay.config.base import path_step
from relay.errors import UnsendableError

MAX_MESSAGE_BYTES = 1024 * 1024  # no queue takes more (body and attributes), so not sent

_QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]{1,80}|[A-Za-z0-9_-]{1,75}\.fifo")

# Error codes, as botocore reports them (the `AWS.SimpleQueueService.` prefix removed).
_QUEUE_GONE = frozenset({"QueueDoesNotExist", "NonExistentQueue", "QueueDeletedRecently"})
_MESSAGE_FAULT = MESSAGE_FAULT | {
    "InvalidMessageContents",
    "MessageTooLong",
    "InvalidAttributeName",
    "InvalidAttributeValue",
}


class SqsPublisher(EntryBatchPublisher):
    spec = BatchService(
        "sqs", "SQS", "queue", _QUEUE_GONE, "MessageBody", MAX_MESSAGE_BYTES, _MESSAGE_FAULT
    )

    def _listing(self) -> tuple[Awaitable[Any], Callable[[str], bool]]:
        """ListQueues; an AccessDenied answer proves the credentials too."""
        return self._client.list_queues(MaxResults=1), _access_denied

    async def _lookup(self, destination: str) -> Any:
        """GetQueueUrl of a queue name, GetQueueAttributes of a queue URL."""
        if (problem := self.name_problem(destination)) is not None:
            raise UnsendableError(f"broker {self.name!r}: {problem}")
        if destination.startswith(("https://", "http://")):
            return self._client.get_queue_attributes(
                QueueUrl=destination, AttributeNames=["QueueArn"]
            )
        return self._client.get_queue_url(QueueName=destination)

    def name_problem(self, destination: str) -> str | None:
        """A queue URL's path names the queue: a value of the event in it must not step out
        of its place (`.../123/x/../other` reaches `other`: see relay.config.base.path_step)."""
        if destination.startswith(("https://", "http://")):
            if (step := path_step(urlsplit(destination).path)) is not None:
                return (
                    f"{destination!r} holds the path step {step!r}, which would be resolved to"
                    " another queue"
                )
            return None
        if _QUEUE_NAME.fullmatch(destination):
            return None
        return (
            f"{destination!r} is neither a queue URL nor a queue name (1-80 letters, digits,"
            " '-' or '_', FIFO queues ending in '.fifo')"
        )

    async def _find(self, destination: str) -> Target:
        if (problem := self.name_problem(destination)) is not None:
            raise UnsendableError(f"broker {self.name!r}: {problem}")
        if destination.startswith(("https://", "http://")):
            name = urlsplit(destination).path.rstrip("/").rpartition("/")[2]
            return Target(name, destination, name.endswith(".fifo"))
        try:
            response = await self._client.get_queue_url(QueueName=destination)
        except Exception as exc:
            raise self.call_error(exc, destination) from exc
        return Target(destination, response["QueueUrl"], destination.endswith(".fifo"))

    async def _batch_call(self, target: Target, requests: list[dict[str, Any]]) -> Any:
        return await self._client.send_message_batch(QueueUrl=target.address, Entries=requests)


def _access_denied(code: str) -> bool:
    """ListQueues refused for want of permission: the credentials were good enough to ask."""
    return "AccessDenied" in code
