"""own_tables.sql: every statement the relay runs on its own tables is named there once.

The code takes a group's statements by name (`self.queries["claim"]`); a name that is not in
the file, or a statement no code runs, would only show when that path runs. These tests read
the code itself and hold the two lists to each other.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import relay
from relay.postgres.queries import statements
from relay.postgres.queries.own_tables import move_parked

# One of the relay's tables, named without its schema.
_UNQUALIFIED = re.compile(
    r"\b(?:FROM|INTO|UPDATE|JOIN)\s+(?:checkpoints|parked|outboxes|commands|replicas|audits)\b"
)
GROUPS = ("store", "partitions", "commands", "membership", "lease", "audits")
ODD_SCHEMA = 'out"box'  # quoted as "out""box"


def _group(node: ast.AST) -> str | None:
    """ "store" of `statements("store", schema)`."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "statements":
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def _taken(node: ast.AST) -> str | None:
    """ "claim" of `self.queries["claim"]` (or of `statements(...)["claim"]`)."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Constant):
        return None
    whose = node.value
    if getattr(whose, "attr", None) == "queries" or _group(whose) is not None:
        return node.slice.value if isinstance(node.slice.value, str) else None
    return None


def _used() -> dict[str, set[str]]:
    """Per group, the names the relay's modules take from it."""
    used: dict[str, set[str]] = defaultdict(set)
    for path in Path(relay.__file__).parent.rglob("*.py"):
        nodes = list(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))
        groups = {group for node in nodes if (group := _group(node)) is not None}
        names = {name for node in nodes if (name := _taken(node)) is not None}
        assert len(groups) <= 1, f"{path} takes statements of {groups}: one group a module"
        for group in groups:
            used[group] |= names
    return used


def test_the_code_runs_every_statement_of_each_group_and_only_those() -> None:
    used = _used()
    assert set(used) == set(GROUPS)
    for group in GROUPS:
        assert used[group] == set(statements(group, "relay")), group


@pytest.mark.parametrize("group", GROUPS)
def test_every_statement_is_filled_in_for_the_schema(group: str) -> None:
    for name, text in statements(group, ODD_SCHEMA).items():
        assert "{" not in text.replace('{"error"', ""), f"{group}.{name}: {text}"
        assert "--" not in text, f"{group}.{name} kept a comment"
        assert not text.endswith(";"), f"{group}.{name}"
        unqualified = _UNQUALIFIED.search(text)
        assert unqualified is None, f"{group}.{name}: {unqualified} is not in the schema"
        assert '"out""box".' in text or group == "lease", f"{group}.{name}"


def test_a_group_not_in_the_file_is_refused() -> None:
    with pytest.raises(ValueError, match="no statements of 'stores'"):
        statements("stores", "relay")


def test_moving_parked_messages_names_the_schema_and_the_lane_count() -> None:
    assert move_parked(ODD_SCHEMA, 1).startswith('UPDATE "out""box".parked SET outbox = $1 ')
    assert "% 4) + 4) % 4)::text" in move_parked(ODD_SCHEMA, 4)
