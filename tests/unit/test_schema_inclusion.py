"""The payload schema check behind `relay contract diff`: pairs of schemas, each with the verdict
a consumer's author would give, and the check held to what it claims.

For every `compatible` or `equal` pair, hypothesis-jsonschema generates messages NEW admits and
OLD must admit each one. For every `breaking` pair, a message NEW admits and OLD refuses is
written out and checked with jsonschema, so a `breaking` verdict is never a guess either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from jsonschema import FormatChecker
from jsonschema.validators import validator_for

from relay.asyncapi.schema_inclusion import compare
from relay.asyncapi.schema_shapes import DEFINED_IN
from relay.mapping.message_schemas import validator_class

Expected = Literal["equal", "compatible", "breaking", "unknown"]
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"
DRAFT_7 = "http://json-schema.org/draft-07/schema#"
DRAFT_4 = "http://json-schema.org/draft-04/schema#"
NO_WITNESS = object()


@dataclass(frozen=True)
class Pair:
    old: Any
    new: Any
    expected: Expected
    path: str = "$"  # where the first finding is, for breaking and unknown
    witness: Any = NO_WITNESS  # for breaking: a message NEW admits and OLD refuses
    generate: bool = True  # hypothesis-jsonschema cannot generate from recursive schemas


def obj(properties: dict[str, Any], required: list[str] | None = None, **more: Any) -> Any:
    return {"type": "object", "properties": properties, "required": required or [], **more}


S, INT, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
LENT = obj({"bookId": S, "loanId": S}, ["bookId", "loanId"], additionalProperties=False)
MEMBER = obj({"member": obj({"id": S, "name": S}, ["id"])}, ["member"])

PAIRS: dict[str, Pair] = {
    # -- the same messages, written differently
    "identical": Pair(LENT, LENT, "equal"),
    "properties and required reordered": Pair(
        LENT,
        {
            "additionalProperties": False,
            "required": ["loanId", "bookId"],
            "properties": {"loanId": S, "bookId": S},
            "type": "object",
        },
        "equal",
    ),
    "an enum reordered": Pair({"enum": ["a", "b"]}, {"enum": ["b", "a"]}, "equal"),
    "a $ref for a property written inline": Pair(
        obj({"member": {"$ref": "#/definitions/member"}}, ["member"], definitions={"member": S}),
        obj({"member": S}, ["member"]),
        "equal",
    ),
    "2020-12 $defs and the same schema inline": Pair(
        {
            "$schema": DRAFT_2020,
            "type": "object",
            "properties": {"m": {"$ref": "#/$defs/m"}},
            "$defs": {"m": {"type": "string", "maxLength": 5}},
        },
        {
            "$schema": DRAFT_2020,
            "type": "object",
            "properties": {"m": {"type": "string", "maxLength": 5}},
        },
        "equal",
    ),
    "allOf of two parts and the merged object": Pair(
        obj({"a": S, "b": INT}, ["a", "b"]),
        {"allOf": [obj({"a": S}, ["a"]), obj({"b": INT}, ["b"])]},
        "equal",
    ),
    "nullable as anyOf and as a type list": Pair(
        {"anyOf": [S, {"type": "null"}]}, {"type": ["null", "string"]}, "equal"
    ),
    "a recursive $ref, unchanged": Pair(
        obj({"next": {"$ref": "#"}, "v": INT}, ["v"]),
        obj({"next": {"$ref": "#"}, "v": INT}, ["v"]),
        "equal",
        generate=False,
    ),
    # -- a property removed while OLD required it; made required
    "a required property removed": Pair(
        LENT,
        obj({"bookId": S}, ["bookId"], additionalProperties=False),
        "breaking",
        "$.loanId",
        {"bookId": "b1"},
    ),
    "a property made required": Pair(
        obj({"bookId": S, "note": S}, ["bookId"]),
        obj({"bookId": S, "note": S}, ["bookId", "note"]),
        "compatible",
    ),
    "required loosened": Pair(
        obj({"bookId": S, "note": S}, ["bookId", "note"]),
        obj({"bookId": S, "note": S}, ["bookId"]),
        "breaking",
        "$.note",
        {"bookId": "b1"},
    ),
    "an optional property no longer described, under an open schema": Pair(
        obj({"bookId": S, "note": S}, ["bookId"]),
        obj({"bookId": S}, ["bookId"]),
        "breaking",
        "$.note",
        {"bookId": "b1", "note": 3},
    ),
    # -- types
    "a type widened": Pair(
        obj({"n": INT}, ["n"]),
        obj({"n": {"type": ["integer", "string"]}}, ["n"]),
        "breaking",
        "$.n",
        {"n": "x"},
    ),
    "a type narrowed": Pair(
        obj({"n": {"type": ["integer", "string"]}}), obj({"n": INT}), "compatible"
    ),
    "integer to number": Pair(INT, N, "breaking", "$", 1.5),
    "number to integer": Pair(N, INT, "compatible"),
    # draft 4's integer refuses 1.0; from draft 6 on, 1.0 is an integer
    "draft 4's integer to draft 7's": Pair(
        {"$schema": DRAFT_4, **INT}, {"$schema": DRAFT_7, **INT}, "breaking", "$", 1.0
    ),
    "draft 4's integer to 2020-12's": Pair(
        {"$schema": DRAFT_4, **INT}, {"$schema": DRAFT_2020, **INT}, "breaking", "$", 1.0
    ),
    "draft 4's integer to a draft 7 number that is a multiple of 1": Pair(
        {"$schema": DRAFT_4, **INT},
        {"$schema": DRAFT_7, "type": "number", "multipleOf": 1},
        "breaking",
        "$",
        1.0,
    ),
    "draft 7's integer to draft 4's": Pair(
        {"$schema": DRAFT_7, **INT}, {"$schema": DRAFT_4, **INT}, "compatible"
    ),
    "a draft 4 number that is a multiple of 1 and draft 7's integer": Pair(
        {"$schema": DRAFT_4, "type": "number", "multipleOf": 1},
        {"$schema": DRAFT_7, **INT},
        "equal",
    ),
    "made nullable": Pair(S, {"type": ["string", "null"]}, "breaking", "$", None),
    "no longer nullable": Pair({"type": ["string", "null"]}, S, "compatible"),
    # -- enum and const
    "a new enum value": Pair({"enum": ["a", "b"]}, {"enum": ["a", "b", "c"]}, "breaking", "$", "c"),
    "an enum value removed": Pair({"enum": ["a", "b"]}, {"enum": ["a"]}, "compatible"),
    "an enum opened up to any string": Pair({"enum": ["a", "b"]}, S, "breaking", "$", "z"),
    "a const changed": Pair(
        {"const": "/outbox-relay/a"},
        {"const": "/outbox-relay/b"},
        "breaking",
        "$",
        "/outbox-relay/b",
    ),
    "a string narrowed to a const": Pair(S, {"const": "v2"}, "compatible"),
    # -- additionalProperties
    "a new property where OLD closed additionalProperties": Pair(
        LENT,
        obj(
            {"bookId": S, "loanId": S, "note": S}, ["bookId", "loanId"], additionalProperties=False
        ),
        "breaking",
        "$.note",
        {"bookId": "b", "loanId": "l", "note": "n"},
    ),
    "a new optional property under an open schema": Pair(
        obj({"bookId": S}, ["bookId"]), obj({"bookId": S, "note": S}, ["bookId"]), "compatible"
    ),
    "additionalProperties opened": Pair(
        LENT,
        obj({"bookId": S, "loanId": S}, ["bookId", "loanId"]),
        "breaking",
        "$.*",
        {"bookId": "b", "loanId": "l", "extra": 1},
    ),
    "additionalProperties closed": Pair(
        obj({"bookId": S, "loanId": S}, ["bookId", "loanId"]), LENT, "compatible"
    ),
    # -- bounds
    "a minimum relaxed": Pair({"type": "integer", "minimum": 0}, INT, "breaking", "$", -1),
    "a minimum tightened": Pair(
        {"type": "integer", "minimum": 0}, {"type": "integer", "minimum": 1}, "compatible"
    ),
    "an exclusiveMaximum relaxed to maximum": Pair(
        {"type": "number", "exclusiveMaximum": 10},
        {"type": "number", "maximum": 10},
        "breaking",
        "$",
        10,
    ),
    "an integer's exclusive bound written inclusive": Pair(
        {"type": "integer", "exclusiveMinimum": 0}, {"type": "integer", "minimum": 1}, "equal"
    ),
    "draft 4's boolean exclusiveMinimum dropped": Pair(
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "number",
            "minimum": 0,
            "exclusiveMinimum": True,
        },
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0},
        "breaking",
        "$",
        0,
    ),
    "maxLength relaxed": Pair(
        {"type": "string", "maxLength": 3},
        {"type": "string", "maxLength": 4},
        "breaking",
        "$",
        "abcd",
    ),
    "maxLength tightened": Pair(
        {"type": "string", "maxLength": 4}, {"type": "string", "maxLength": 3}, "compatible"
    ),
    "minLength relaxed": Pair({"type": "string", "minLength": 1}, S, "breaking", "$", ""),
    "multipleOf relaxed": Pair(
        {"type": "number", "multipleOf": 0.5},
        {"type": "number", "multipleOf": 0.25},
        "breaking",
        "$",
        0.25,
    ),
    "an integer written as a number that is a multiple of 1": Pair(
        INT, {"type": "number", "multipleOf": 1}, "equal"
    ),
    "a number that is a multiple of 3 and an integer multiple of 3": Pair(
        {"type": "integer", "multipleOf": 3}, {"type": "number", "multipleOf": 3}, "equal"
    ),
    "multipleOf of a decimal, tightened (0.3 is a multiple of 0.1)": Pair(
        {"type": "number", "multipleOf": 0.1},
        {"type": "number", "multipleOf": 0.3},
        "compatible",
        generate=False,  # hypothesis-jsonschema multiplies floats: 3 * 0.3 is 0.8999999999999999
    ),
    "a const that is a multiple of a decimal": Pair(
        {"$schema": DRAFT_2020, "type": "number", "multipleOf": 0.1},
        {"$schema": DRAFT_2020, "const": 0.3},
        "compatible",
    ),
    "multipleOf tightened": Pair(
        {"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 6}, "compatible"
    ),
    # -- formats and patterns
    "a format removed": Pair(
        {"type": "string", "format": "date-time"}, S, "breaking", "$", "yesterday"
    ),
    "a format added": Pair(S, {"type": "string", "format": "date-time"}, "compatible"),
    "a pattern removed": Pair({"type": "string", "pattern": "^[a-z]+$"}, S, "breaking", "$", "ABC"),
    "the same pattern": Pair(
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 9},
        "compatible",
    ),
    "a pattern changed": Pair(
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "pattern": "^[a-c]+$"},
        "unknown",
    ),
    # -- nested objects and arrays
    "a nested property widened": Pair(
        MEMBER,
        obj(
            {"member": obj({"id": {"type": ["string", "integer"]}, "name": S}, ["id"])}, ["member"]
        ),
        "breaking",
        "$.member.id",
        {"member": {"id": 7}},
    ),
    "a nested property made required": Pair(
        MEMBER, obj({"member": obj({"id": S, "name": S}, ["id", "name"])}, ["member"]), "compatible"
    ),
    "array items widened": Pair(
        obj({"lines": {"type": "array", "items": INT}}),
        obj({"lines": {"type": "array", "items": N}}),
        "breaking",
        "$.lines[*]",
        {"lines": [0.5]},
    ),
    "array items narrowed, and a maxItems": Pair(
        obj({"lines": {"type": "array", "items": N}}),
        obj({"lines": {"type": "array", "items": INT, "maxItems": 3}}),
        "compatible",
    ),
    "maxItems relaxed": Pair(
        {"type": "array", "maxItems": 1}, {"type": "array"}, "breaking", "$", [1, 2]
    ),
    "uniqueItems dropped": Pair(
        {"type": "array", "items": INT, "uniqueItems": True},
        {"type": "array", "items": INT},
        "breaking",
        "$",
        [1, 1],
    ),
    "2020-12 prefixItems: a second item where OLD allowed one": Pair(
        {"$schema": DRAFT_2020, "type": "array", "prefixItems": [S], "items": False},
        {"$schema": DRAFT_2020, "type": "array", "prefixItems": [S, INT], "items": False},
        "breaking",
        "$[1]",
        ["a", 1],
    ),
    # -- oneOf and anyOf
    "a new oneOf alternative": Pair(
        {"oneOf": [S, INT]}, {"oneOf": [S, INT, {"type": "boolean"}]}, "breaking", "$", True
    ),
    "a oneOf alternative removed": Pair({"oneOf": [S, INT]}, {"oneOf": [S]}, "compatible"),
    "a new variant of a discriminated oneOf": Pair(
        {
            "oneOf": [
                obj({"kind": {"const": "lent"}}, ["kind"]),
                obj({"kind": {"const": "returned"}}, ["kind"]),
            ]
        },
        {
            "oneOf": [
                obj({"kind": {"const": "lent"}}, ["kind"]),
                obj({"kind": {"const": "lost"}}, ["kind"]),
            ]
        },
        "breaking",
        "$",
        {"kind": "lost"},
    ),
    "a variant of a discriminated oneOf removed": Pair(
        {
            "oneOf": [
                obj({"kind": {"const": "lent"}}, ["kind"]),
                obj({"kind": {"const": "returned"}}, ["kind"]),
            ]
        },
        {"oneOf": [obj({"kind": {"const": "lent"}}, ["kind"])]},
        "compatible",
    ),
    "anyOf alternatives that overlap": Pair(
        {"anyOf": [{"type": "integer", "maximum": 10}, {"type": "integer", "minimum": 5}]},
        INT,
        "unknown",
    ),
    "a oneOf whose alternatives overlap": Pair(
        {"oneOf": [{"type": "integer", "maximum": 10}, {"type": "integer", "minimum": 5}]},
        {"type": "integer", "maximum": 3},
        "compatible",
    ),
    # -- what is not modelled: unknown, never compatible
    "a $ref under a nested $id, read from the root's base": Pair(
        obj(
            {
                "a": {
                    "$id": "http://x.test/sub.json",
                    **obj({"b": {"$ref": "#/definitions/s"}}),
                    "definitions": {"s": INT},
                }
            },
            definitions={"s": S},
        ),
        obj({"a": obj({"b": S})}, definitions={"s": S}),
        "unknown",
        "$.a.b",
    ),
    "a $ref to an anchor": Pair(
        {"$schema": DRAFT_2020, **obj({"b": {"$ref": "#i"}}), "$defs": {"i": {"$anchor": "i"}}},
        obj({"b": S}),
        "unknown",
        "$.b",
    ),
    "OLD's not, gone from NEW": Pair({"not": {"const": 0}}, INT, "unknown"),
    "OLD's if/then, gone from NEW": Pair(
        {"if": obj({"a": S}, ["a"]), "then": obj({}, ["b"])}, {"type": "object"}, "unknown"
    ),
    "OLD's patternProperties, changed": Pair(
        {"type": "object", "patternProperties": {"^x": S}},
        {"type": "object", "patternProperties": {"^x": INT}},
        "unknown",
    ),
    # -- each schema read by its own draft's keywords: one its draft does not define is no
    # constraint there
    "2020-12's dependentRequired, in a draft 7 schema": Pair(
        {"$schema": DRAFT_2020, **obj({"a": S, "b": S}), "dependentRequired": {"a": ["b"]}},
        {"$schema": DRAFT_7, **obj({"a": S, "b": S}), "dependentRequired": {"a": ["b"]}},
        "unknown",
    ),
    "draft 7's dependencies, in a 2020-12 schema": Pair(
        {"$schema": DRAFT_7, **obj({"a": S, "b": S}), "dependencies": {"a": ["b"]}},
        {"$schema": DRAFT_2020, **obj({"a": S, "b": S}), "dependencies": {"a": ["b"]}},
        "unknown",
    ),
    "a const, in a draft 4 schema": Pair(
        {"$schema": DRAFT_7, "type": "string", "const": "a"},
        {"$schema": DRAFT_4, "type": "string", "const": "a"},
        "breaking",
        "$",
        "b",
    ),
    "contains, in a draft 4 schema": Pair(
        {"$schema": DRAFT_7, "type": "array", "contains": INT},
        {"$schema": DRAFT_4, "type": "array", "contains": INT},
        "unknown",
    ),
    "OLD's const in draft 4 constrains nothing": Pair(
        {"$schema": DRAFT_4, "type": "string", "const": "a"}, S, "equal"
    ),
    # -- boolean schemas
    "NEW admits nothing": Pair(LENT, False, "compatible"),
    "OLD admits anything": Pair(True, LENT, "compatible"),
    "NEW admits anything": Pair(LENT, True, "breaking", "$", 5),
}


def verdict(old: Any, new: Any) -> str:
    found = compare(old, new)
    if not found:
        return "equal" if not compare(new, old) else "compatible"
    return "breaking" if all(f.verdict == "breaking" for f in found) else "unknown"


def admits(schema: Any, value: Any) -> bool:
    """The relay's validator's answer (jsonschema's, `multipleOf` exact), formats checked:
    what a strict consumer's validator says."""
    cls = validator_class(schema if isinstance(schema, dict) else {})
    return bool(cls(schema, format_checker=FormatChecker()).is_valid(value))


@pytest.mark.parametrize("name", PAIRS)
def test_the_verdict_is_the_one_a_consumers_author_gives(name: str) -> None:
    pair = PAIRS[name]
    assert verdict(pair.old, pair.new) == pair.expected
    if pair.expected in ("breaking", "unknown"):
        assert compare(pair.old, pair.new)[0].path == pair.path


@pytest.mark.parametrize("name", [n for n, p in PAIRS.items() if p.expected == "breaking"])
def test_a_breaking_verdict_has_a_message_new_admits_and_old_refuses(name: str) -> None:
    pair = PAIRS[name]
    assert pair.witness is not NO_WITNESS, "every breaking pair names its witness"
    assert admits(pair.new, pair.witness)
    assert not admits(pair.old, pair.witness)


COMPATIBLE = [
    n
    for n, p in PAIRS.items()
    if p.expected in ("equal", "compatible") and p.generate and p.new is not False
]


@pytest.mark.parametrize("name", COMPATIBLE)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # hypothesis-jsonschema's RefResolver
@settings(
    max_examples=15,  # derandomized: the same fifteen each run, the unit tier kept under 10 s
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_every_message_new_admits_old_admits_when_compatible(
    name: str, data: st.DataObject
) -> None:
    pair = PAIRS[name]
    message = data.draw(from_schema(pair.new), label="message")
    assert admits(pair.new, message)
    assert admits(pair.old, message), f"{name}: OLD refuses {message!r}, which NEW admits"


def test_findings_say_where_and_why() -> None:
    (finding,) = compare(
        LENT, obj({"bookId": S}, ["bookId"], additionalProperties=False), "$.payload"
    )
    assert (finding.verdict, finding.path) == ("breaking", "$.payload.loanId")
    assert finding.why == "`loanId` is gone; OLD requires it"
    (named,) = compare(obj({"ce-id": S}), obj({"ce-id": INT}), "$.headers")
    assert named.path == "$.headers['ce-id']"
    (unknown,) = compare({"not": {"const": 0}}, INT)
    assert "`not`" in unknown.why
    pair = PAIRS["2020-12's dependentRequired, in a draft 7 schema"]
    (drafts,) = compare(pair.old, pair.new)
    assert "`dependentRequired`" in drafts.why and "draft 7" in drafts.why
    pair = PAIRS["a const, in a draft 4 schema"]
    assert all("draft 4" in f.why for f in compare(pair.old, pair.new))


def test_which_draft_defines_a_keyword_is_what_jsonschema_enforces() -> None:
    """The table agrees with jsonschema's validators (`then` and `else` are read by `if`;
    2019-09's minContains and maxContains by `contains`)."""
    uris = {
        "4": DRAFT_4,
        "6": "http://json-schema.org/draft-06/schema#",
        "7": DRAFT_7,
        "2019-09": "https://json-schema.org/draft/2019-09/schema",
        "2020-12": DRAFT_2020,
    }
    for keyword, drafts in DEFINED_IN.items():
        if keyword in ("minContains", "maxContains"):
            continue
        checked = {"then": "if", "else": "if"}.get(keyword, keyword)
        for draft, uri in uris.items():
            enforced = checked in validator_for({"$schema": uri}).VALIDATORS
            assert (draft in drafts) == enforced, (keyword, draft)
