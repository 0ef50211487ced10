"""The parts of the contract's messages beyond the payload: the envelope and the CloudEvents
headers each broker carries. The payload's schema is inferred from the rule's expressions in
relay/mapping/inference.py, or is the rule's own, moved into the document by schema_refs.py.
"""

from __future__ import annotations

from relay.asyncapi.view import OutboxView, RuleView
from relay.core.publishing import STRUCTURED
from relay.mapping.inference import Schema

DATA_CONTENT_TYPE = "application/json"
# How the document states a rule's templates; `relay contract diff` reads them back.
KEY_TEXT = "The aggregate's ordering key: `{}`."
RECORD_KEY_TEXT = "The record key, `{}`: one aggregate's messages share a partition, in order."
ID_TEXT = "Stable per event, so consumers can drop duplicates: `{}`."
_TIME: Schema = {"type": "string", "format": "date-time"}


def schema_id(rule: RuleView) -> str | None:
    """The rule's schema `$id`: the CloudEvents `dataschema` of its messages."""
    value = rule.schema.get("$id") if rule.schema is not None else None
    return value if isinstance(value, str) and value else None


# -- CloudEvents ------------------------------------------------------------------------------


def _attributes(outbox: OutboxView, rule: RuleView) -> tuple[dict[str, Schema], list[str]]:
    """The context attributes the relay sets, unprefixed, and which of them are always set."""
    attributes: dict[str, Schema] = {
        "specversion": {"const": "1.0"},
        "id": {
            "type": "string",
            "description": ID_TEXT.format(rule.id),
        },
        "type": {"const": rule.type},
        "source": {"const": outbox.source},
        "partitionkey": {
            "type": "string",
            "description": KEY_TEXT.format(rule.key),
        },
        "time": {**_TIME, "description": "When the event was stored (absent without one)."},
    }
    required = ["specversion", "id", "type", "source", "partitionkey"]
    if not outbox.has_time:
        del attributes["time"]
    if (dataschema := schema_id(rule)) is not None:
        attributes["dataschema"] = {"const": dataschema}
        required.append("dataschema")
    if outbox.trace_context:
        attributes["traceparent"] = {
            "type": "string",
            "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            "description": "W3C Trace Context of the request that stored the event, if known.",
        }
        attributes["tracestate"] = {"type": "string", "description": "W3C Trace Context."}
    return attributes, required


def headers_schema(outbox: OutboxView, rule: RuleView) -> Schema:
    """The message headers (SQS: message attributes) the relay sets on this broker."""
    properties: dict[str, Schema] = {}
    required: list[str] = []

    def add(name: str, schema: Schema, always: bool = True) -> None:
        properties[name] = schema
        if always:
            required.append(name)

    message_id: Schema = {"type": "string", "description": "The message id: deduplicate on it."}
    if outbox.protocol == "nats":
        add("Nats-Msg-Id", message_id)
    if outbox.protocol == "http":  # Standard Webhooks
        add("webhook-id", message_id)
        add("webhook-timestamp", {"type": "string", "pattern": "^[0-9]+$"})
        signature = {
            "type": "string",
            "description": "`v1,<base64 HMAC-SHA256 of id.timestamp.body>` per signing key,"
            " space separated; absent without signing keys.",
        }
        add("webhook-signature", signature, always=False)
    if outbox.cloudevents == "binary":
        attributes, always = _attributes(outbox, rule)
        if outbox.protocol == "kafka":  # the record key is the partition key
            del attributes["partitionkey"]
        prefix = {
            "nats": "ce-",
            "kafka": "ce_",
            "sqs": "ce_",
            "pubsub": "ce-",
            "redis": "ce_",
            "http": "ce-",
            "sns": "ce_",
            "rabbitmq": outbox.amqp_prefix,
        }
        for name, schema in attributes.items():
            add(prefix[outbox.protocol] + name, schema, name in always)
    if outbox.protocol == "rabbitmq":  # the content type is an AMQP message property
        add("x-deduplication-header", message_id)
    else:
        structured = outbox.cloudevents == "structured"
        add("content-type", {"const": STRUCTURED if structured else DATA_CONTENT_TYPE})
    return {"type": "object", "properties": properties, "required": required}


def envelope_schema(outbox: OutboxView, rule: RuleView, data: Schema) -> Schema:
    """Structured mode: the whole CloudEvent is the body; `data` holds the payload."""
    attributes, required = _attributes(outbox, rule)
    properties = {
        **attributes,
        "datacontenttype": {"const": DATA_CONTENT_TYPE},
        "data": data,
    }
    return {
        "type": "object",
        "properties": properties,
        "required": [*required, "datacontenttype", "data"],
    }
