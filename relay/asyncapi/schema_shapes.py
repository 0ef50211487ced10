"""A JSON Schema folded into shapes: what each alternative admits, by kind of JSON value.

`relay contract diff` compares payload schemas by what they admit, not by how they are
written. This module reads one schema (its local `$ref`s, `allOf` merged, `anyOf`/`oneOf`
spread into alternatives) into `Shape`s the comparison in schema_inclusion.py can reason
about. A keyword it does not model is kept by name: the comparison then says `unknown`. Each
node is read by the keywords of its own draft (its `$schema`): one its draft does not define
is no constraint, since the relay's validator ignores it too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

from relay.errors import RelayError

# An integral is an integer written as a float (1.0): draft 4's `integer` refuses it, later
# drafts' admit it. A fraction is a number that is not an integer.
KINDS = ("null", "boolean", "integer", "integral", "fraction", "string", "array", "object")
NUMBERS = frozenset({"integer", "integral", "fraction"})
_TYPE_KINDS = {
    "null": ("null",),
    "boolean": ("boolean",),
    "integer": ("integer", "integral"),
    "number": ("integer", "integral", "fraction"),
    "string": ("string",),
    "array": ("array",),
    "object": ("object",),
}
# Keywords whose meaning does not depend on their neighbours: OLD's is kept when NEW has the
# very same one. The kinds each constrains.
OPAQUE = {
    "not": KINDS,
    "if": KINDS,
    "then": KINDS,
    "else": KINDS,
    "contains": ("array",),
    "minContains": ("array",),
    "maxContains": ("array",),
    "propertyNames": ("object",),
    "dependencies": ("object",),
    "dependentRequired": ("object",),
    "dependentSchemas": ("object",),
    "patternProperties": ("object",),
}
# The drafts that define a keyword not every draft has (tests hold this to jsonschema's
# validators). In a schema of another draft it is no constraint: its validator ignores it.
_SINCE_6 = ("6", "7", "2019-09", "2020-12")
_SINCE_2019 = ("2019-09", "2020-12")
DEFINED_IN = {
    "const": _SINCE_6,
    "contains": _SINCE_6,
    "propertyNames": _SINCE_6,
    "if": _SINCE_6[1:],
    "then": _SINCE_6[1:],
    "else": _SINCE_6[1:],
    "dependencies": ("4", "6", "7"),
    "dependentRequired": _SINCE_2019,
    "dependentSchemas": _SINCE_2019,
    "minContains": _SINCE_2019,
    "maxContains": _SINCE_2019,
    "unevaluatedProperties": _SINCE_2019,
    "unevaluatedItems": _SINCE_2019,
}
# Keywords that depend on what the rest of the schema evaluated: never compared.
UNMODELLED = {"unevaluatedProperties": ("object",), "unevaluatedItems": ("array",)}
MAX_ALTERNATIVES = 64


class Unsupported(RelayError):
    """A schema this reading cannot fold; the message says which keyword and where."""


@dataclass(frozen=True)
class Ref:
    """A schema node, where it sits in its document (a JSON pointer) and its draft."""

    node: Any
    pointer: str
    draft: str = "7"

    def child(self, node: Any, *steps: str | int) -> Ref:
        tail = "".join("/" + str(s).replace("~", "~0").replace("/", "~1") for s in steps)
        return Ref(node, self.pointer + tail, self.draft)


def draft_of(uri: Any, default: str) -> str:
    text = str(uri)
    for mark, draft in (("draft-04", "4"), ("draft-06", "6"), ("draft-07", "7")):
        if mark in text:
            return draft
    return next((d for d in ("2019-09", "2020-12") if d in text), default)


def resolve(root: Any, ref: str, draft: str) -> Ref:
    """A local `$ref` (`#/...`), as JSON pointers into the whole document, the way AsyncAPI
    tools read them; the draft is that of the nearest `$schema` on the way."""
    if not ref.startswith("#"):
        raise Unsupported(f"`$ref` {ref!r} points outside the document")
    node = root
    if isinstance(node, dict) and "$schema" in node:
        draft = draft_of(node["$schema"], draft)
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        raise Unsupported(f"`$ref` {ref!r} names an anchor, which this comparison does not read")
    for step in pointer.split("/")[1:] if pointer else []:
        name = step.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(name)] if isinstance(node, list) else node[name]
        except (KeyError, IndexError, ValueError, TypeError):
            raise Unsupported(f"`$ref` {ref!r} points at nothing") from None
        if isinstance(node, dict) and "$schema" in node:
            draft = draft_of(node["$schema"], draft)
    return Ref(node, pointer, draft)


def own_id(node: dict[str, Any], draft: str) -> str | None:
    """The `$id` that starts an embedded schema here, as the relay's validators read it:
    `id` in draft 4; ignored beside a `$ref` before 2019-09; `#name` is an anchor there."""
    value = node.get("id" if draft == "4" else "$id")
    if not isinstance(value, str):
        return None
    if draft in ("4", "6", "7") and ("$ref" in node or value.startswith("#")):
        return None
    return value


def enclosing_id(root: Any, pointer: str) -> tuple[str, str] | None:
    """The innermost schema with its own `$id` on the way to `pointer` (a document's JSON
    pointer, itself included): (its pointer, its `$id`); None when there is none."""
    node, draft, found = root, "7", None
    at = ""
    steps = pointer.split("/")[1:] if pointer else []
    for index in range(len(steps) + 1):
        if isinstance(node, dict):
            if "$schema" in node:
                draft = draft_of(node["$schema"], draft)
            if (value := own_id(node, draft)) is not None:
                found = (at, value)
        if index == len(steps):
            break
        step = steps[index]
        name = step.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(name)] if isinstance(node, list) else node[name]
        except (KeyError, IndexError, ValueError, TypeError):
            break
        at += "/" + step
    return found


def same_value(value: Any) -> str:
    """A JSON value's identity as JSON Schema compares values (1 and 1.0 are equal)."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return json.dumps(plain(value), sort_keys=True)


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float) and value.is_integer():
        return "integral"
    if isinstance(value, float):
        return "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def number(value: Any) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Unsupported(f"a bound that is not a number: {value!r}")
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


Bound = tuple[Fraction, bool]  # the value, and whether it is exclusive


@dataclass
class Shape:
    """One alternative: every keyword folded into it holds at once."""

    kinds: set[str] = field(default_factory=lambda: set(KINDS))
    values: list[Any] | None = None  # enum/const: only these
    low: Bound | None = None
    high: Bound | None = None
    multiples: list[Fraction] = field(default_factory=list)
    min_length: int = 0
    max_length: int | None = None
    formats: set[str] = field(default_factory=set)
    patterns: set[str] = field(default_factory=set)
    prefix: list[list[Ref]] = field(default_factory=list)  # the schemas of item i, all hold
    rest: list[Ref] = field(default_factory=list)  # the schemas of the items after the prefix
    min_items: int = 0
    max_items: int | None = None
    unique: bool = False
    parts: list[tuple[dict[str, Ref], Ref | None]] = field(default_factory=list)
    required: set[str] = field(default_factory=set)
    min_properties: int = 0
    max_properties: int | None = None
    opaque: list[tuple[str, str]] = field(default_factory=list)  # (keyword, value as JSON)
    unmodelled: list[str] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)  # NEW's keywords left out: NEW may be less
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (keyword, draft not its)
    exclusive: bool = False  # an alternative of a oneOf

    def copy(self) -> Shape:
        return replace(
            self,
            kinds=set(self.kinds),
            values=None if self.values is None else list(self.values),
            multiples=list(self.multiples),
            formats=set(self.formats),
            patterns=set(self.patterns),
            prefix=[list(p) for p in self.prefix],
            rest=list(self.rest),
            parts=list(self.parts),
            required=set(self.required),
            opaque=list(self.opaque),
            unmodelled=list(self.unmodelled),
            loose=list(self.loose),
            ignored=list(self.ignored),
        )

    def item(self, index: int) -> list[Ref]:
        return self.prefix[index] if index < len(self.prefix) else self.rest

    def property(self, name: str) -> list[Ref]:
        """The schemas a property's value meets: each part's own, or its additionalProperties."""
        found: list[Ref] = []
        for properties, additional in self.parts:
            if name in properties:
                found.append(properties[name])
            elif additional is not None:
                found.append(additional)
        return found

    def others(self) -> list[Ref]:
        """The schemas of a property no part names."""
        return [additional for _, additional in self.parts if additional is not None]

    def names(self) -> set[str]:
        return {name for properties, _ in self.parts for name in properties} | self.required

    def empty(self) -> bool:
        """Admits nothing, as far as plain bounds show; then it is left out."""
        if self.values is not None:
            return not self.values
        if any(step.denominator == 1 for step in self.multiples):
            self.kinds.discard("fraction")  # a multiple of an integer is an integer
        if self.low and self.high:
            (low, open_low), (high, open_high) = self.low, self.high
            if low > high or (low == high and (open_low or open_high)):
                self.kinds -= NUMBERS
        least, most = integer_bounds(self.low, self.high)
        if least is not None and most is not None and least > most:
            self.kinds -= {"integer", "integral"}
        if self.max_length is not None and self.min_length > self.max_length:
            self.kinds.discard("string")
        if self.max_items is not None and self.min_items > self.max_items:
            self.kinds.discard("array")
        if any(_never(self.property(name)) for name in self.required):
            self.kinds.discard("object")
        return not self.kinds


def _kinds_of(type_: Any, draft: str) -> tuple[str, ...]:
    """The kinds a `type` admits in a draft: draft 4's `integer` refuses 1.0."""
    if type_ == "integer" and draft == "4":
        return ("integer",)
    return _TYPE_KINDS.get(type_, ()) if isinstance(type_, str) else ()


def _defined(keyword: str, draft: str) -> bool:
    return keyword not in DEFINED_IN or draft in DEFINED_IN[keyword]


def _never(refs: list[Ref]) -> bool:
    return any(ref.node is False for ref in refs)


class Folder:
    """Folds schema nodes of one document into shapes. `loose` (NEW's side) leaves out what it
    does not model, so the shapes admit at least what the schema does; OLD's side keeps it."""

    def __init__(self, root: Any, *, loose: bool) -> None:
        self.root = root
        self.loose = loose

    def shapes(self, refs: list[Ref]) -> list[Shape]:
        shapes = [Shape()]
        for ref in refs:
            shapes = self._fold(ref, shapes, ())
        return [shape for shape in shapes if not shape.empty()]

    def _fold(self, ref: Ref, shapes: list[Shape], stack: tuple[str, ...]) -> list[Shape]:
        node = ref.node
        if node is True:
            return shapes
        if node is False:
            return []
        if not isinstance(node, dict):
            raise Unsupported(f"{ref.pointer or '#'} is not a schema")
        if "$schema" in node:
            ref = Ref(node, ref.pointer, draft_of(node["$schema"], ref.draft))
        for keyword in ("$dynamicRef", "$recursiveRef"):
            if keyword in node:
                raise Unsupported(f"`{keyword}` is not compared")
        if isinstance(target := node.get("$ref"), str):
            resolved = resolve(self.root, target, ref.draft)
            self._inside_own_id(ref.pointer, target, resolved.pointer)
            if resolved.pointer in stack:
                raise Unsupported(f"`$ref` {target!r} refers to itself with nothing between")
            shapes = self._fold(resolved, shapes, (*stack, resolved.pointer))
            if ref.draft in ("4", "6", "7"):  # before 2019-09, $ref's neighbours are ignored
                return shapes
        for shape in shapes:
            self._keywords(ref, shape)
        return self._combined(ref, shapes, stack)

    def _inside_own_id(self, at: str, target: str, pointer: str) -> None:
        """A `$ref` in a schema with its own `$id` resolves against that `$id`: a `#...` one
        cannot leave it. One that does was moved to the root by an older `relay contract`
        (or, in a schema compared alone, is read here from the wrong base): not compared."""
        found = enclosing_id(self.root, at)
        if found is None or pointer == found[0] or pointer.startswith(found[0] + "/"):
            return
        raise Unsupported(
            f"`$ref` {target!r} is inside a schema with its own `$id` ({found[1]!r}), which "
            "JSON Schema resolves it against; it points outside that schema, so what it "
            "refers to is not known here (a contract written by an older `relay contract`: "
            "compare the configs)"
        )

    def _combined(self, ref: Ref, shapes: list[Shape], stack: tuple[str, ...]) -> list[Shape]:
        """`allOf` folded in; `anyOf` and `oneOf` spread into one shape per alternative."""
        node: dict[str, Any] = ref.node
        for index, sub in enumerate(node.get("allOf", [])):
            shapes = self._fold(ref.child(sub, "allOf", index), shapes, stack)
        for keyword in ("anyOf", "oneOf"):
            if keyword not in node:
                continue
            spread: list[Shape] = []
            for shape in shapes:
                for index, sub in enumerate(node[keyword]):
                    spread += self._fold(ref.child(sub, keyword, index), [shape.copy()], stack)
            if len(spread) > MAX_ALTERNATIVES:
                raise Unsupported(f"`{keyword}` spreads into more than {MAX_ALTERNATIVES} cases")
            for shape in spread:
                shape.exclusive = shape.exclusive or keyword == "oneOf"
            shapes = spread
        return shapes

    def _keywords(self, ref: Ref, shape: Shape) -> None:
        node: dict[str, Any] = ref.node
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            shape.kinds &= {kind for t in types for kind in _kinds_of(t, ref.draft)}
        for keyword in sorted(DEFINED_IN.keys() & node.keys()):
            if ref.draft not in DEFINED_IN[keyword]:
                shape.ignored.append((keyword, ref.draft))
        for keyword in ("enum", "const"):
            if keyword in node and _defined(keyword, ref.draft):
                allowed = node["enum"] if keyword == "enum" else [node["const"]]
                if shape.values is not None:
                    keep = {same_value(v) for v in shape.values}
                    allowed = [v for v in allowed if same_value(v) in keep]
                shape.values = list(allowed)
        self._numbers(node, ref.draft, shape)
        self._strings(node, shape)
        self._arrays(ref, shape)
        self._objects(ref, shape)
        for keyword in sorted(OPAQUE.keys() & node.keys()):
            if keyword == "patternProperties" or not _defined(keyword, ref.draft):
                continue  # with the objects' keywords; not a keyword of this draft
            shape.opaque.append((keyword, same_value(node[keyword])))
            shape.loose.append(keyword)
        for keyword in sorted(UNMODELLED.keys() & node.keys()):
            if not _defined(keyword, ref.draft):
                continue
            shape.unmodelled.append(keyword)
            shape.loose.append(keyword)

    def _numbers(self, node: dict[str, Any], draft: str, shape: Shape) -> None:
        low, high = node.get("minimum"), node.get("maximum")
        if low is not None:
            shape.low = _tighter(shape.low, (number(low), node.get("exclusiveMinimum") is True))
        if high is not None:
            shape.high = _looser_not(
                shape.high, (number(high), node.get("exclusiveMaximum") is True)
            )
        if draft != "4":
            if (value := node.get("exclusiveMinimum")) is not None and value is not True:
                shape.low = _tighter(shape.low, (number(value), True))
            if (value := node.get("exclusiveMaximum")) is not None and value is not True:
                shape.high = _looser_not(shape.high, (number(value), True))
        if (multiple := node.get("multipleOf")) is not None:
            shape.multiples.append(number(multiple))

    def _strings(self, node: dict[str, Any], shape: Shape) -> None:
        if (least := node.get("minLength")) is not None:
            shape.min_length = max(shape.min_length, int(least))
        if (most := node.get("maxLength")) is not None:
            shape.max_length = (
                int(most) if shape.max_length is None else min(shape.max_length, int(most))
            )
        if isinstance(node.get("format"), str):
            shape.formats.add(node["format"])
        if isinstance(node.get("pattern"), str):
            shape.patterns.add(node["pattern"])

    def _arrays(self, ref: Ref, shape: Shape) -> None:
        node: dict[str, Any] = ref.node
        prefix: list[Ref] = []
        rest: Ref | None = None
        items = node.get("items")
        if ref.draft == "2020-12":
            prefix = [
                ref.child(s, "prefixItems", i) for i, s in enumerate(node.get("prefixItems", []))
            ]
            rest = ref.child(items, "items") if "items" in node else None
        elif isinstance(items, list):
            prefix = [ref.child(s, "items", i) for i, s in enumerate(items)]
            if "additionalItems" in node:
                rest = ref.child(node["additionalItems"], "additionalItems")
        elif items is not None:
            rest = ref.child(items, "items")
        if prefix or rest is not None:
            length = max(len(shape.prefix), len(prefix))
            shape.prefix = [
                shape.item(i) + ([prefix[i]] if i < len(prefix) else [rest] if rest else [])
                for i in range(length)
            ]
            shape.rest = shape.rest + ([rest] if rest is not None else [])
        if (least := node.get("minItems")) is not None:
            shape.min_items = max(shape.min_items, int(least))
        if (most := node.get("maxItems")) is not None:
            shape.max_items = (
                int(most) if shape.max_items is None else min(shape.max_items, int(most))
            )
        shape.unique = shape.unique or node.get("uniqueItems") is True

    def _objects(self, ref: Ref, shape: Shape) -> None:
        node: dict[str, Any] = ref.node
        properties = {
            name: ref.child(sub, "properties", name)
            for name, sub in (node.get("properties") or {}).items()
        }
        additional = (
            ref.child(node["additionalProperties"], "additionalProperties")
            if "additionalProperties" in node
            else None
        )
        if "patternProperties" in node:
            if self.loose:  # a name matching a pattern escapes additionalProperties
                additional = None
                shape.loose.append("patternProperties")
            else:  # OLD: its additionalProperties, applied to more names, admits less
                shape.opaque.append(("patternProperties", same_value(node["patternProperties"])))
        if properties or additional is not None:
            shape.parts.append((properties, additional))
        shape.required |= {name for name in node.get("required", []) if isinstance(name, str)}
        if (least := node.get("minProperties")) is not None:
            shape.min_properties = max(shape.min_properties, int(least))
        if (most := node.get("maxProperties")) is not None:
            bound = int(most)
            shape.max_properties = (
                bound if shape.max_properties is None else min(shape.max_properties, bound)
            )


def _tighter(old: Bound | None, new: Bound) -> Bound:
    """The greater lower bound (exclusive wins a tie)."""
    if old is None or new[0] > old[0] or (new[0] == old[0] and new[1]):
        return new
    return old


def _looser_not(old: Bound | None, new: Bound) -> Bound:
    """The smaller upper bound (exclusive wins a tie)."""
    if old is None or new[0] < old[0] or (new[0] == old[0] and new[1]):
        return new
    return old


def integer_bounds(low: Bound | None, high: Bound | None) -> tuple[int | None, int | None]:
    """The least and greatest integers the bounds admit."""
    least = most = None
    if low is not None:
        least = math.floor(low[0]) + 1 if low[1] else math.ceil(low[0])
    if high is not None:
        most = math.ceil(high[0]) - 1 if high[1] else math.floor(high[0])
    return least, most
