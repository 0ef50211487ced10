"""Amazon SNS publisher, standard and FIFO topics, with aioboto3.

A message's `destination` is a topic ARN, or a topic name that the relay makes an ARN of
with the account of its credentials (STS GetCallerIdentity, once) and the region; a name
ending in `.fifo` is a FIFO topic. Messages go out with PublishBatch, up to 10 entries and
256 KiB per call. On FIFO topics the message key is the MessageGroupId and the message id
the MessageDeduplicationId, under SQS's rules (hashed where SNS would refuse them: see
relay.brokers._aws), so a re-send within the 5-minute window is dropped.

PublishBatch works as SQS's SendMessageBatch does, so the flow is theirs (EntryBatchPublisher):
FIFO batches in layers, one message per group per layer and nothing after a failed layer;
entries failed for a reason worth retrying at once are retried alone; what SNS stored after
a failure is remembered, so that the core's re-send does not send it twice.

SNS delivers to its subscribers; an SQS queue subscribed with RawMessageDelivery gets the
body as it is and the message attributes as SQS message attributes, which is why they are
held to SQS's limit of 10. Credentials come from the standard AWS chain and are never logged.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from relay.brokers._aws import MESSAGE_FAULT, is_configuration_fault
from relay.brokers._aws_batch import BatchService, EntryBatchPublisher, Target
from relay.config import SnsBrokerConfig
from relay.errors import UnsendableError

MAX_MESSAGE_BYTES = 256 * 1024  # one message, body and attributes (an SNS limit)

_TOPIC_NAME = re.compile(r"[A-Za-z0-9_-]{1,256}|[A-Za-z0-9_-]{1,251}\.fifo")
_TOPIC_ARN = re.compile(r"arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:([A-Za-z0-9_.-]{1,256})")

# Error codes, as botocore reports them.
_TOPIC_GONE = frozenset({"NotFound", "NotFoundException", "ResourceNotFound"})
_MESSAGE_FAULT = MESSAGE_FAULT | {"InvalidParameter", "ParameterValueInvalid", "ValidationError"}


class SnsPublisher(EntryBatchPublisher):
    spec = BatchService(
        "sns", "SNS", "topic", _TOPIC_GONE, "Message", MAX_MESSAGE_BYTES, _MESSAGE_FAULT
    )

    def __init__(self, name: str, config: SnsBrokerConfig) -> None:
        super().__init__(name, config)
        self._account: tuple[str, str] | None = None  # (partition, account) of the credentials

    def _listing(self) -> tuple[Awaitable[Any], Callable[[str], bool]]:
        """ListTopics; an AuthorizationError answer proves the credentials too."""
        return self._client.list_topics(), is_configuration_fault

    async def _lookup(self, destination: str) -> Any:
        """GetTopicAttributes of the topic (its ARN may take an STS call: see `_find`)."""
        target = await self._find(destination)
        return self._client.get_topic_attributes(TopicArn=target.address)

    def name_problem(self, destination: str) -> str | None:
        if _TOPIC_ARN.fullmatch(destination) or _TOPIC_NAME.fullmatch(destination):
            return None
        return (
            f"{destination!r} is neither a topic ARN nor a topic name (1-256 letters, digits,"
            " '-' or '_', FIFO topics ending in '.fifo')"
        )

    async def _find(self, destination: str) -> Target:
        if match := _TOPIC_ARN.fullmatch(destination):
            name = match.group(1)
            return Target(name, destination, name.endswith(".fifo"))
        if problem := self.name_problem(destination):
            raise UnsendableError(f"broker {self.name!r}: {problem}")
        partition, account = await self._caller()
        arn = f"arn:{partition}:sns:{self._region}:{account}:{destination}"
        return Target(destination, arn, destination.endswith(".fifo"))

    async def _caller(self) -> tuple[str, str]:
        """(partition, account) of the credentials, asked of STS once: a topic name's ARN."""
        if self._account is None:
            assert self._stack is not None and self._session is not None  # connected
            try:
                sts = await self._stack.enter_async_context(
                    self._session.client("sts", endpoint_url=self._endpoint_url)
                )
                identity = await sts.get_caller_identity()
            except Exception as exc:
                raise self.call_error(exc, "(account)") from exc
            self._account = (identity["Arn"].split(":")[1], identity["Account"])
        return self._account

    async def _batch_call(self, target: Target, requests: list[dict[str, Any]]) -> Any:
        return await self._client.publish_batch(
            TopicArn=target.address, PublishBatchRequestEntries=requests
        )
