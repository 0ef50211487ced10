"""The statements of the relay's own tables in `database.schema`.

They are written once, by name, in `own_tables.sql` (procrastinate keeps its queries the same
way), in groups: `store` (checkpoints and parked messages), `partitions` (the partition set),
`commands`, `membership` and `lease` (advisory locks and heartbeats). `statements(group,
schema)` gives a group's statements by name, filled in for the configured schema. The few
whose text depends on a value, not a parameter, are built here: `move_parked` and
`lock_wait`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib.resources import files
from types import MappingProxyType
from typing import Any, Final

from relay.postgres.queries.reading import lane_expression
from relay.postgres.sql import (
    advisory_locks,
    held_keys,
    holds_lock,
    lane_key,
    lock_holder,
    quote,
)

NOTIFY: Final = "SELECT pg_notify($1, $2)"  # $1 channel, $2 payload
HOLDER_OF: Final = lock_holder("$1")  # the session holding lock $1: pid, application_name

_HEADER = re.compile(r"^-- ([a-z_]+\.[a-z_]+) --$", re.MULTILINE)


@cache
def statements(group: str, schema: str) -> Mapping[str, str]:
    """The statements of `group` in own_tables.sql by name, for the tables in `schema`: made
    once, read-only, shared by every lane's store, lease session and command queue."""
    prefix = group + "."
    chosen = {
        name.removeprefix(prefix): text
        for name, text in _filled(schema).items()
        if name.startswith(prefix)
    }
    if not chosen:
        raise ValueError(f"own_tables.sql has no statements of {group!r}")
    return MappingProxyType(chosen)


def of_outbox(column: str) -> str:
    """`column` names the outbox $1 or one of its lanes (`$1/<n>`), of whatever count.

    Not LIKE: an outbox name may hold `_`, which LIKE would take for any character.
    """
    return f"({column} = $1 OR left({column}, length($1) + 1) = $1 || '/')"


def readable(known: str) -> str:
    """The command row `c` is one this release can read: its kind is a key of `known` (JSON:
    each kind and the keys its args may hold), and its args, when an object, hold no other
    key. A newer release's kind or key is left to a replica that knows it; args of another
    shape are a mistake, taken and failed as bad args (relay.postgres.command_queue)."""
    keys = (
        "jsonb_object_keys(CASE jsonb_typeof(c.args) WHEN 'object' THEN c.args"
        " ELSE jsonb_build_object() END)"
    )
    return (
        f"({known}::jsonb ? c.kind AND NOT EXISTS (SELECT 1 FROM {keys} AS k"
        f" WHERE NOT ({known}::jsonb -> c.kind) ? k))"
    )


def move_parked(schema: str, count: int) -> str:
    """$1 outbox: the parked messages of its lanes, each to its aggregate's lane of `count`."""
    if count == 1:
        target = "$1"
    else:
        lane = lane_expression("aggregate_type", "aggregate_id", count)
        target = f"$1 || '/' || ({lane})::text"
    return f"UPDATE {quote(schema)}.parked SET outbox = {target} WHERE {of_outbox('outbox')}"


def lock_wait(seconds: float) -> str:
    """Bound each of this transaction's waits for a lock (a claim's, for a row)."""
    return f"SET LOCAL lock_timeout = {max(1, round(seconds * 1000))}"


@cache
def _named() -> Mapping[str, str]:
    """own_tables.sql's statements by `group.name`, as written (without their comments)."""
    text = files(__package__).joinpath("own_tables.sql").read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    named: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        if name in named:
            raise ValueError(f"own_tables.sql names {name} twice")
        named[name] = "\n".join(lines).strip().removesuffix(";")
    return MappingProxyType(named)


@cache
def _filled(schema: str) -> Mapping[str, str]:
    filler = _Filler(schema, _named())
    return MappingProxyType({name: filler.statement(name) for name in _named()})


def _cut(columns: str) -> str:
    """The text `columns`, each cut to $3 characters and an ellipsis (for a page)."""
    return ", ".join(
        f"left({c}, $3) || CASE WHEN length({c}) > $3 THEN '…' ELSE '' END AS {c}"
        for c in columns.split(", ")
    )


class _Filler(string.Formatter):
    """Fills in a statement's pieces (own_tables.sql's opening comment lists them)."""

    def __init__(self, schema: str, named: Mapping[str, str]) -> None:
        self._named = named
        self._done: dict[str, str] = {}
        self._pieces: dict[str, Callable[[str], str]] = {
            "schema": lambda _: quote(schema),
            "holds_lock": holds_lock,
            "of_outbox": of_outbox,
            "lane_key": lambda spec: lane_key(*spec.split(", ")),
            "advisory_locks": lambda _: advisory_locks(),
            "held_keys": lambda _: held_keys(),
            "cut": _cut,
            "readable": readable,
        }

    def statement(self, name: str) -> str:
        if name not in self._done:
            self._done[name] = self.format(self._named[name])
        return self._done[name]

    def get_field(
        self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Any, str]:
        if "." in field_name:
            return self.statement(field_name), field_name
        if field_name not in self._pieces:
            raise KeyError(f"own_tables.sql: no piece called {field_name}")
        return self._pieces[field_name], field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        return value if isinstance(value, str) else str(value(format_spec))
