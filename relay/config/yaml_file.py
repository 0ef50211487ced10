"""Reading the YAML config file: `${VAR}` expansion, and the line each error points at.

ruamel.yaml keeps each key's line, so an error found later by pydantic can
still point at `relay.yaml:14`. Expansion happens on parsed scalars, never on
raw text, so a value can never inject YAML structure.

Expansion is parsed, not matched with a regex: a default may itself hold
`${...}` (`${A:-${B:-x}}`), and a regex that stops at the first `}` would turn
that into the literal text `${B}` without a word.

No error quotes the file's values: any of them may be a password. The parser's own text for a
duplicated key quotes both values, so that one is worded here; its warnings quote whole lines,
so they are silenced. Aliases are shared by the parser but walked once per use here, so a few
lines of aliases of aliases would expand to billions of values: the walk has a budget.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from relay.config.overrides import Overrides
from relay.errors import ConfigError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FORMS = "write ${NAME} or ${NAME:-default}, and $$ for a literal $"
_DUPLICATE = re.compile(r'found duplicate key "(?P<key>.*?)" with value "')
# What the parser quotes in its problem text: a token of its own (`'<stream end>'`, `','`),
# or a piece of the file (an alias, a tag, a character), which may be part of a password.
_QUOTED = re.compile(r"""(['"])(.*?)\1""")
_PARSER_TOKEN = re.compile(r"<[a-z ]+>|[^\w\s]{1,3}|\\[tnr0]")
# A real config holds hundreds of values a few levels deep; these bounds are far past that.
MAX_VALUES = 100_000
MAX_DEPTH = 100


@dataclass(frozen=True)
class YamlDocument:
    """A parsed config file: plain data for pydantic, the tree for line look-ups."""

    path: Path
    data: dict[str, Any]
    tree: Any

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """The 1-based line of the deepest key of `loc` found in the file."""
        node, line = self.tree, None
        for part in loc:
            if isinstance(node, CommentedMap) and part in node:
                line = node.lc.key(part)[0] + 1
                node = node[part]
            elif isinstance(node, CommentedSeq) and isinstance(part, int) and part < len(node):
                line = node.lc.item(part)[0] + 1
                node = node[part]
        return line

    def where(self, loc: Sequence[str | int]) -> str:
        line = self.line_of(loc)
        return f"{self.path}:{line}" if line else str(self.path)

    def describe(self, exc: ValidationError, overrides: Overrides | None = None) -> str:
        """The models' errors, each pointing at its key's line, or at the RELAY_* variable
        that set the key (or made the section it is missing from)."""
        return _described(exc, self, overrides or Overrides(self.data, self.data, {}))


def plain(value: Any) -> Any:
    """`value` as plain Python data: the YAML reader keeps its own types (a float subclass,
    maps with comments) for line numbers, which a writer of plain YAML cannot represent
    (`relay contract` died on an inline schema's `maximum: 1.5`)."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [plain(v) for v in value]
    return value


def load_yaml(path: Path, environ: Mapping[str, str] | None = None) -> YamlDocument:
    """Parse `path`, expand environment variables, and keep the line map."""
    env = os.environ if environ is None else environ
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    tree = _parse_yaml(path, text)
    if tree is None:
        tree = CommentedMap()
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    doc = YamlDocument(path=path, data={}, tree=tree)
    data = _Expansion(doc, env).expand(tree, ())
    return YamlDocument(path=path, data=data, tree=tree)


def _parse_yaml(path: Path, text: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ruamel's warnings quote the file's lines
            return YAML(typ="rt").load(text)
    except DuplicateKeyError as exc:
        # Its text quotes both values; `from None` keeps them out of any traceback too.
        raise ConfigError(f"{path}{_line(exc)}: invalid YAML: {_duplicate(exc)}") from None
    except MarkedYAMLError as exc:
        problem = _unquoted(str(exc.problem or "the parser gave no reason"))
        raise ConfigError(f"{path}{_line(exc)}: invalid YAML: {problem}") from None
    except YAMLError as exc:  # a reader's error: an unacceptable byte, at a position
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path}: invalid YAML: {_unquoted(first)}") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: invalid YAML: nested too deeply to read (a config needs a few levels)"
        ) from None


def _line(exc: MarkedYAMLError) -> str:
    mark = exc.problem_mark
    return f":{mark.line + 1}" if mark is not None else ""


def _unquoted(problem: str) -> str:
    """The parser's problem with every quoted piece of the file replaced by `…`."""

    def hide(match: re.Match[str]) -> str:
        quote, text = match.group(1), match.group(2)
        return match.group() if _PARSER_TOKEN.fullmatch(text) else f"{quote}…{quote}"

    return _QUOTED.sub(hide, problem)


def _duplicate(exc: DuplicateKeyError) -> str:
    """Name the key, never its values."""
    found = _DUPLICATE.match(str(exc.problem or ""))
    key = f' "{found.group("key")}"' if found else ""
    return f"the key{key} appears twice in one mapping (values not shown); keep one"


class _Expansion:
    """One walk of the parsed tree: `${VAR}` expanded, within MAX_VALUES and MAX_DEPTH."""

    def __init__(self, doc: YamlDocument, env: Mapping[str, str]) -> None:
        self.doc, self.env, self.values = doc, env, 0

    def expand(self, node: Any, loc: tuple[str | int, ...]) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise ConfigError(
                f"{self.doc.path}: the file expands to more than {MAX_VALUES:,} values "
                "(aliases that repeat aliases?); a config needs far fewer"
            )
        if len(loc) > MAX_DEPTH:
            key = ".".join(str(p) for p in loc[:3])
            raise ConfigError(
                f"{self.doc.where(loc)}: {key}...: nested more than {MAX_DEPTH} levels deep"
            )
        if isinstance(node, Mapping):
            return {str(k): self.expand(v, (*loc, str(k))) for k, v in node.items()}
        if isinstance(node, list):
            return [self.expand(v, (*loc, i)) for i, v in enumerate(node)]
        return _expand_scalar(node, loc, self.doc, self.env)


def _expand_scalar(
    node: Any, loc: tuple[str | int, ...], doc: YamlDocument, env: Mapping[str, str]
) -> Any:
    if isinstance(node, str):
        try:
            return expand_vars(node, env, lambda name: _missing(name, loc, doc))
        except ExpansionError as exc:
            # The message never quotes the value: it may be a URL with a password in it.
            key = ".".join(str(p) for p in loc)
            raise ConfigError(f"{doc.where(loc)}: {key}: {exc}") from None
    return node


def _missing(name: str, loc: tuple[str | int, ...], doc: YamlDocument) -> ConfigError:
    key = ".".join(str(p) for p in loc)
    return ConfigError(
        f"{doc.where(loc)}: {key}: environment variable {name} is not set "
        f"(write ${{{name}:-default}} to give a default)"
    )


class ExpansionError(ValueError):
    """A `${` that is not a well-formed `${NAME}` or `${NAME:-default}`."""


@dataclass(frozen=True)
class _Var:
    name: str
    default: tuple[str | _Var, ...] | None  # None: no `:-`, so an unset variable is an error


def expand_vars(text: str, env: Mapping[str, str], missing: Callable[[str], Exception]) -> str:
    """Expand `${VAR}` and `${VAR:-default}`; `$$` is a literal dollar.

    A default may contain further `${...}`, nested to any depth; it is expanded only when it
    is used, so `${A:-${B}}` needs B only when A is unset or empty. A variable's value is never
    expanded again. `missing(name)` makes the error for an unset variable without a default.
    """
    parts, _ = _parse(text, 0, nested=False)
    return _render(parts, env, missing)


def _parse(text: str, pos: int, *, nested: bool) -> tuple[list[str | _Var], int]:
    """Parts of `text` from `pos`; in a default (`nested`), up to and past its closing `}`."""
    parts: list[str | _Var] = []
    literal: list[str] = []
    while pos < len(text):
        if nested and text[pos] == "}":
            return [*parts, "".join(literal)], pos + 1
        if text.startswith("$$", pos):
            literal.append("$")
            pos += 2
        elif text.startswith("${", pos):
            parts.append("".join(literal))
            literal = []
            var, pos = _parse_var(text, pos + 2)
            parts.append(var)
        else:
            literal.append(text[pos])
            pos += 1
    if nested:
        raise ExpansionError(f"unterminated ${{: a closing }} is missing ({_FORMS})")
    return [*parts, "".join(literal)], pos


def _parse_var(text: str, pos: int) -> tuple[_Var, int]:
    """`NAME}` or `NAME:-default}`, just after a `${`."""
    match = _NAME.match(text, pos)
    end = match.end() if match else pos
    if match is not None and text.startswith("}", end):
        return _Var(match.group(), None), end + 1
    if match is not None and text.startswith(":-", end):
        default, end = _parse(text, end + 2, nested=True)
        return _Var(match.group(), tuple(default)), end
    if "}" not in text[pos:]:
        raise ExpansionError(f"unterminated ${{: a closing }} is missing ({_FORMS})")
    if match is None:
        raise ExpansionError(
            "${ must be followed by a variable name: letters, digits and _, not starting "
            f"with a digit ({_FORMS})"
        )
    # The name is not quoted: this `${` may be a raw `$` in a password, and what follows it
    # a piece of the password.
    raise ExpansionError(
        f"after ${{ and a variable name comes }} or :-default}}, and here it does not ({_FORMS})"
    )


def _render(
    parts: Sequence[str | _Var], env: Mapping[str, str], missing: Callable[[str], Exception]
) -> str:
    out: list[str] = []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        value = env.get(part.name)
        if value is None or (value == "" and part.default is not None):
            if part.default is None:
                raise missing(part.name)
            value = _render(part.default, env, missing)
        out.append(value)
    return "".join(out)


# -- where a validation error points ----------------------------------------------------


def _described(exc: ValidationError, doc: YamlDocument, overrides: Overrides) -> str:
    """A ValidationError as `file:line: dotted.key: message` lines, one a problem."""
    lines = []
    merged = overrides.merged
    for error in exc.errors(include_url=False):
        loc = _clean_loc(error["loc"], merged)
        msg = error["msg"].removeprefix("Value error, ")
        loc, msg = _point_at_field(loc, msg, merged)
        if error["type"] == "extra_forbidden":
            msg = "unknown key"
        elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field = str(error.get("ctx", {}).get("discriminator", "type")).strip("'")
            loc = (*loc, field)
            expected = error.get("ctx", {}).get("expected_tags", "")
            msg = f"unknown or missing {field} (expected one of: {expected})"
        elif error["type"] == "missing":
            msg = "required key is missing"
        key = ".".join(str(p) for p in loc)
        variables = overrides.variables(loc)
        plural = "s" if len(variables) > 1 else ""
        where = (
            f"environment variable{plural} {', '.join(variables)}" if variables else doc.where(loc)
        )
        lines.append(f"{where}: {key}: {msg}" if key else f"{doc.path}: {msg}")
    count = len(lines)
    head = f"invalid config ({count} error{'s' if count > 1 else ''}):\n  "
    return head + "\n  ".join(lines)


def _point_at_field(
    loc: tuple[str | int, ...], msg: str, data: Any
) -> tuple[tuple[str | int, ...], str]:
    """`payload: loanId: bad` becomes `payload.loanId: bad` when loanId is a key there.

    A whole-file check has no location of its own; its message starts with the dotted key it
    is about (`outboxes.x.broker: ...`), which is found in the file so that it gets a line.
    """
    node: Any = data
    for part in loc:
        node = _child(node, part)
    field, sep, rest = msg.partition(": ")
    if sep and isinstance(node, dict) and field in node:
        return (*loc, field), rest
    if sep and not loc and (path := _dotted(data, field)):
        return path, rest
    return loc, msg


def _dotted(node: Any, key: str) -> tuple[str | int, ...] | None:
    """The path of `key` (`outboxes.loans.v2.id`) in `node`; names may contain dots.

    A list's items are numbered (`messages.BookLent.1.id`).
    """
    if isinstance(node, list):
        head, _, rest_key = key.partition(".")
        if not head.isdigit() or int(head) >= len(node):
            return None
        if not rest_key:
            return (int(head),)
        rest = _dotted(node[int(head)], rest_key)
        return (int(head), *rest) if rest else None
    if not isinstance(node, dict):
        return None
    for name in sorted(node, key=len, reverse=True):
        if key == name:
            return (name,)
        if key.startswith(f"{name}.") and (rest := _dotted(node[name], key[len(name) + 1 :])):
            return (name, *rest)
    return None


_ABSENT = object()


def _child(node: Any, part: str | int) -> Any:
    if isinstance(node, dict) and part in node:
        return node[part]
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return _ABSENT


def _clean_loc(loc: tuple[str | int, ...], data: Any) -> tuple[str | int, ...]:
    """Drop pydantic's internal steps (union tags, `[key]`) that are not in the config."""
    out: list[str | int] = []
    node: Any = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        child = _child(node, part)
        if child is not _ABSENT:
            out.append(part)
            node = child
        elif isinstance(node, dict) and node.get("type") == part:
            continue  # the tag of a union chosen by `type` (a broker), not a key
        elif last and isinstance(node, dict) and not str(part).startswith("["):
            out.append(part)
        elif isinstance(part, str) and part.startswith("function-"):
            continue
    return tuple(out)
