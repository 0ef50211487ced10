"""What the AWS adapters (SQS, SNS, Kinesis) share, written once.

The client (botocore settings, credentials from the standard chain, never logged), how
botocore errors are read and classified, the CloudEvents message attributes under the
10-attribute limit SQS and SNS share, the FIFO MessageGroupId and MessageDeduplicationId
rules (SNS FIFO topics take SQS's), and the batch shapes: per-key layers, chunks under a
count and a byte budget, and the memory of messages already accepted after a failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.core.publishing import Message, Outcome, cloudevent_attributes

MAX_ATTRIBUTES = 10  # message attributes per message (an SQS limit; SNS to SQS carries them)
CONCURRENCY = 8  # calls in flight per publisher (and HTTP connections in the pool)
ENTRY_RETRIES = (0.05, 0.2)  # delays of the in-adapter retries of failed entries
REMEMBER_FOR = 300.0  # seconds an accepted message is remembered: the FIFO dedup window
REMEMBER_MAX = 20_000

# MessageGroupId and MessageDeduplicationId: 1 to 128 letters, digits and punctuation.
_ID = re.compile(r"[!-~]{1,128}")
_ID_CHARS = re.compile(r"[!-~]+")
# The two shapes of a hashed MessageGroupId (see group_id).
_HASHED_GROUP = re.compile(r"~sha256:[0-9a-f]{64}|[!-~]{111}~[0-9a-f]{16}")
# Characters SQS and SNS accept in a body or a String attribute (XML 1.0 Char).
NOT_XML_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

THROTTLED = {
    "RequestThrottled",
    "Throttling",
    "ThrottlingException",
    "Throttled",
    "TooManyRequestsException",
    "KmsThrottled",
    "KMSThrottling",
    "ProvisionedThroughputExceededException",
}
SERVER_FAULT = {
    "InternalError",
    "InternalFailure",
    "ServiceUnavailable",
    "RequestTimeout",
    "InternalFailureException",
}


async def open_client(
    session: aioboto3.Session,
    service: str,
    endpoint_url: str | None,
    connect_timeout: float,
    ack_timeout: float,
) -> tuple[Any, contextlib.AsyncExitStack]:
    """A client and the stack that closes it. botocore tries a failed call once more (stale
    keep-alive connections); every other retry is the outbox's backoff, visible in status."""
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=ack_timeout,
        retries={"mode": "standard", "total_max_attempts": 2},
        max_pool_connections=CONCURRENCY,
    )
    stack = contextlib.AsyncExitStack()
    try:
        client = await stack.enter_async_context(
            session.client(service, endpoint_url=endpoint_url, config=config)
        )
    except BaseException:
        await stack.aclose()
        raise
    return client, stack


# -- errors ------------------------------------------------------------------------------------


def error_code(exc: ClientError) -> str:
    """The error's code, without SQS's `AWS.SimpleQueueService.` prefix."""
    error = exc.response.get("Error", {})
    return strip(str(error.get("QueryErrorCode") or error.get("Code") or ""))


def strip(code: str) -> str:
    return code.removeprefix("AWS.SimpleQueueService.")


def client_error_text(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    return f"{error_code(exc) or 'error'}: {error.get('Message') or 'no message'}"


def error_text(exc: BaseException) -> str:
    if isinstance(exc, BotoCoreError):
        return str(exc)
    return str(exc) or type(exc).__name__


def is_configuration_fault(code: str) -> bool:
    """Credentials, permissions, KMS keys: the operator's to fix, never the message's."""
    lowered = code.lower()
    return lowered.startswith("kms") or "accessdenied" in lowered or "authorization" in lowered


# -- message attributes ------------------------------------------------------------------------


def message_attributes(message: Message) -> dict[str, dict[str, str]]:
    """CloudEvents in binary mode, named as in the Kafka binding (`ce_` prefix), plus
    `content-type`, as String attributes in the shape SQS and SNS both take; empty values
    left out (both refuse them; an absent attribute says the same).

    At most MAX_ATTRIBUTES: a message with every optional attribute has exactly ten
    today, and should one more ever be added, the least useful ones go first (_KEEP).
    """
    values = cloudevent_attributes(message, "ce_")
    values["content-type"] = message.content_type
    if len(values) > MAX_ATTRIBUTES:
        values = within_limit(values)
    return {k: {"DataType": "String", "StringValue": v} for k, v in values.items() if v}


# Which attributes are kept first when there are more than SQS and SNS take: what the
# CloudEvents SDKs require, the data's content type, then the optional ones. The partition
# key comes last: a FIFO MessageGroupId already orders by it, and standard ones have no order.
_KEEP = (
    "ce_specversion",
    "ce_id",
    "ce_type",
    "ce_source",
    "content-type",
    "ce_time",
    "ce_traceparent",
    "ce_tracestate",
    "ce_dataschema",
    "ce_partitionkey",
)


def within_limit(values: dict[str, str]) -> dict[str, str]:
    """The first MAX_ATTRIBUTES in _KEEP order; an attribute not listed there goes first."""
    rank = {name: i for i, name in enumerate(_KEEP)}
    kept = sorted(values, key=lambda name: rank.get(name, len(_KEEP)))[:MAX_ATTRIBUTES]
    return {name: values[name] for name in values if name in kept}


# -- FIFO ids ----------------------------------------------------------------------------------


def group_id(key: str) -> str:
    """A valid MessageGroupId for `key`, the same every time, and no other key's.

    A key SQS accepts is used as it is. A longer one of the allowed characters becomes a
    prefix and a hash (still readable); any other key (empty, spaces, non-ASCII) becomes
    `~sha256:` and its digest. A key that already has one of those two shapes is hashed
    too, so that no key used as it is can share its group with a hashed one.
    """
    if _ID.fullmatch(key) and not _HASHED_GROUP.fullmatch(key):
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    if len(key) > 128 and _ID_CHARS.fullmatch(key):
        return f"{key[:111]}~{digest[:16]}"
    return f"~sha256:{digest}"


def deduplication_id(message_id: str) -> str:
    """The id itself when SQS accepts it, else `sha256:` and its hex digest (stable)."""
    if _ID.fullmatch(message_id):
        return message_id
    return "sha256:" + hashlib.sha256(message_id.encode()).hexdigest()


# -- batch shapes ------------------------------------------------------------------------------


class Keyed(Protocol):
    @property
    def message(self) -> Message: ...


class Sized(Protocol):
    @property
    def size(self) -> int: ...


K = TypeVar("K", bound=Keyed)
S = TypeVar("S", bound=Sized)


def layers(entries: list[K]) -> list[list[K]]:
    """Layer n: the n-th entry of each key, in position order; at most one per group."""
    depth: dict[str, int] = {}
    found: list[list[K]] = []
    for entry in entries:
        n = depth.get(entry.message.key, 0)
        depth[entry.message.key] = n + 1
        if n == len(found):
            found.append([])
        found[n].append(entry)
    return found


def chunks(entries: list[S], max_entries: int, max_bytes: int) -> Iterator[list[S]]:
    """Consecutive runs of up to `max_entries` entries and `max_bytes` (bigger ones alone)."""
    chunk: list[S] = []
    size = 0
    for entry in entries:
        if chunk and (len(chunk) == max_entries or size + entry.size > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += entry.size
    if chunk:
        yield chunk


class Accepted:
    """Messages the service stored after the first failure of a publish: the core offers
    them again, and they are acknowledged without being sent twice (for REMEMBER_FOR)."""

    def __init__(self) -> None:
        self._since: OrderedDict[Message, float] = OrderedDict()

    def take(self, message: Message) -> bool:
        """Whether `message` was stored before (and forget it: it is acknowledged now)."""
        return bool(self._since) and self._since.pop(message, None) is not None

    def remember(self, messages: Sequence[Message], results: Sequence[Outcome]) -> None:
        first = next((i for i, r in enumerate(results) if r is not None), len(results))
        now = time.monotonic()
        for index in range(first + 1, len(results)):
            if results[index] is None:
                self._since[messages[index]] = now
        while self._since:
            message, since = next(iter(self._since.items()))
            if len(self._since) <= REMEMBER_MAX and now - since < REMEMBER_FOR:
                break
            del self._since[message]
