"""What the AWS adapters (SQS, SNS, Kinesis) share, written once.

The client (botocore settings, credentials from the standard chain, never logged), how
botocore errors are read and classified, the CloudEvents message attributes under the
10-attribute limit SQS and SNS share, the FIFO MessageGroupId and MessageDeduplicationId
rules (SNS FIFO topics take SQS's), and the publishers' client and `relay check`
(AwsPublisher), which remembers messages accepted after a failure for the FIFO dedup window
(the memory is every adapter's: relay.brokers._batch). The batch flow the SQS and SNS batch
calls share is relay.brokers._aws_batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.brokers._batch import (
    Accepted,
)
from relay.config.brokers import AwsConfig
from relay.core.publishing import Message, cloudevent_attributes
from relay.errors import PublishError, TransientPublishError

MAX_ATTRIBUTES = 10  # message attributes per message (an SQS limit; SNS to SQS carries them)
CONCURRENCY = 8  # calls in flight per publisher (and HTTP connections in the pool)
ENTRY_RETRIES = (0.05, 0.2)  # delays of the in-adapter retries of failed entries
REMEMBER_FOR = 300.0  # seconds an accepted message is remembered: the FIFO dedup window

# MessageGroupId and MessageDeduplicationId: 1 to 128 letters, digits and punctuation.
_ID = re.compile(r"[!-~]{1,128}")
_ID_CHARS = re.compile(r"[!-~]+")
# The two shapes of a hashed MessageGroupId (see group_id).
_HASHED_GROUP = re.compile(r"~sha256:[0-9a-f]{64}|[!-~]{111}~[0-9a-f]{16}")
# The shape of a hashed MessageDeduplicationId (see deduplication_id).
_HASHED_ID = re.compile(r"sha256:[0-9a-f]{64}")
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
# A call refused because of one of its messages, as SQS and SNS both word it: sending it
# again cannot help. Each service adds its own codes.
MESSAGE_FAULT = frozenset({"InvalidParameterValue", "BatchRequestTooLong"})
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
    """The id itself when SQS accepts it, else `sha256:` and its hex digest (stable). An id
    already of that shape is hashed too: used as it is, it would be the deduplication id of
    the other event whose id hashes to it, and the queue would drop one of the two."""
    if _ID.fullmatch(message_id) and not _HASHED_ID.fullmatch(message_id):
        return message_id
    return "sha256:" + hashlib.sha256(message_id.encode()).hexdigest()


# -- the client, and relay check ---------------------------------------------------------------


def no_code_is_fine(code: str) -> bool:
    """No error code is fine: the default of a call that is not a listing."""
    return False


class Prober(NamedTuple):
    """Whose calls `relay check` makes: the broker, what a target is, the codes saying it does
    not exist, and how a failed call reads at publish."""

    broker: str
    kind: str
    gone: Collection[str]
    call_error: Callable[[BaseException, str], PublishError]


async def probe_call(
    call: Awaitable[Any],
    target: str,
    by: Prober,
    denied_is_fine: Callable[[str], bool] = no_code_is_fine,
) -> str | None:
    """`relay check`'s line about one call, None when it went through: a target that is gone
    is named so; a code `denied_is_fine` takes (of a listing) proves the credentials."""
    try:
        await call
    except Exception as exc:  # noqa: BLE001 - each becomes a line of the report
        code = error_code(exc) if isinstance(exc, ClientError) else None
        if code is not None and code in by.gone:
            return (
                f"broker {by.broker!r}: {by.kind} {target!r} does not exist: every message to"
                " it would be retried for ever; create it"
            )
        if code is not None and denied_is_fine(code):
            return None  # authenticated, just not allowed to list
        return str(by.call_error(exc, target))
    return None


@dataclass(frozen=True, slots=True)
class Service:
    """What a publisher's service is called, and which of its error codes say a target is gone."""

    service: str  # botocore's service name: "sqs"
    title: str  # in messages: "SQS"
    kind: str  # what a target is: "queue"
    gone: frozenset[str]  # codes saying the target does not exist


class AwsPublisher(ABC):
    """What the AWS adapters' publishers share: the client, created at `connect` and closed
    with its stack, the messages it remembers as accepted, and `relay check`'s calls."""

    spec: ClassVar[Service]

    def __init__(self, name: str, config: AwsConfig) -> None:
        self.name = name
        self._region = config.region
        self._session: aioboto3.Session | None = None  # made at `connect`, or shared
        self._endpoint_url = config.endpoint_url
        self._timeouts = (config.connect_timeout, config.ack_timeout)
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._accepted = Accepted(REMEMBER_FOR)
        self.duplicates = 0
        self.last_duplicates: tuple[int, ...] = ()  # the service cannot tell which

    async def connect(self) -> None:
        """Create the client; no request is made, so an unreachable service shows at publish."""
        if self._client is not None:
            return
        if self._session is None:
            self._session = aioboto3.Session(region_name=self._region)
        try:
            self._client, self._stack = await open_client(
                self._session, self.spec.service, self._endpoint_url, *self._timeouts
            )
        except Exception as exc:
            what = f"cannot create the {self.spec.title} client"
            raise TransientPublishError(f"broker {self.name!r}: {what}: {error_text(exc)}") from exc
        self._opened()

    @classmethod
    def for_lanes(cls, name: str, config: Any, count: int) -> list[Self]:
        """`count` publishers (an outbox's lanes) sharing one AWS session, each with a client
        of its own: a session loads botocore's models, and eight Kinesis lanes with a session
        each took 67 MiB and 1.2 s, against 10 MiB and 0.6 s for one."""
        session = aioboto3.Session(region_name=config.region)
        publishers = [cls(name, config) for _ in range(count)]
        for publisher in publishers:
            publisher._session = session
        return publishers

    @abstractmethod
    def _opened(self) -> None:
        """Set up what goes with a new client."""

    async def close(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(Exception):
                await stack.aclose()

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: ask the service after each target (`_lookup`), which proves the
        credentials too; with no target known in advance, a listing does (`_listing`). Nothing
        is sent; what is wrong, one line each."""
        await self.connect()
        by = Prober(self.name, self.spec.kind, self.spec.gone, self.call_error)
        try:
            if not destinations:
                listing, denied_is_fine = self._listing()
                problem = await probe_call(listing, "(any)", by, denied_is_fine)
                return [problem] if problem else []
            problems = []
            for destination in sorted(destinations):
                try:
                    call = await self._lookup(destination)
                except PublishError as exc:
                    problems.append(str(exc))
                    continue
                if problem := await probe_call(call, destination, by):
                    problems.append(problem)
            return problems
        finally:
            await self.close()

    @abstractmethod
    def _listing(self) -> tuple[Awaitable[Any], Callable[[str], bool]]:
        """A call listing targets, and which of its error codes prove the credentials all the
        same (refused for want of permission to list)."""

    @abstractmethod
    async def _lookup(self, destination: str) -> Any:
        """A call (an awaitable, not awaited yet) asking after the destination's target;
        raises PublishError when the destination names none."""

    @abstractmethod
    def call_error(self, exc: BaseException, target: str) -> PublishError:
        """Why a whole call failed."""
