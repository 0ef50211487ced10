"""`RELAY_*` environment variables over the file: each one sets the key it names.

A variable's value replaces that key's value in the file, whatever it is: a mapping is not
merged into the file's (`RELAY_OUTBOXES={}` means no outbox, not "no change"), and `null`
sets the key to null, which the models refuse unless null is allowed there. Variables that
name keys inside it then set those (shallower ones first). A key is matched to the file's
without regard to case, as the variable's name is read (`RELAY_OUTBOXES__LOANS__...` sets
the outbox written `Loans`). A variable whose first section is no section of the file is
not the relay's (`RELAY_CONFIG`) and is left alone.

pydantic-settings reads each value as the field's type asks (JSON for a list or a mapping),
one variable at a time. Merging is done here: pydantic-settings would drop a whole
section's `null` and merge a mapping into the file's, so that both were ignored in silence.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource
from pydantic_settings.exceptions import SettingsError
from pydantic_settings.sources.utils import parse_env_vars

PREFIX = "RELAY_"
NOT_JSON = (
    "a RELAY_* override of a list or a mapping must be JSON, for example "
    """RELAY_BROKERS__NATS__SERVERS='["nats://nats-1:4222"]' """
    "(see configuration.md, RELAY_* overrides)"
)


class NotJson(ValueError):
    """A variable whose value must be JSON and is not; names the variable, not its value."""

    def __init__(self, variable: str) -> None:
        super().__init__(f"{variable}: {NOT_JSON}")
        self.variable = variable


@dataclass(frozen=True)
class Overrides:
    """The config the models are given (`merged`), the file's part of it, and the key path
    each variable set there (as `merged` spells it), so that an error names its variable."""

    file: Mapping[str, Any]
    merged: dict[str, Any]
    paths: Mapping[str, tuple[str, ...]]

    def variables(self, loc: Sequence[str | int]) -> list[str]:
        """The variables behind the value at `loc`: the one that set it or a key above it;
        else those that made a key above it that the file does not have (a required key
        missing from an outbox an override made). None when the file alone is to blame."""
        wanted = tuple(loc)
        setters = [(len(p), n) for n, p in self.paths.items() if wanted[: len(p)] == p]
        if setters:
            return [max(setters)[1]]
        for depth in range(len(wanted), 0, -1):
            above = wanted[:depth]
            if _has(self.merged, above) and not _has(self.file, above):
                return sorted(n for n, p in self.paths.items() if p[:depth] == above)
        return []


def read_overrides(
    settings: type[BaseSettings], file: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> Overrides:
    """`file` with the `RELAY_*` variables of `environ` applied; raises NotJson."""
    env = os.environ if environ is None else environ
    sections = {name.lower(): name for name in settings.model_fields}
    found: list[tuple[int, str, tuple[str, ...], Any]] = []
    for name in sorted(env):
        if not name.upper().startswith(PREFIX):
            continue
        parts = name[len(PREFIX) :].lower().split("__")
        if parts[0] not in sections:
            continue
        keys, value = _read(settings, name, env[name], len(parts), sections[parts[0]])
        if keys:
            found.append((len(keys), name, keys, value))
    merged: dict[str, Any] = copy.deepcopy(dict(file)) if found else dict(file)
    paths: dict[str, tuple[str, ...]] = {}
    for _, name, keys, value in sorted(found, key=lambda f: (f[0], f[1])):
        paths[name] = _put(merged, keys, value)
    return Overrides(file, merged, paths)


class _OneVariable(EnvSettingsSource):
    """pydantic-settings' reading of one variable alone, not of the whole environment."""

    def __init__(self, settings: type[BaseSettings], name: str, value: str) -> None:
        self._one = {name: value}
        super().__init__(settings)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._one, self.case_sensitive, self.env_ignore_empty)


def _read(
    settings: type[BaseSettings], name: str, raw: str, depth: int, section: str
) -> tuple[tuple[str, ...], Any]:
    """The key path a variable names (as pydantic-settings spells it) and its value."""
    try:
        data: Any = _OneVariable(settings, name, raw)()
    except SettingsError:
        raise NotJson(name) from None
    if not data and depth == 1:
        return (section,), None  # a whole section's `null`: pydantic-settings drops it
    keys: list[str] = []
    while len(keys) < depth and isinstance(data, dict) and len(data) == 1:
        ((key, data),) = data.items()
        keys.append(key)
    if len(keys) < depth:
        return (), None  # nothing pydantic-settings reads as a key of the config
    return tuple(keys), data


def _put(root: dict[str, Any], keys: tuple[str, ...], value: Any) -> tuple[str, ...]:
    """Set `value` at `keys` in `root`, each key matched to an existing one without regard to
    case; the path it was set at."""
    node = root
    path: list[str] = []
    for i, key in enumerate(keys):
        same = [k for k in node if isinstance(k, str) and k.lower() == key.lower()]
        chosen = key if key in node or len(same) != 1 else same[0]
        path.append(chosen)
        if i == len(keys) - 1:
            node[chosen] = value
        else:
            if not isinstance(node.get(chosen), dict):
                node[chosen] = {}
            node = node[chosen]
    return tuple(path)


def _has(node: Any, path: Sequence[str | int]) -> bool:
    """Whether the mappings hold `path` (a variable only ever sets a mapping's key)."""
    for part in path:
        if not (isinstance(node, dict) and part in node):
            return False
        node = node[part]
    return True
