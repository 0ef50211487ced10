"""Whether every instance NEW's schema admits, OLD's admits too: a consumer written against
OLD then reads every message NEW describes.

Decided conservatively. A schema is folded into shapes (schema_shapes.py) and compared
keyword by keyword: types, properties, `required` and `additionalProperties`, items, enum
and const, numeric and length bounds, `format`, `anyOf`/`oneOf` as unions, `allOf`, local
`$ref`s (recursive ones too). A finite set of values (enum, const, null, booleans) is
checked exactly, by validating each one against both schemas. Where a keyword is not
modelled, or a union might cover what no single alternative does, the answer is `unknown`
and says why; it is never taken for compatible. `breaking` is said only where the modelled
keywords show a message NEW admits and OLD refuses.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal
from urllib.parse import quote

from relay.asyncapi.schema_shapes import (
    KINDS,
    NUMBERS,
    OPAQUE,
    UNMODELLED,
    Bound,
    Folder,
    Ref,
    Shape,
    Unsupported,
    draft_of,
    integer_bounds,
    resolve,
    same_value,
)
from relay.mapping.message_schemas import validator_class

Verdict = Literal["breaking", "unknown"]
_TEXT = {
    "null": "null",
    "boolean": "booleans",
    "integer": "integers",
    "integral": "integers written as decimals (1.0)",
    "fraction": "numbers that are not integers",
    "string": "strings",
    "array": "arrays",
    "object": "objects",
}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ANY_STRING = {"", ".*", "^.*$", "^.*", ".*$"}
_MAX_DEPTH = 200


@dataclass(frozen=True)
class Finding:
    verdict: Verdict
    path: str  # where in the message, as a JSON path: $.payload.member.id
    why: str


@dataclass(frozen=True)
class Side:
    """One document: the root its `$ref`s point into, and its name in the findings."""

    root: Any
    name: str


def member(path: str, name: str) -> str:
    if _IDENTIFIER.match(name):
        return f"{path}.{name}"
    return f"{path}['" + name.replace("\\", "\\\\").replace("'", "\\'") + "']"


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(bound: Bound | None, above: bool) -> str:
    if bound is None:
        return "no bound"
    sign = ("<" if bound[1] else "<=") if above else (">" if bound[1] else ">=")
    value = bound[0]
    return f"{sign} {value.numerator if value.denominator == 1 else float(value)}"


@dataclass
class Inclusion:
    """NEW ⊆ OLD for the schemas of two documents."""

    old: Side
    new: Side
    reverse: bool = False  # OLD within NEW: `old` is NEW's side, and findings say so
    _active: set[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=set)
    _validators: dict[tuple[str, str, str], Callable[[Any], bool | None]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self._old_folder = Folder(self.old.root, loose=False)
        self._new_folder = Folder(self.new.root, loose=True)

    def check(self, new: list[Ref], old: list[Ref], path: str) -> list[Finding]:
        """What keeps NEW's schema (all of `new` at once) from being within OLD's at `path`;
        nothing when every instance NEW admits, OLD admits."""
        if not old:
            return []
        key = (tuple(r.pointer for r in new), tuple(r.pointer for r in old))
        if key in self._active:  # back where we were, one level down: assumed, as JSON is finite
            return []
        if len(self._active) > _MAX_DEPTH:
            return [Finding("unknown", path, "nested too deeply to compare")]
        self._active.add(key)
        try:
            return self._check(new, old, path)
        finally:
            self._active.discard(key)

    def _check(self, new: list[Ref], old: list[Ref], path: str) -> list[Finding]:
        try:
            olds = self._old_folder.shapes(old)
            news = self._new_folder.shapes(new)
        except Unsupported as exc:
            return [Finding("unknown", path, str(exc))]
        found: list[Finding] = []
        for shape in news:
            found += self._shape(shape, news, olds, (new, old), path)
        return list(dict.fromkeys(found))

    def _shape(
        self,
        shape: Shape,
        news: list[Shape],
        olds: list[Shape],
        refs: tuple[list[Ref], list[Ref]],
        path: str,
    ) -> list[Finding]:
        if shape.values is not None:
            return self._values(shape.values, refs, path)
        new, old = self.new.name, self.old.name
        exact: list[Finding] = []
        found: list[Finding] = []
        if not olds:
            found.append(Finding("breaking", path, f"{new} admits a value here; {old} admits none"))
        missing: list[str] = []  # kinds OLD admits none of
        for kind in KINDS:
            if kind not in shape.kinds or not olds:
                continue
            if kind in ("null", "boolean"):  # few values: checked one by one, exactly
                values = [None] if kind == "null" else [False, True]
                checked = self._values(values, refs, path)
                if len(checked) == len(values) and all(f.verdict == "breaking" for f in checked):
                    why = f"{new} admits {_TEXT[kind]} here; {old} does not"
                    checked = [Finding("breaking", path, why)]
                exact += checked
            elif not any(kind in o.kinds for o in olds):
                missing.append(kind)
            else:
                found += self._kind(shape, kind, olds, path)
        if missing:
            admitted = [k for k in KINDS if any(k in o.kinds for o in olds)]
            said = f"only {_texts(admitted)}" if admitted else "nothing"
            found.insert(
                0, Finding("breaking", path, f"{new} admits {_texts(missing)} here; {old} {said}")
            )
        if shape.loose:
            unless = f"unless {new}'s `{shape.loose[0]}` rules it out"
            found = [_unsure(f, unless) for f in found]
        elif shape.exclusive and any(
            other is not shape and not self._apart(shape, other, self._new_folder) for other in news
        ):
            unless = f"unless {new}'s oneOf refuses it for matching two alternatives"
            found = [_unsure(f, unless) for f in found]
        return [_drafted(f, shape, new) for f in exact + found]

    def _kind(self, shape: Shape, kind: str, olds: list[Shape], path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        near = [o for o in olds if kind in o.kinds and not self._apart(shape, o, self._old_folder)]
        if not near:
            alike = [o for o in olds if kind in o.kinds]
            if len(alike) == 1 and (said := self._against(shape, alike[0], kind, path)):
                return said  # one alternative: say what keeps NEW out of it
            why = f"{new} admits {_TEXT[kind]} here that no alternative of {old} admits"
            return [Finding("breaking", path, why)]
        results = [self._against(shape, o, kind, path) for o in near]
        if any(not result for result in results):
            if len(near) > 1 and any(o.exclusive for o in near):
                why = f"{new}'s {_TEXT[kind]} here may match two alternatives of {old}'s oneOf"
                return [Finding("unknown", path, why)]
            return []
        if len(near) == 1:
            return results[0]
        why = (
            f"no single alternative of {old}'s anyOf/oneOf admits all of {new}'s {_TEXT[kind]}"
            " here; together they may"
        )
        return [Finding("unknown", path, why)]

    def _against(self, shape: Shape, o: Shape, kind: str, path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        if o.values is not None:
            listed = ", ".join(_show(v) for v in o.values[:5]) + (
                ", ..." if len(o.values) > 5 else ""
            )
            why = f"{new} admits {_TEXT[kind]} here beyond {old}'s values {listed}"
            return [Finding("breaking", path, why)]
        found: list[Finding] = []
        for keyword in o.unmodelled:
            if kind in UNMODELLED[keyword]:
                found.append(Finding("unknown", path, f"{old}'s `{keyword}` is not compared"))
        for keyword, value in o.opaque:
            if kind in OPAQUE[keyword] and (keyword, value) not in shape.opaque:
                why = (
                    f"{old}'s `{keyword}` is compared only with the very same `{keyword}` in "
                    f"{new}, which is not there"
                )
                for draft in (d for k, d in shape.ignored if k == keyword):
                    why = (
                        f"{old}'s `{keyword}` is not enforced by {new}: {new}'s schema is draft "
                        f"{draft}, which does not define `{keyword}`"
                    )
                found.append(Finding("unknown", path, why))
        if kind in NUMBERS:
            found += self._numbers(shape, o, kind, path)
        elif kind == "string":
            found += self._strings(shape, o, path)
        elif kind == "array":
            found += self._arrays(shape, o, path)
        elif kind == "object":
            found += self._objects(shape, o, path)
        return found

    def _numbers(self, shape: Shape, o: Shape, kind: str, path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        found: list[Finding] = []
        if kind != "fraction":
            (new_low, new_high), (old_low, old_high) = (
                integer_bounds(shape.low, shape.high),
                integer_bounds(o.low, o.high),
            )
            low_relaxed = old_low is not None and (new_low is None or new_low < old_low)
            high_relaxed = old_high is not None and (new_high is None or new_high > old_high)
        else:
            low_relaxed = o.low is not None and (shape.low is None or _below(shape.low, o.low))
            high_relaxed = o.high is not None and (shape.high is None or _above(shape.high, o.high))
        if low_relaxed:
            why = (
                f"a lower bound relaxed: {old} admits {_TEXT[kind]} {_bound(o.low, False)}, "
                f"{new} {_bound(shape.low, False)}"
            )
            found.append(Finding("breaking", path, why))
        if high_relaxed:
            why = (
                f"an upper bound relaxed: {old} admits {_TEXT[kind]} {_bound(o.high, True)}, "
                f"{new} {_bound(shape.high, True)}"
            )
            found.append(Finding("breaking", path, why))
        for step in o.multiples:
            every_integer = kind != "fraction" and (1 / step).denominator == 1
            if not every_integer and not any((m / step).denominator == 1 for m in shape.multiples):
                why = f"{old} admits only multiples of {_fraction(step)}; {new} does not require it"
                found.append(Finding("breaking", path, why))
        return found

    def _strings(self, shape: Shape, o: Shape, path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        found: list[Finding] = []
        if shape.min_length < o.min_length:
            why = f"minLength relaxed: {old} {o.min_length}, {new} {shape.min_length}"
            found.append(Finding("breaking", path, why))
        if o.max_length is not None and (
            shape.max_length is None or shape.max_length > o.max_length
        ):
            said = "none" if shape.max_length is None else shape.max_length
            why = f"maxLength relaxed: {old} {o.max_length}, {new} {said}"
            found.append(Finding("breaking", path, why))
        for name in sorted(o.formats - shape.formats):
            why = f"`format: {name}` is gone: {new} admits strings {old} says are not {name}"
            found.append(Finding("breaking", path, why))
        for pattern in sorted(o.patterns - shape.patterns - _ANY_STRING):
            if shape.patterns:
                why = (
                    f"{old}'s pattern {pattern!r} is not in {new}: patterns are compared as "
                    f"text, and {new}'s may or may not imply it"
                )
                found.append(Finding("unknown", path, why))
            else:
                why = f"the pattern {pattern!r} is gone: {new} admits strings {old} refuses"
                found.append(Finding("breaking", path, why))
        if shape.patterns - o.patterns:  # NEW's own pattern may keep it within OLD's bounds
            unless = f"unless {new}'s pattern rules it out"
            found = [_unsure(f, unless) for f in found]
        return found

    def _arrays(self, shape: Shape, o: Shape, path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        found: list[Finding] = []
        if shape.min_items < o.min_items:
            why = f"minItems relaxed: {old} {o.min_items}, {new} {shape.min_items}"
            found.append(Finding("breaking", path, why))
        if o.max_items is not None and (shape.max_items is None or shape.max_items > o.max_items):
            said = "none" if shape.max_items is None else shape.max_items
            why = f"maxItems relaxed: {old} {o.max_items}, {new} {said}"
            found.append(Finding("breaking", path, why))
        if o.unique and not shape.unique and (shape.max_items is None or shape.max_items > 1):
            why = f"{old} requires unique items; {new} does not"
            found.append(Finding("breaking", path, why))
        length = max(len(shape.prefix), len(o.prefix))
        for index in range(length):
            if shape.max_items is not None and index >= shape.max_items:
                return found
            found += self.check(shape.item(index), o.item(index), f"{path}[{index}]")
        if shape.max_items is None or shape.max_items > length:
            found += self.check(
                shape.rest, o.rest, f"{path}[{length}:]" if length else f"{path}[*]"
            )
        return found

    def _objects(self, shape: Shape, o: Shape, path: str) -> list[Finding]:
        new, old = self.new.name, self.old.name
        found: list[Finding] = []
        for name in sorted(shape.names() | o.names()):
            at = member(path, name)
            schemas, olds = shape.property(name), o.property(name)
            present = not _never(schemas)
            unrequired = name in o.required and name not in shape.required
            if unrequired:
                found.append(Finding("breaking", at, self._unrequired(name, shape, present)))
            if not present:
                continue
            if _never(olds):
                named = any(name in properties for properties, _ in o.parts)
                why = (
                    f"{new} admits `{name}`, which {old} refuses"
                    if named
                    else f"a new property `{name}` where {old} closes additionalProperties"
                )
                found.append(Finding("breaking", at, why))
                continue
            inner = self.check(schemas, olds, at)
            if inner and not schemas and not any(name in p for p, _ in shape.parts):
                verdict: Verdict = (
                    "breaking" if all(f.verdict == "breaking" for f in inner) else "unknown"
                )
                why = f"{old} describes `{name}`; {new} does not, and admits any value for it"
                if self.reverse:  # what NEW adds, which OLD's open schema admitted
                    why = f"`{name}` is new: {old} describes it; {new} did not, and admitted any"
                inner = [] if self.reverse and unrequired else [Finding(verdict, at, why)]
            found += inner
        others = shape.others()
        if not _never(others):
            if _never(o.others()):
                why = f"{new} admits properties {old} does not name: {old} closes the others"
                found.append(Finding("breaking", f"{path}.*", why))
            else:
                found += self.check(others, o.others(), f"{path}.*")
        if o.max_properties is not None and (
            shape.max_properties is None or shape.max_properties > o.max_properties
        ):
            why = f"maxProperties relaxed: {old} {o.max_properties}, {new} {shape.max_properties}"
            found.append(Finding("breaking", path, why))
        if max(shape.min_properties, len(shape.required)) < o.min_properties:
            why = f"minProperties relaxed: {old} {o.min_properties}, {new} {shape.min_properties}"
            found.append(Finding("breaking", path, why))
        return found

    def _unrequired(self, name: str, shape: Shape, present: bool) -> str:
        """Why OLD's required `name` may be missing from NEW's messages; in reverse (OLD's
        within NEW's), that NEW now always sends it."""
        new, old = self.new.name, self.old.name
        gone = not present or not any(name in p for p, _ in shape.parts)
        if self.reverse:
            said = "new" if gone else "now required"
            return f"`{name}` is {said}: {old} always sends it; {new} did not"
        said = "gone" if gone else "no longer required"
        return f"`{name}` is {said}; {old} requires it"

    def _apart(self, shape: Shape, other: Shape, folder: Folder) -> bool:
        """No instance is in both, as their values or a required property's values show."""
        if shape.values is not None and other.values is not None:
            return not {same_value(v) for v in shape.values} & {same_value(v) for v in other.values}
        if not shape.kinds - NUMBERS and _apart_ranges(shape, other):
            return True
        for name in shape.required:
            if _never(other.property(name)):
                return True
            mine = self._finite(self._new_folder, shape.property(name))
            theirs = self._finite(folder, other.property(name))
            if mine is not None and theirs is not None and not mine & theirs:
                return True
        return False

    @staticmethod
    def _finite(folder: Folder, refs: list[Ref]) -> set[str] | None:
        if not refs:
            return None
        try:
            shapes = folder.shapes(refs)
        except Unsupported:
            return None
        if any(s.values is None for s in shapes):
            return None
        return {same_value(v) for s in shapes for v in s.values or []}

    def _values(
        self, values: list[Any], refs: tuple[list[Ref], list[Ref]], path: str
    ) -> list[Finding]:
        """Each value checked against both schemas with a real validator: exact."""
        new, old = self.new.name, self.old.name
        found: list[Finding] = []
        for value in values:
            in_new = self._admits(self.new, refs[0], value)
            if in_new is False:
                continue
            in_old = self._admits(self.old, refs[1], value)
            if in_new and in_old is False:
                why = f"{new} admits {_show(value)} here; {old} does not"
                found.append(Finding("breaking", path, why))
            elif in_old is not True:
                why = f"whether {old} admits {_show(value)} here cannot be told"
                found.append(Finding("unknown", path, why))
        return found

    def _admits(self, side: Side, refs: list[Ref], value: Any) -> bool | None:
        """True or False, or None when a format or a reference cannot be checked here."""
        answers = [self._validator(side, ref)(value) for ref in refs]
        if False in answers:
            return False
        return None if None in answers else True

    def _validator(self, side: Side, ref: Ref) -> Callable[[Any], bool | None]:
        key = (side.name, ref.pointer, ref.draft)
        if key not in self._validators:
            self._validators[key] = _validator(side.root, ref)
        return self._validators[key]


def _validator(root: Any, ref: Ref) -> Callable[[Any], bool | None]:
    """The relay's validator of the draft (jsonschema's, `multipleOf` exact), over the whole
    document, for the node at `ref`.

    `$id`s are dropped from the copy it reads: the contract resolves `#/...` in the whole
    document, as AsyncAPI does, not in the embedded schema an `$id` would start.
    """
    from jsonschema import FormatChecker  # noqa: PLC0415 - 0.2 s to import: only when compared
    from referencing import Registry  # noqa: PLC0415
    from referencing.exceptions import Unresolvable  # noqa: PLC0415
    from referencing.jsonschema import DRAFT7, DRAFT201909, DRAFT202012  # noqa: PLC0415

    uri = {
        "4": "http://json-schema.org/draft-04/schema#",
        "6": "http://json-schema.org/draft-06/schema#",
        "7": "http://json-schema.org/draft-07/schema#",
        "2019-09": "https://json-schema.org/draft/2019-09/schema",
        "2020-12": "https://json-schema.org/draft/2020-12/schema",
    }[ref.draft]
    specification = {"2019-09": DRAFT201909, "2020-12": DRAFT202012}.get(ref.draft, DRAFT7)
    resource = specification.create_resource(_without_ids(root))
    registry: Registry[Any] = Registry().with_resource("urn:relay:contract", resource)
    checker = FormatChecker()
    if _formats(root, ref.node, set()) - set(checker.checkers):
        return lambda _value: None
    schema = {"$schema": uri, "$ref": "urn:relay:contract#" + quote(ref.pointer, safe="/~")}
    validator = validator_class(schema)(schema, registry=registry, format_checker=checker)

    def admits(value: Any) -> bool | None:
        try:
            return bool(validator.is_valid(value))
        except (Unresolvable, RecursionError):
            return None

    return admits


def _without_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: _without_ids(v) for k, v in node.items() if not (k == "$id" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_without_ids(v) for v in node]
    return node


def _formats(root: Any, node: Any, seen: set[int]) -> set[str]:
    """Every `format` the node can reach, through its `$ref`s too."""
    if id(node) in seen:
        return set()
    seen.add(id(node))
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("format"), str):
            found.add(node["format"])
        if isinstance(ref := node.get("$ref"), str):
            with contextlib.suppress(Unsupported):
                found |= _formats(root, resolve(root, ref, "7").node, seen)
        for value in node.values():
            found |= _formats(root, value, seen)
    elif isinstance(node, list):
        for value in node:
            found |= _formats(root, value, seen)
    return found


def _never(refs: list[Ref]) -> bool:
    return any(ref.node is False for ref in refs)


def _texts(kinds: list[str]) -> str:
    words = [_TEXT[k] for k in kinds]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _apart_ranges(one: Shape, other: Shape) -> bool:
    """Numeric bounds that leave no number in both."""
    for low, high in ((one.low, other.high), (other.low, one.high)):
        if low and high and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
            return True
    return False


def _below(new: Bound, old: Bound) -> bool:
    """NEW's lower bound admits a value OLD's does not."""
    return new[0] < old[0] or (new[0] == old[0] and old[1] and not new[1])


def _above(new: Bound, old: Bound) -> bool:
    return new[0] > old[0] or (new[0] == old[0] and old[1] and not new[1])


def _fraction(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def _drafted(finding: Finding, shape: Shape, new: str) -> Finding:
    """A finding that names the keywords NEW wrote but its draft does not define."""
    said = [(k, d) for k, d in shape.ignored if f"`{k}`" not in finding.why]
    if not said:
        return finding
    notes = "; ".join(f"`{k}` is not a keyword of draft {d}" for k, d in said)
    return Finding(finding.verdict, finding.path, f"{finding.why} ({new}'s {notes})")


def _unsure(finding: Finding, unless: str) -> Finding:
    if finding.verdict != "breaking":
        return finding
    return Finding("unknown", finding.path, f"{finding.why}, {unless}")


def compare(old: Any, new: Any, path: str = "$") -> list[Finding]:
    """NEW ⊆ OLD for two standalone schemas (each its own root)."""
    inclusion = Inclusion(Side(old, "OLD"), Side(new, "NEW"))
    return inclusion.check([root_ref(new)], [root_ref(old)], path)


def root_ref(node: Any, pointer: str = "") -> Ref:
    """A schema where it sits, in the draft its `$schema` names (draft 7 by default)."""
    draft = draft_of(node.get("$schema"), "7") if isinstance(node, dict) else "7"
    return Ref(node, pointer, draft)
