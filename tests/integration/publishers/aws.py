"""What the SQS and SNS publisher tests share: their kits' common part and EntryFaults.

SNS reaches the tests through an SQS queue subscribed with RawMessageDelivery, so a message
is read back the same way from both (attributes, FIFO group and deduplication id), and the
two batch calls (SendMessageBatch, PublishBatch) fail entries the same way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from relay.brokers._aws_batch import EntryBatchPublisher
from relay.core.publishing import Message
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.integration.publishers.base import H
from tests.support.net import free_port
from tests.support.sqs_server import attribute

# Per service: the batch operation and its list of entries, as botocore names them.
_BATCH_CALLS = {
    "sqs": ("SendMessageBatch", "Entries"),
    "sns": ("PublishBatch", "PublishBatchRequestEntries"),
}


class AwsKit(base.PublisherKit[H]):
    """SQS and SNS as the shared tests see them: everything but the names and the limits."""

    options = {"ack_timeout": 5.0, "connect_timeout": 5.0}
    batches = (50,)
    total_order = False  # per key: a FIFO queue's or topic's message group
    oversize_keys = ("k", "k", "k")  # what is held back is the rest of the group
    invalid_destination = "no spaces allowed"
    connect_reaches_the_broker = False  # the client is made without a request
    time_attribute = "ce_time"
    timed_attributes = {
        "ce_specversion": "1.0",
        "ce_id": "book/b1@1",
        "ce_type": "library.book-lent.v1",
        "ce_source": "/outbox-relay/loans",
        "ce_time": "2026-11-29T08:30:15.250000+00:00",
        "ce_partitionkey": "b1",
        "content-type": "application/json",
    }
    missing_destination_says = "does not exist"

    def unreachable(self) -> dict[str, Any]:
        return {"endpoint_url": f"http://127.0.0.1:{free_port()}"}

    def carried(self, consumed: Consumed) -> dict[str, str]:
        names = consumed.raw["MessageAttributes"]
        return {name: attribute(consumed.raw, name) or "" for name in names}

    def content_type(self, consumed: Consumed) -> str:
        return attribute(consumed.raw, "content-type") or ""

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert json.loads(consumed.raw["Body"]) == {"book": "b1", "v": 1}  # raw: the body only
        assert consumed.raw["Attributes"]["MessageDeduplicationId"] == "book/b1@1"
        assert consumed.raw["Attributes"]["MessageGroupId"] == "b1"


class EntryFaults:
    """Fail chosen entries of the publisher's batch calls the way SQS and SNS report it.

    `plan` maps a message id to the failures of its next attempts, as (code, sender_fault):
    such an entry is not stored and comes back under `Failed`; the others are stored.
    `calls` records the message ids of every call, in entry order; `sizes` the bytes of
    bodies and attributes of every call, as the service counts them.
    """

    def __init__(self, pub: EntryBatchPublisher, plan: dict[str, list[tuple[str, bool]]]) -> None:
        self.plan = plan
        self.calls: list[list[str]] = []
        self.sizes: list[int] = []
        service = pub.spec.service
        self._body_field = pub.spec.body_field
        operation, self._entries_field = _BATCH_CALLS[service]
        events = pub._client.meta.events  # the publisher's own client (tests only)
        events.register(f"before-parameter-build.{service}.{operation}", self._before)
        events.register(f"before-call.{service}.{operation}", self._short_circuit)
        events.register(f"after-call.{service}.{operation}", self._after)

    def sent(self, message_id: str) -> int:
        return sum(call.count(message_id) for call in self.calls)

    def _before(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        entries = params[self._entries_field]
        self.calls.append([e["MessageAttributes"]["ce_id"]["StringValue"] for e in entries])
        self.sizes.append(sum(self._size(e) for e in entries))
        kept, failed = [], []
        for entry, message_id in zip(entries, self.calls[-1], strict=True):
            if self.plan.get(message_id):
                code, sender_fault = self.plan[message_id].pop(0)
                failed.append(
                    {"Id": entry["Id"], "SenderFault": sender_fault, "Code": code, "Message": "!"}
                )
            else:
                kept.append(entry)
        context["injected"] = failed
        if kept:
            params[self._entries_field] = kept
        else:
            context["nothing_to_send"] = True  # botocore refuses an empty list: answer here

    def _short_circuit(self, context: dict[str, Any], **_: Any) -> Any:
        if context.get("nothing_to_send"):
            return SimpleNamespace(status_code=200, headers={}), {"Successful": []}
        return None

    def _after(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        if context.get("injected"):
            parsed.setdefault("Failed", []).extend(context["injected"])

    def _size(self, entry: dict[str, Any]) -> int:
        attributes = entry.get("MessageAttributes", {}).items()
        return len(entry[self._body_field].encode()) + sum(
            len(name) + len("String") + len(value["StringValue"].encode())
            for name, value in attributes
        )


def by_group(received: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The ce_id of each received message, per FIFO message group, in the order received."""
    groups: dict[str, list[str]] = defaultdict(list)
    for m in received:
        groups[m["Attributes"]["MessageGroupId"]].append(attribute(m, "ce_id") or "")
    return dict(groups)
