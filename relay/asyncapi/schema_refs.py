"""Where a rule's JSON Schema's local `$ref`s point, by JSON Schema's own rules.

A `#...` reference resolves against the nearest `$id` around it (a schema embedded in
another, with its own base URI), not against the schema's root; `#name` names an anchor
(`$anchor`, 2020-12's `$dynamicAnchor`, drafts 4-7's `$id: "#name"`). The relay's validators
read them so. The contract moves a rule's schema under components.schemas, where AsyncAPI
tools resolve `#/...` in the whole document: each reference is rewritten to the document
pointer of the schema JSON Schema resolves it to, or the contract would state another type
than the relay checks. `relay contract diff` reads documents that way (schema_shapes.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urljoin

from relay.asyncapi.schema_shapes import draft_of, own_id

_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
# Keywords whose value maps names to schemas: a name there is no keyword (`properties.$ref`).
_NAMED = frozenset(
    {"properties", "patternProperties", "definitions", "$defs", "dependentSchemas", "dependencies"}
)
_ROOT = "https://relay.invalid/schema.json"  # the base of a schema without an `$id`
_SAFE = "!$&'()*+,;=:@-._~"  # what a URI fragment keeps as it is, besides `/`

Steps = tuple[str, ...]


@dataclass(frozen=True)
class _Schema:
    node: dict[str, Any]
    steps: Steps  # from the schema's root
    base: str  # the URI its `$ref` resolves against


def _anchors(node: dict[str, Any], draft: str) -> list[str]:
    if draft in ("4", "6", "7"):
        value = node.get("id" if draft == "4" else "$id")
        return [value[1:]] if isinstance(value, str) and value.startswith("#") else []
    keywords = ("$anchor", "$dynamicAnchor") if draft == "2020-12" else ("$anchor",)
    return [node[k] for k in keywords if isinstance(node.get(k), str)]


def _walk(node: Any, steps: Steps, base: str, draft: str) -> Iterator[tuple[_Schema, str]]:
    """Every schema object under `node`, with its draft; data (`const`, `enum`...) skipped."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _walk(item, (*steps, str(index)), base, draft)
        return
    if not isinstance(node, dict):
        return
    if "$schema" in node:
        draft = draft_of(node["$schema"], draft)
    if (found := own_id(node, draft)) is not None:
        base = urljoin(base, found).partition("#")[0]
    yield _Schema(node, steps, base), draft
    for key, value in node.items():
        if key in _DATA:
            continue
        if key in _NAMED and isinstance(value, dict):
            for name, sub in value.items():
                yield from _walk(sub, (*steps, key, name), base, draft)
        else:
            yield from _walk(value, (*steps, key), base, draft)


def pointer_of(steps: Steps) -> str:
    """A JSON pointer as a URI fragment: each step escaped, then percent-encoded."""
    return "".join("/" + quote(s.replace("~", "~0").replace("/", "~1"), safe=_SAFE) for s in steps)


def embedded_schema(schema: Any, pointer: str) -> Any:
    """A rule's JSON Schema as it must read at `pointer` (`#/components/schemas/...`) in the
    document: each local `$ref` rewritten to where JSON Schema resolves it. One that resolves
    to no anchor is left as it is."""
    moved = copy.deepcopy(schema)
    start = draft_of(moved.get("$schema"), "7") if isinstance(moved, dict) else "7"
    schemas = list(_walk(moved, (), _ROOT, start))
    resources: dict[str, Steps] = {_ROOT: ()}
    anchors: dict[tuple[str, str], Steps] = {}
    for found, draft in schemas:
        resources.setdefault(found.base, found.steps)
        for name in _anchors(found.node, draft):
            anchors.setdefault((found.base, name), found.steps)
    for found, _ in schemas:
        ref = found.node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            continue
        fragment = ref[1:]
        if not fragment or fragment.startswith("/"):
            found.node["$ref"] = pointer + pointer_of(resources[found.base]) + fragment
        elif (target := anchors.get((found.base, unquote(fragment)))) is not None:
            found.node["$ref"] = pointer + pointer_of(target)
    return moved
