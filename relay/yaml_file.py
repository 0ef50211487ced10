"""Reading the YAML config file: line numbers for errors and `${VAR}` expansion.

ruamel.yaml keeps each key's line, so an error found later by pydantic can
still point at `relay.yaml:14`. Expansion happens on parsed scalars, never on
raw text, so a value can never inject YAML structure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from relay.errors import ConfigError

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


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


def load_yaml(path: Path, environ: Mapping[str, str] | None = None) -> YamlDocument:
    """Parse `path`, expand environment variables, and keep the line map."""
    env = os.environ if environ is None else environ
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    try:
        tree = YAML(typ="rt").load(text)
    except MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {exc.problem or exc}") from exc
    except YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if tree is None:
        tree = CommentedMap()
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    doc = YamlDocument(path=path, data={}, tree=tree)
    data = _expand(tree, (), doc, env)
    return YamlDocument(path=path, data=data, tree=tree)


def _expand(
    node: Any, loc: tuple[str | int, ...], doc: YamlDocument, env: Mapping[str, str]
) -> Any:
    if isinstance(node, Mapping):
        return {str(k): _expand(v, (*loc, str(k)), doc, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand(v, (*loc, i), doc, env) for i, v in enumerate(node)]
    if isinstance(node, str):
        return expand_vars(node, env, lambda name: _missing(name, loc, doc))
    return node


def _missing(name: str, loc: tuple[str | int, ...], doc: YamlDocument) -> ConfigError:
    key = ".".join(str(p) for p in loc)
    return ConfigError(
        f"{doc.where(loc)}: {key}: environment variable {name} is not set "
        f"(write ${{{name}:-default}} to give a default)"
    )


def expand_vars(text: str, env: Mapping[str, str], missing: Any) -> str:
    """Expand `${VAR}` and `${VAR:-default}`; `$$` is a literal dollar."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        value = env.get(name)
        if value is None or (value == "" and default is not None):
            if default is None:
                raise missing(name)
            return default
        return value

    return _VAR.sub(sub, text)
