"""The config file's JSON Schema, generated from the models, for editors and the chart.

`relay config-schema` prints it. The Helm chart's values.schema.json carries a copy for
`relay.config`, so that `helm install` refuses an unknown key or a wrong type inside an
outbox; `python3 dev.py schema` writes that copy (a test fails while they differ).

It describes the file as written, before the relay reads it:

- every `$ref` is inlined, so the schema can be embedded anywhere (the chart's values
  schema) and read by draft-07 validators (Helm's, editors');
- any scalar may be a `${VAR}` reference, which the relay expands before validating;
- durations and sizes may be text (`10ms`, `4MiB`), as the loader accepts.

Rules that span several keys (an outbox naming a broker that exists, lease timings that
fit together) are the relay's own: `relay check` reports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from relay.config import RelayConfig

DRAFT = "http://json-schema.org/draft-07/schema#"
TITLE = "Outbox Relay configuration"

# A `${VAR}` or `${VAR:-default}` reference: any scalar value may be written so.
ENV_REFERENCE: dict[str, Any] = {
    "type": "string",
    "pattern": r"\$\{[A-Za-z_][A-Za-z0-9_]*(:-.*)?\}",
}
_ANNOTATIONS = ("description", "default", "examples", "deprecated", "writeOnly")


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the relay's config file, self-contained."""
    raw = RelayConfig.model_json_schema(mode="validation", by_alias=True)
    definitions = raw.pop("$defs", {})
    body = _Inliner(definitions).walk(raw)
    body["description"] = (
        "The relay's config file (docs/configuration.md). Any value may be written as"
        " ${VAR} or ${VAR:-default}, expanded from the environment when it is loaded."
    )
    return {"$schema": DRAFT, "title": TITLE, **body}


class _Inliner:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions

    def walk(self, node: dict[str, Any], *, member: bool = False) -> dict[str, Any]:
        """`node` inlined; a member of an anyOf is left to its parent to widen."""
        if "$ref" in node:
            name = node["$ref"].rpartition("/")[2]
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return self.walk({**self.definitions[name], **rest}, member=member)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "discriminator"):
                continue  # pydantic's field titles are noise; the mapping holds $refs
            if key in ("properties", "patternProperties"):
                out[key] = {name: self.walk(sub) for name, sub in value.items()}
            elif key in ("additionalProperties", "items") and isinstance(value, dict):
                out[key] = self.walk(value)
            elif key in ("anyOf", "oneOf", "allOf"):
                out[key] = [self.walk(sub, member=True) for sub in value]
            else:
                out[key] = value
        if "patternProperties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False  # a name the relay would refuse
        return out if member else _or_reference(out)


def _or_reference(node: dict[str, Any]) -> dict[str, Any]:
    """`node`, or a `${VAR}` that the relay expands into a value for it."""
    for key in ("anyOf", "oneOf"):
        members = node.get(key)
        if members is None:
            continue
        if any(_constrained(m) for m in members) and ENV_REFERENCE not in members:
            return {**node, key: [*members, ENV_REFERENCE]}
        return node
    if not _constrained(node):
        return node
    annotations = {k: v for k, v in node.items() if k in _ANNOTATIONS}
    value = {k: v for k, v in node.items() if k not in _ANNOTATIONS}
    return {"anyOf": [value, ENV_REFERENCE], **annotations}


def _constrained(node: dict[str, Any]) -> bool:
    """A scalar that a `${VAR}` reference would not satisfy as written."""
    if "enum" in node or "const" in node:
        return True
    kind = node.get("type")
    if kind in ("integer", "number", "boolean"):
        return True
    return kind == "string" and "pattern" in node


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


# -- the chart's copy --------------------------------------------------------------------------


def chart_config_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """What values.schema.json holds for `relay.config`: empty means the chart's example."""
    body = {k: v for k, v in schema.items() if k != "$schema"}
    return {
        "type": "object",
        "description": (
            "The relay's config file (docs/configuration.md); empty: files/relay.example.yaml."
            " Checked against `relay config-schema`."
        ),
        "if": {"minProperties": 1},
        "then": body,
    }


def embed_in_chart(values_schema: Path) -> bool:
    """Write the current schema into the chart's values.schema.json; True if it changed."""
    values = json.loads(values_schema.read_text(encoding="utf-8"))
    wanted = chart_config_schema(config_schema())
    relay = values["properties"]["relay"]["properties"]
    if relay.get("config") == wanted:
        return False
    relay["config"] = wanted
    values_schema.write_text(render(values), encoding="utf-8")
    return True


# python -m relay.config.config_schema helm/outbox-relay/values.schema.json
if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(f"{target}: {'updated' if embed_in_chart(target) else 'already up to date'}")
