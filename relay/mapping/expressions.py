"""JMESPath expressions and `{...}` templates over the event envelope.

Both are compiled once, at start-up, so that a typo is a config error rather
than a poison message. Plain dotted paths (`data.loanId`), by far the most
common, skip the JMESPath interpreter: they are plain dict look-ups with the
same semantics (a missing key or a non-object gives null).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jmespath
from jmespath.exceptions import JMESPathError

Getter = Callable[[Mapping[str, Any]], Any]

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


class ExpressionError(ValueError):
    """A JMESPath expression or template that does not compile."""


def compile_expression(source: str) -> Getter:
    """Compile a JMESPath expression into a function of the envelope."""
    text = source.strip()
    if not text:
        raise ExpressionError("empty expression")
    if is_dotted(text):
        return _dotted_getter(tuple(text.split(".")))
    try:
        parsed = jmespath.compile(text)
    except JMESPathError as exc:
        raise ExpressionError(f"invalid JMESPath expression {source!r}: {exc}") from exc
    if _infinite_literal(parsed.parsed):
        # `1e400` reads as Infinity, which no JSON can carry: every event would be parked,
        # and `relay contract` wrote it into the document as invalid JSON.
        raise ExpressionError(
            f"invalid JMESPath expression {source!r}: a literal number beyond a float's"
            " range (JSON has no Infinity)"
        )
    return parsed.search


def _infinite_literal(node: Any) -> bool:
    """Whether a parsed expression holds a literal that reads as Infinity."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == "literal" and _holds_infinity(node.get("value")):
        return True
    return any(_infinite_literal(child) for child in node.get("children", ()))


def _holds_infinity(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_holds_infinity(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_infinity(v) for v in value)
    return False


def is_dotted(source: str) -> bool:
    """Whether an expression is a plain dotted path, which needs no JMESPath."""
    return _DOTTED.match(source.strip()) is not None


def may_compute(source: str) -> bool:
    """Whether an expression can produce a number that was not in the event.

    A function (sum, avg, to_number...) or a literal can make NaN or Infinity; a path
    only reads what strict JSON decoding let in. Unparseable text counts as computing.
    """
    text = source.strip()
    if is_dotted(text):
        return False
    try:
        tree = jmespath.compile(text).parsed
    except JMESPathError:
        return True
    return _computes(tree)


def _computes(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") in ("function_expression", "literal"):
        return True
    return any(_computes(child) for child in node.get("children", ()))


def _dotted_getter(parts: tuple[str, ...]) -> Getter:
    if len(parts) == 1:
        (name,) = parts

        def get_one(envelope: Mapping[str, Any]) -> Any:
            return envelope.get(name)

        return get_one

    def get_path(envelope: Mapping[str, Any]) -> Any:
        value: Any = envelope
        for part in parts:
            # type() first: the Mapping check is an ABC look-up, and JSON gives dicts.
            if type(value) is not dict and not isinstance(value, Mapping):
                return None
            value = value.get(part)
        return value

    return get_path


Template = Callable[[Mapping[str, Any]], str]


def template_pieces(source: str) -> tuple[list[tuple[str, str]], str]:
    """Split a template into (literal text before, placeholder expression) steps and a tail.

    `{{` and `}}` come back as single braces in the literal text. Shared by the compiler and
    by `relay contract`, which turns placeholders into AsyncAPI channel parameters.
    """
    steps: list[tuple[str, str]] = []
    literal: list[str] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(source):
        literal.append(source[pos : match.start()])
        token = match.group(0)
        if token in ("{{", "}}"):
            literal.append(token[0])
        elif match.group(1) is None:
            raise ExpressionError(f"unbalanced brace in template {source!r}")
        else:
            steps.append(("".join(literal), match.group(1).strip()))
            literal = []
        pos = match.end()
    literal.append(source[pos:])
    return steps, "".join(literal)


def static_text(template: str) -> str | None:
    """The text of a template without placeholders (`{{` and `}}` are braces), else None."""
    placeholders, text = template_pieces(template)
    return None if placeholders else text


def compile_template(source: str, *, distinct: bool = False) -> Template:
    """Compile `library.{aggregate_type}`; `{{` and `}}` stand for braces.

    `distinct` is for ids: each value is escaped (see `separators`), so that two events
    whose values differ never render one id.
    """
    pieces, tail = template_pieces(source)
    if not pieces:
        return lambda _envelope: tail
    seps: list[str | None] = list(separators(source)) if distinct else [None] * len(pieces)
    steps = tuple(
        (before, expr, compile_expression(expr), sep)
        for (before, expr), sep in zip(pieces, seps, strict=True)
    )
    if len(steps) == 1 and not distinct:
        before, expr, getter, _ = steps[0]
        return _render_one(before, expr, getter, tail)
    return _render(steps, tail)


# What a rule of a list writes after the outbox's id: `/` and its type (config/rules.py).
SUFFIX_SEPARATOR = "/"


def separators(source: str) -> list[str]:
    """For an id template: the character that ends each placeholder's value.

    Read left to right, `{aggregate_type}/{aggregate_id}@{version}` splits at the first `/`
    and the first `@` after it only if the values before them hold neither: `book` + `a/b`
    and `book/a` + `b` would both be `book/a/b@1`, and a deduplicating broker would drop
    one. So each value has `%` and the character after it percent-encoded (`book%2Fa/b@1`).
    After the last value comes the tail, or, when nothing is written after it, the `/` that
    a rule of a list adds before its type: `{metadata.eid}` with `k/v1` must not read as the
    list rule `v1`'s id for `k`.

    `%` or a digit after a placeholder could not end it (the encoding holds them), and two
    placeholders side by side have nothing between them: both are refused.
    """
    pieces, tail = template_pieces(source)
    following = [before for before, _ in pieces[1:]] + [tail or SUFFIX_SEPARATOR]
    seps: list[str] = []
    for i, (_before, expr) in enumerate(pieces):
        after = following[i]
        if not after:
            raise ExpressionError(
                f"{{{expr}}} and {{{pieces[i + 1][1]}}} stand side by side in the id template"
                f" {source!r}: two events could render the same id; put a character between"
            )
        if after[0] == "%" or (after[0].isascii() and after[0].isdigit()):
            raise ExpressionError(
                f"{{{expr}}} is followed by {after[0]!r} in the id template {source!r}: values"
                " in an id are percent-encoded, so a `%` or a digit cannot end one; put"
                " another character after it"
            )
        seps.append(after[0])
    return seps


def normalized(source: str) -> str:
    """The template with its placeholders written alike (`{ aggregate_id }` is
    `{aggregate_id}`): two templates the same but for that render the same text."""
    pieces, tail = template_pieces(source)
    braces = str.maketrans({"{": "{{", "}": "}}"})
    written = "".join(before.translate(braces) + "{" + expr + "}" for before, expr in pieces)
    return written + tail.translate(braces)


def escape(text: str, separator: str) -> str:
    """`%` and `separator` percent-encoded as URLs do (UTF-8): the text no longer holds the
    character that ends it in an id, and the encoding cannot be mistaken for a value."""
    if "%" in text:
        text = text.replace("%", "%25")
    if separator in text:
        text = text.replace(separator, "".join(f"%{b:02X}" for b in separator.encode()))
    return text


def _render_one(before: str, expr: str, getter: Getter, tail: str) -> Template:
    """One placeholder (`{aggregate_id}`, `library.{aggregate_type}`): the common case,
    without the list and join of the general renderer (about a microsecond per event)."""

    def render(envelope: Mapping[str, Any]) -> str:
        value = getter(envelope)
        if value is None or value == "":
            raise null_placeholder(expr)
        return before + (value if type(value) is str else text_of(value)) + tail

    return render


def _render(steps: tuple[tuple[str, str, Getter, str | None], ...], tail: str) -> Template:
    def render(envelope: Mapping[str, Any]) -> str:
        out = []
        for before, expr, getter, sep in steps:
            value = getter(envelope)
            if value is None or value == "":
                raise null_placeholder(expr)
            text = value if type(value) is str else text_of(value)
            out.append(before)
            out.append(escape(text, sep) if sep else text)
        out.append(tail)
        return "".join(out)

    return render


def null_placeholder(expr: str) -> ExpressionError:
    """What a template says of a placeholder with nothing in it: the event fails."""
    return ExpressionError(f"{{{expr}}} is null or empty for this event")


def text_of(value: Any) -> str:
    """A placeholder's value as text: JSON's true and false, anything else as str() writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
