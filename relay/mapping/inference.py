"""What a rule's expressions yield, as JSON Schema, for the documents that describe it.

Inference reads the JMESPath syntax tree and says only what is certain: the envelope's own
fields have known types, a value read from `data` or `metadata` can be anything (null
included), a multi-select hash is an object with exactly those keys, and `merge` takes each
key from the last argument that may hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jmespath

Schema = dict[str, Any]

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

# What each JMESPath built-in returns, grouped by its result; a function not listed
# (min, max, not_null, reverse, ...) returns whatever its arguments hold.
_RETURNS: tuple[tuple[Schema, tuple[str, ...]], ...] = (
    ({"type": "string"}, ("to_string", "join", "type")),
    ({"type": "integer"}, ("length",)),
    ({"type": "number"}, ("abs", "ceil", "floor", "sum")),
    ({"type": ["number", "null"]}, ("avg", "to_number")),
    ({"type": "boolean"}, ("contains", "starts_with", "ends_with")),
    ({"type": "array", "items": {"type": "string"}}, ("keys",)),
    ({"type": "array"}, ("values", "sort", "sort_by", "to_array", "map")),
    ({"type": "object"}, ("merge",)),
)
_FUNCTIONS: dict[str, Schema] = {name: schema for schema, names in _RETURNS for name in names}
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
    # Later arguments override earlier keys. A hash's keys are certain; an argument whose keys
    # are not (`data`) may override any key before it with anything, so those become unknown.
    properties: dict[str, Schema] = {}
    required: list[str] = []
    closed = True
    for arg in args:
        keys, present, known = _keys(_infer(arg))
        if not known:
            properties = {key: {} for key in properties}
            closed = False
        properties.update(keys)
        required += [key for key in present if key not in required]
    merged: Schema = {"type": "object"}
    if properties:
        merged.update(properties=properties, required=required)
    if closed:
        merged["additionalProperties"] = False
    return merged


def _keys(schema: Schema) -> tuple[dict[str, Schema], list[str], bool]:
    """(the keys an object argument of merge is known to have, those always present, whether
    it has no others)."""
    if isinstance(value := schema.get("const"), dict):
        return {key: {"const": v} for key, v in value.items()}, list(value), True
    if schema.get("type") != "object":
        return {}, [], False
    closed = schema.get("additionalProperties") is False
    return dict(schema.get("properties", {})), list(schema.get("required", [])), closed
