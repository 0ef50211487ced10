"""Quoting identifiers that come from the config (table, column, schema names)."""

from __future__ import annotations


def quote(identifier: str) -> str:
    """Quote one identifier; the config already restricts names to safe characters."""
    return '"' + identifier.replace('"', '""') + '"'


def qualified(name: str) -> str:
    """Quote `table` or `schema.table`."""
    return ".".join(quote(part) for part in name.split("."))
