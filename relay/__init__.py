"""Outbox Relay: publishes a Postgres event table to brokers, gap-free and in order."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("outbox-relay")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
