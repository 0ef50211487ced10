"""What every `relay` command shares: its options, loading the config, the error boundary."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import structlog
import typer

from relay.cli.console import say
from relay.config import RelayConfig, load_config
from relay.errors import ConfigError, RelayError, UsageError
from relay.redaction import redact
from relay.runtime.logs import configure

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", envvar="RELAY_CONFIG", help="YAML config file (or RELAY_CONFIG)."
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
FromStartOption = Annotated[bool, typer.Option("--from-start", help="From the first event.")]
FromTimeOption = Annotated[
    datetime | None,
    typer.Option("--from-time", help="From the first event written at or after this time."),
]
T = TypeVar("T")


def load_config_or_exit(path: Path | None) -> RelayConfig:
    try:
        config = load_config(path)
    except ConfigError as exc:
        say(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(2) from None
    configure(config.logging.level, config.logging.format)
    return config


def run_or_exit(work: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; a RelayError is a one-line message and exit 1 (2 for config)."""
    try:
        return asyncio.run(work())  # type: ignore[arg-type]
    except (ConfigError, UsageError) as exc:
        say(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(2) from None
    except RelayError as exc:
        say(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # noqa: BLE001 - the boundary: one line, never a traceback
        say(f"error: {redact(cause(exc))}", err=True)
        structlog.get_logger("relay.cli").debug("the error's traceback", exc_info=exc)
        raise typer.Exit(1) from None


def in_utc(when: datetime | None) -> datetime | None:
    """A time given without a zone is UTC (the database clock's zone in the docs)."""
    return when.replace(tzinfo=UTC) if when is not None and when.tzinfo is None else when


def cause(exc: BaseException) -> str:
    """A driver's or a library's error in one line that names it."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, RelayError):
        return str(exc)
    library = type(exc).__module__.partition(".")[0]
    if library == "asyncpg":
        from relay.postgres.database import describe

        return describe(exc)
    if isinstance(exc, OSError | TimeoutError):
        return f"cannot connect: {exc or type(exc).__name__}"
    origin = "" if library == "builtins" else f"{library} "
    return f"{origin}{type(exc).__name__}: {exc} (set logging.level to debug for the traceback)"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)


def ids_or_all(ids: list[int] | None, all_: bool, what: str) -> None:
    """Exactly one of the two, or a usage error (exit 2)."""
    if bool(ids) == all_:
        say(f"error: give {what} or --all", err=True)
        raise typer.Exit(2)
