"""`relay parked list | show | drop`: the operator's view of the messages set aside."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from relay.cli import common
from relay.cli.common import ConfigOption, JsonOption
from relay.cli.console import say, table
from relay.printable import printable

parked_app = typer.Typer(help="Inspect and drop parked messages.", no_args_is_help=True)


@parked_app.command("list")
def parked_list(
    outbox: Annotated[str, typer.Argument()],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Parked messages of OUTBOX, in position order."""
    from relay.fleet.parked import parked_list as read
    from relay.fleet.parked import summary

    cfg = common.load_config_or_exit(config)
    parked, notes = common.run_or_exit(lambda: read(cfg, outbox))
    for note in notes:
        say(note, err=True)
    rows = [summary(message) for message in parked]
    if as_json:
        say(common.pretty(rows))
        return
    for line in table(
        rows, ["id", "position", "event", "message_id", "reason", "attempts", "error"]
    ):
        say(line)


@parked_app.command("show")
def parked_show(
    id_: Annotated[int, typer.Argument(metavar="ID")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """One parked message, whole."""
    from relay.fleet.parked import parked_show as read
    from relay.fleet.parked import whole

    cfg = common.load_config_or_exit(config)
    row = whole(common.run_or_exit(lambda: read(cfg, id_)))
    if as_json:
        say(common.pretty(row))
        return
    for key, value in row.items():
        say(f"{key}: {printable(value)}")


@parked_app.command("drop")
def parked_drop(
    ids: Annotated[list[int] | None, typer.Argument(metavar="[ID]...")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Drop every parked message.")] = False,
    outbox: Annotated[str | None, typer.Option("--outbox", help="Only this outbox.")] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Drop --all without asking (needed off a terminal).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be dropped; drop nothing.")
    ] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete parked messages for good: by id, or --all (of --outbox, or of every outbox)."""
    from relay.fleet.parked import parked_drop as drop
    from relay.fleet.parked import parked_to_drop, summary

    common.ids_or_all(ids, all_, "parked message ids,")
    cfg = common.load_config_or_exit(config)
    if dry_run or (all_ and not yes):
        listed = common.run_or_exit(lambda: parked_to_drop(cfg, ids or None, outbox))
        going = [summary(p) for p in listed]
        if dry_run:
            if as_json:
                say(common.pretty({"dry_run": True, "would_drop": going}))
            else:
                say(f"dry run: {len(going)} parked message(s) would be dropped")
                for line in table(going, ["id", "outbox", "position", "event", "event_type"]):
                    say(line)
            return
        _confirm_drop(going, outbox)
    dropped = common.run_or_exit(lambda: drop(cfg, ids or None, outbox))
    if as_json:
        say(json.dumps({"dropped": dropped}))
        return
    say(f"dropped {len(dropped)} parked message(s): {', '.join(map(str, dropped)) or '-'}")
    if ids and len(dropped) < len(ids):
        missing = sorted(set(ids) - set(dropped))
        say(f"error: no parked message with id {', '.join(map(str, missing))}", err=True)
        raise typer.Exit(1)


def _confirm_drop(going: list[dict[str, Any]], outbox: str | None) -> None:
    """--all without --yes: ask on a terminal; refuse elsewhere (exit 2, nothing dropped)."""
    which = f"of {outbox}" if outbox else "of every outbox"
    if not sys.stdin.isatty():
        say(
            f"error: parked drop --all deletes {len(going)} parked message(s) {which} for good;"
            " off a terminal add --yes to confirm (--dry-run lists them); nothing was dropped",
            err=True,
        )
        raise typer.Exit(2)
    for line in table(going, ["id", "outbox", "position", "event", "event_type"]):
        say(line)
    if not typer.confirm(f"Drop these {len(going)} parked message(s) {which} for good?"):
        say("nothing was dropped", err=True)
        raise typer.Exit(1)
