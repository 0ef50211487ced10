"""JSON Schemas for the contract: a payload inferred from its mapping, a rule's own schema made
to live inside the document, and the CloudEvents headers each broker carries.

Inference reads the JMESPath syntax tree and says only what is certain: the envelope's own
fields have known types, a value read from `data` or `metadata` can be anything (null
included), a multi-select hash is an object with exactly those keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jmespath

from relay.asyncapi.view import OutboxView, RuleView
from relay.core.publishing import STRUCTURED

Schema = dict[str, Any]

DATA_CONTENT_TYPE = "application/json"

_TIME: Schema = {"type": "string", "format": "date-time"}
ENVELOPE_FIELDS: dict[str, Schema] = {
    "position": {"type": "integer"},
    "aggregate_type": {"type": "string"},
    "aggregate_id": {"type": "string"},
    "version": {"type": "integer"},
    "type": {"type": "string"},
    "data": {},
    "metadata": {},
    "created_at": {"type": ["string", "null"], "format": "date-time"},
}

_FUNCTIONS: dict[str, Schema] = {
    "to_string": {"type": "string"},
    "join": {"type": "string"},
    "type": {"type": "string"},
    "length": {"type": "integer"},
    "abs": {"type": "number"},
    "ceil": {"type": "number"},
    "floor": {"type": "number"},
    "sum": {"type": "number"},
    "avg": {"type": ["number", "null"]},
    "to_number": {"type": ["number", "null"]},
    "contains": {"type": "boolean"},
    "starts_with": {"type": "boolean"},
    "ends_with": {"type": "boolean"},
    "keys": {"type": "array", "items": {"type": "string"}},
    "values": {"type": "array"},
    "sort": {"type": "array"},
    "sort_by": {"type": "array"},
    "to_array": {"type": "array"},
    "map": {"type": "array"},
    "merge": {"type": "object"},
}
_PROJECTIONS = ("projection", "value_projection", "filter_projection", "flatten", "slice")


# -- payloads ---------------------------------------------------------------------------------


def payload_schema(payload: str | Mapping[str, str]) -> Schema:
    """What a payload mapping is known to produce; `{}` where nothing is known."""
    if isinstance(payload, str):
        return expression_schema(payload)
    return _object({name: _described(expression_schema(e), e) for name, e in payload.items()})


def expression_schema(expression: str) -> Schema:
    return _infer(jmespath.compile(expression.strip()).parsed)


def _object(properties: dict[str, Schema]) -> Schema:
    """A mapping or a multi-select hash: every key is present (null when nothing was found)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _described(schema: Schema, expression: str) -> Schema:
    return {**schema, "description": f"`{expression}` of the stored event."}


def _infer(node: Mapping[str, Any]) -> Schema:
    kind, children = node["type"], node.get("children", [])
    if kind == "field":
        return dict(ENVELOPE_FIELDS.get(node["value"], {"type": "null"}))
    if kind == "current":
        return {"type": "object", "properties": dict(ENVELOPE_FIELDS)}
    if kind == "literal":
        return {"const": node["value"]}
    if kind == "multi_select_dict":
        return _object({pair["value"]: _infer(pair["children"][0]) for pair in children})
    if kind == "multi_select_list":
        return {"type": "array", "minItems": len(children), "maxItems": len(children)}
    if kind == "not_expression":
        return {"type": "boolean"}
    if kind == "comparator":
        return {"type": "boolean" if node["value"] in ("eq", "ne") else ["boolean", "null"]}
    if kind == "or_expression":
        first, second = (_infer(child) for child in children)
        return first if first == second else {}
    if kind == "function_expression":
        return _function(node["value"], children)
    if kind in _PROJECTIONS or (kind == "subexpression" and children[-1]["type"] in _PROJECTIONS):
        return {"type": ["array", "null"]}
    return {}


def _function(name: str, args: list[Mapping[str, Any]]) -> Schema:
    if name != "merge":
        return dict(_FUNCTIONS.get(name, {}))
    # The keys of the hashes merged in are certain; whatever else `data` holds is not.
    properties: dict[str, Schema] = {}
    required: list[str] = []
    for arg in args:
        schema = _infer(arg)
        properties.update(schema.get("properties", {}))
        required += [key for key in schema.get("required", []) if key not in required]
    merged: Schema = {"type": "object"}
    if properties:
        merged.update(properties=properties, required=required)
    return merged


def embedded_schema(schema: Mapping[str, Any], pointer: str) -> Schema:
    """A rule's JSON Schema as it must read where the document puts it (`pointer`).

    Its local references (`#/$defs/...`, `#`) are relative to the schema's own root, which is
    no longer the document's: they are rewritten to start at `pointer`.
    """

    def move(node: Any) -> Any:
        if isinstance(node, Mapping):
            out = {key: move(value) for key, value in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out["$ref"] = pointer + ref[1:]
            return out
        if isinstance(node, list):
            return [move(item) for item in node]
        return node

    moved: Schema = move(schema)
    return moved


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
            "description": f"Stable per event, so consumers can drop duplicates: `{rule.id}`.",
        },
        "type": {"const": rule.type},
        "source": {"const": outbox.source},
        "partitionkey": {
            "type": "string",
            "description": f"The aggregate's ordering key: `{rule.key}`.",
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
    if outbox.cloudevents == "binary":
        attributes, always = _attributes(outbox, rule)
        if outbox.protocol == "kafka":  # the record key is the partition key
            del attributes["partitionkey"]
        prefix = {"nats": "ce-", "kafka": "ce_", "sqs": "ce_", "rabbitmq": outbox.amqp_prefix}
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
