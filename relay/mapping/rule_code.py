"""A rule whose expressions are all dotted paths, compiled into one Python function.

Most rules read only envelope fields and plain paths (`{aggregate_type}/{aggregate_id}`,
`data.loanId`). Interpreting them builds an envelope dict per event and calls a getter per
path and a renderer per template: about half of mapping's cost. Like `dataclasses` writing
`__init__`, this writes the rule out as straight-line code, reading the event's attributes
directly, with exactly the interpreter's semantics: a path through anything but an object
gives null, and a null or empty placeholder fails the event with the same words.

Only generated names and `repr()` literals go into the code; nothing from the config is
spliced in as code. A rule with a JMESPath expression keeps the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

from relay.core.event import Event
from relay.mapping.expressions import (
    escape,
    is_dotted,
    null_placeholder,
    separators,
    template_pieces,
    text_of,
)

Values = Callable[["Event", "str | None"], "tuple[Any, str, str, str, str | None]"]
"""(event, its created_at in ISO 8601) -> (body, id, destination, key, routing key)."""

# Where each envelope field is, inside the generated function.
_FIELDS = {
    "position": "event.position",
    "aggregate_type": "event.aggregate_type",
    "aggregate_id": "event.aggregate_id",
    "version": "event.version",
    "type": "event.type",
    "data": "event.data",
    "metadata": "event.metadata",
    "created_at": "time_text",
}


def _step(value: Any, part: str) -> Any:
    """One step of a path through something that is not a dict: a Mapping, or null."""
    return value.get(part) if isinstance(value, Mapping) else None


class _Writer:
    """Collects the function's lines; each path and each placeholder is computed once."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._paths: dict[str, str] = {}  # dotted path -> local holding its value
        self._texts: dict[str, str] = {}  # dotted path -> local holding it as checked text
        self._escaped: dict[tuple[str, str], str] = {}  # (path, separator) -> escaped text

    def path(self, text: str) -> str:
        text = text.strip()
        if text in self._paths:
            return self._paths[text]
        head, *rest = text.split(".")
        name = f"v{len(self._paths)}"
        self._paths[text] = name
        self.lines.append(f"{name} = {_FIELDS.get(head, 'None')}")
        for part in rest:
            get, step = f"{name}.get({part!r})", f"_step({name}, {part!r})"
            self.lines.append(f"{name} = {get} if type({name}) is dict else {step}")
        return name

    def template(self, source: str, *, distinct: bool = False) -> str:
        """An expression that renders the template, placeholders checked beforehand;
        `distinct` escapes an id's values as `compile_template` does."""
        pieces, tail = template_pieces(source)
        seps: list[str | None] = list(separators(source)) if distinct else [None] * len(pieces)
        parts: list[str] = []
        for (before, expr), sep in zip(pieces, seps, strict=True):
            if before:
                parts.append(repr(before))
            parts.append(self._escape(expr, sep) if sep else self._text(expr))
        if tail or not parts:
            parts.append(repr(tail))
        return " + ".join(parts)

    def _text(self, expr: str) -> str:
        if expr in self._texts:
            return self._texts[expr]
        value = self.path(expr)
        name = f"t{len(self._texts)}"
        self._texts[expr] = name
        self.lines.append(f'if {value} is None or {value} == "":')
        self.lines.append(f"    raise _null({expr!r})")
        self.lines.append(f"{name} = {value} if type({value}) is str else _text({value})")
        return name

    def _escape(self, expr: str, sep: str) -> str:
        """The text, escaped; the `in` tests spare the call for the usual plain value."""
        if (expr, sep) in self._escaped:
            return self._escaped[expr, sep]
        text = self._text(expr)
        name = f"e{len(self._escaped)}"
        self._escaped[expr, sep] = name
        plain = f"'%' not in {text} and {sep!r} not in {text}"
        self.lines.append(f"{name} = {text} if {plain} else _escape({text}, {sep!r})")
        return name


def compile_values(
    payload: str | Mapping[str, str],
    id_: str,
    destination: str,
    key: str,
    routing_key: str | None,
) -> Values | None:
    """The rule's values as one function; None when an expression is not a dotted path.

    Called after the interpreter compiled the same expressions, so a bad one has already
    been reported with its key. The templates are checked in the interpreter's order.
    """
    templates = [id_, destination, key] + ([routing_key] if routing_key else [])
    exprs = [payload] if isinstance(payload, str) else list(payload.values())
    exprs += [expr for source in templates for _, expr in template_pieces(source)[0]]
    if not all(is_dotted(expr) for expr in exprs):
        return None
    w = _Writer()
    if isinstance(payload, str):
        body = w.path(payload)
    else:
        fields = ", ".join(f"{name!r}: {w.path(expr)}" for name, expr in payload.items())
        body = "{" + fields + "}"
    rendered = [w.template(source, distinct=i == 0) for i, source in enumerate(templates)]
    w.lines.append(f"body = {body}")
    rk = rendered[3] if routing_key else "None"
    w.lines.append(f"return body, {rendered[0]}, {rendered[1]}, {rendered[2]}, {rk}")
    code = "def values(event, time_text):\n" + "".join(f"    {line}\n" for line in w.lines)
    namespace: dict[str, Any] = {
        "_step": _step,
        "_null": null_placeholder,
        "_text": text_of,
        "_escape": escape,
    }
    exec(code, namespace)  # generated from our own names and repr() literals only
    values = cast(Values, namespace["values"])
    values.__doc__ = code  # for whoever wonders what a rule became
    return values
