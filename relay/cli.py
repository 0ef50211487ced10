"""The `relay` command. Exit codes: 0 success, 1 failure, 2 bad usage or bad config."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from relay import __version__
from relay.config import RelayConfig, load_config
from relay.errors import ConfigError, RelayError
from relay.logs import configure, redact

app = typer.Typer(
    name="relay",
    help="Publish a Postgres event table to brokers: gap-free, in order, at least once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", envvar="RELAY_CONFIG", help="YAML config file (or RELAY_CONFIG)."
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
T = TypeVar("T")


def _load(path: Path | None) -> RelayConfig:
    try:
        config = load_config(path)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    configure(config.logging.level, config.logging.format)
    return config


def _run(work: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine; a RelayError is a one-line message and exit 1 (2 for config)."""
    try:
        return asyncio.run(work())  # type: ignore[arg-type]
    except ConfigError as exc:
        typer.echo(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(2) from None
    except RelayError as exc:
        typer.echo(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(1) from None


@app.command()
def run(config: ConfigOption = None) -> None:
    """Relay every configured outbox until SIGTERM or SIGINT."""
    from relay.runner import Relay, install_signal_handlers

    cfg = _load(config)

    async def main() -> int:
        relay = Relay(cfg)
        install_signal_handlers(relay, asyncio.get_running_loop())
        return await relay.run()

    raise typer.Exit(_run(main))


@app.command()
def migrate(config: ConfigOption = None) -> None:
    """Create or upgrade the relay's own tables (idempotent)."""
    from relay.commands import migrate as do_migrate

    cfg = _load(config)
    applied = _run(lambda: do_migrate(cfg))
    schema = cfg.database.schema_
    if applied:
        typer.echo(f"schema {schema!r}: applied migration(s) {', '.join(map(str, applied))}")
    else:
        typer.echo(f"schema {schema!r}: up to date")


@app.command()
def check(
    config: ConfigOption = None,
    last: Annotated[int, typer.Option("--last", "-n", min=0, help="Events to preview.")] = 10,
    as_json: JsonOption = False,
) -> None:
    """Validate the config and the event table; show what the last events would become."""
    from relay.commands import preview

    cfg = _load(config)
    rows = _run(lambda: preview(cfg, last))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    typer.echo(f"config OK: {len(cfg.outboxes)} outbox(es), {len(cfg.brokers)} broker(s)")
    for row in rows:
        head = f"#{row['position']} {row['event']} [{row['outbox']}]"
        if row.get("skipped"):
            typer.echo(f"{head}: skipped ({row['skipped']})")
        elif row.get("error"):
            typer.echo(f"{head}: WOULD FAIL: {row['error']}")
        else:
            typer.echo(
                f"{head} -> {row['destination']} type={row['type']} id={row['id']} "
                f"key={row['key']}\n    {row['body']}"
            )


@app.command()
def status(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Who relays each outbox, how far behind it is, and what it waits for."""
    from relay.commands import status as read_status

    cfg = _load(config)
    rows = _run(lambda: read_status(cfg))
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    _table(
        rows,
        [
            "name",
            "state",
            "holder",
            "epoch",
            "checkpoint",
            "head",
            "lag_events",
            "lag_seconds",
            "parked",
            "last_error",
            "blocking_transaction",
        ],
    )


@app.command()
def version() -> None:
    """Print the relay's version."""
    typer.echo(__version__)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    typer.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - Ctrl-C outside `run`
        sys.exit(130)
