"""`relay contract`: the AsyncAPI document of the config, and `relay contract diff` between two.

The document is built in relay/asyncapi/; the comparison in relay/asyncapi/diff.py. This module
reads the two sides (documents, or configs made into documents as `relay contract` makes
them), prints the changes, and sets the exit code: 0 nothing breaking or unknown, 1 something
is, 2 a file that cannot be read as either.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from relay.cli.common import ConfigOption, JsonOption, load_config_or_exit
from relay.cli.console import say
from relay.config import config_path
from relay.errors import ConfigError, ContractError
from relay.redaction import redact

if TYPE_CHECKING:
    from relay.asyncapi.diff import Change

contract_app = typer.Typer(
    help="Write an AsyncAPI 3.0 document of the integration events the config publishes.",
    invoke_without_command=True,
    no_args_is_help=False,
)


class ContractFormat(StrEnum):
    yaml = "yaml"
    json = "json"


@contract_app.callback()
def contract(
    ctx: typer.Context,
    config: ConfigOption = None,
    format_: Annotated[
        ContractFormat, typer.Option("--format", "-f", help="yaml or json.")
    ] = ContractFormat.yaml,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to FILE instead of stdout.")
    ] = None,
    title: Annotated[str, typer.Option("--title", help="info.title of the document.")] = (
        "Integration events"
    ),
    api_version: Annotated[
        str, typer.Option("--api-version", help="info.version of the document.")
    ] = "1.0.0",
) -> None:
    """Write an AsyncAPI 3.0 document of the integration events the config publishes;
    `relay contract diff OLD NEW` says what a change does to consumers."""
    if ctx.invoked_subcommand is not None:
        return
    from relay.asyncapi import contract_document, render

    cfg = load_config_or_exit(config)
    document = contract_document(cfg, config_path(config), title=title, version=api_version)
    text = render(document, format_.value)
    if output is None:
        say(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        say(f"error: cannot write {output}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None
    say(f"wrote {output}", err=True)


@contract_app.command("diff")
def diff(
    old: Annotated[Path, typer.Argument(help="The contract consumers were written against.")],
    new: Annotated[Path, typer.Argument(help="The contract to publish.")],
    as_json: JsonOption = False,
) -> None:
    """What NEW does to a consumer written against OLD: each change breaking, compatible, new
    or unknown. Each side is a document `relay contract` wrote, or a config. Exit code 1 when
    a change is breaking or unknown."""
    from relay.asyncapi.diff import diff as compare

    try:
        changes = compare(read_side(old), read_side(new))
    except ContractError as exc:
        say(f"error: {redact(str(exc))}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        say(json.dumps([change.as_json() for change in changes], indent=2, ensure_ascii=False))
    else:
        for line in report(changes):
            say(line)
    if any(change.verdict in ("breaking", "unknown") for change in changes):
        raise typer.Exit(1)


def read_side(path: Path) -> dict[str, Any]:
    """The contract in a file: the document itself, or the one `relay contract` makes of a
    config. Told apart by content: a document has an `asyncapi` key."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ContractError(
            f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        data = YAML(typ="safe", pure=True).load(text)
    except YAMLError as exc:
        raise ContractError(
            f"{path} is not valid YAML or JSON: {' '.join(str(exc).split())}"
        ) from None
    if isinstance(data, dict) and "asyncapi" in data:
        if not str(data["asyncapi"]).startswith("3."):
            raise ContractError(
                f"{path}: asyncapi: {data['asyncapi']!r}; only AsyncAPI 3 documents, as"
                " `relay contract` writes them, are compared"
            )
        return _checked(path, data)
    if not isinstance(data, dict) or not {"outboxes", "brokers"} & data.keys():
        raise ContractError(
            f"{path} is neither a contract (no `asyncapi` key) nor a relay config"
            " (no `brokers` or `outboxes`)"
        )
    from relay.asyncapi import contract_document
    from relay.config import load_config

    try:
        config = load_config(path)
    except ConfigError as exc:
        raise ContractError(str(exc)) from None
    return contract_document(config, path)


def _checked(path: Path, document: dict[str, Any]) -> dict[str, Any]:
    """A document whose structure the comparison can walk; errors name the file."""
    from relay.asyncapi.diff import deliveries

    try:
        deliveries(document)
    except ContractError as exc:
        raise ContractError(f"{path}: {exc}") from None
    return document


def report(changes: list[Change]) -> list[str]:
    """One line per change, then the count of each verdict."""
    if not changes:
        return ["no changes: every message of OLD reaches its consumers as before"]
    lines = []
    for change in changes:
        where = f" on {change.channel}" if change.channel else ""
        lines.append(f"{change.verdict}: {change.message}{where} at {change.path}: {change.why}")
    counts = {v: sum(c.verdict == v for c in changes) for v in ("breaking", "unknown")}
    counts |= {v: sum(c.verdict == v for c in changes) for v in ("compatible", "new")}
    lines.append(", ".join(f"{n} {verdict}" for verdict, n in counts.items() if n))
    return lines
