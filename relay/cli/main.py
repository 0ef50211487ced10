"""The `relay` command. Exit codes: 0 success, 1 failure, 2 bad usage or bad config."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from relay import __version__
from relay.cli.audit import register as register_audit
from relay.cli.common import (
    ConfigOption,
    FromStartOption,
    FromTimeOption,
    JsonOption,
    ids_or_all,
    in_utc,
    load_config_or_exit,
    pretty,
    run_or_exit,
)
from relay.cli.console import progress_view, say, table
from relay.cli.contract import contract_app
from relay.cli.parked import parked_app
from relay.config import RelayConfig, config_path
from relay.printable import printable
from relay.redaction import redact
from relay.runtime.logs import configure

app = typer.Typer(
    name="relay",
    help="Publish a Postgres event table to brokers: gap-free, in order, at least once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def run(
    config: ConfigOption = None,
    http_port: Annotated[
        int | None,
        typer.Option("--http-port", min=0, max=65535, help="Overrides http.port (0: any free)."),
    ] = None,
) -> None:
    """Relay every configured outbox until SIGTERM or SIGINT."""
    from relay.runtime.runner import Relay, install_signal_handlers

    cfg = load_config_or_exit(config)

    async def main() -> int:
        relay = Relay(cfg, http_port=http_port, config_file=str(config_path(config)))
        install_signal_handlers(relay, asyncio.get_running_loop())
        return await relay.run()

    raise typer.Exit(run_or_exit(main))


@app.command()
def migrate(config: ConfigOption = None) -> None:
    """Create or upgrade the relay's own tables (idempotent)."""
    from relay.fleet.identity import identity
    from relay.postgres.database import Database
    from relay.postgres.migrations import migrate_database

    cfg = load_config_or_exit(config)
    db = Database.of(cfg, identity())
    done = run_or_exit(lambda: migrate_database(db, cfg, lambda text: say(text, err=True)))
    schema = cfg.database.schema_
    if done.applied:
        say(f"schema {schema!r}: applied migration(s) {', '.join(map(str, done.applied))}")
    else:
        say(f"schema {schema!r}: up to date")
    trigger = f"relay_notify_{cfg.source.notify_channel}"
    say(f"NOTIFY trigger {trigger} on {cfg.source.table}: {done.trigger}")


@app.command()
def check(
    config: ConfigOption = None,
    last: Annotated[
        int | None, typer.Option("--last", "-n", min=0, help="Events to preview (10).")
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Do not connect to the brokers.")
    ] = False,
    as_json: JsonOption = False,
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            help="Map every stored event of the range as relay run would; exit 1 if any"
            " would be parked or share an id.",
        ),
    ] = False,
    from_position: Annotated[
        int | None, typer.Option("--from", min=1, help="--history from this position.")
    ] = None,
    from_start: FromStartOption = False,
    from_time: FromTimeOption = None,
    to: Annotated[
        int | None, typer.Option("--to", min=1, help="--history up to this position.")
    ] = None,
) -> None:
    """Check the config, the database rights, the event table and the brokers; show what
    the last events would become (with --history: every event of a range). Publishes
    nothing."""
    from relay.cli.check import run_check

    if history or from_position is not None or from_start or from_time is not None or to:
        if last is not None:
            say(
                "error: --last previews the newest events; --history walks a range (--from,"
                " --from-start, --from-time, --to): give one or the other",
                err=True,
            )
            raise typer.Exit(2)
        _history(config, as_json, offline, (from_position, from_start, in_utc(from_time), to))
        return
    cfg = load_config_or_exit(config)
    report = run_or_exit(lambda: run_check(cfg, 10 if last is None else last, offline=offline))
    for warning in report.warnings:
        say(f"warning: {redact(warning)}", err=True)
    for problem in report.problems:
        say(f"error: {redact(problem)}", err=True)
    if as_json:
        say(json.dumps(report.rows, indent=2, default=str))
    else:
        for note in report.notes:
            say(f"note: {note}", err=True)
        if not report.problems:
            say(f"config OK: {len(cfg.outboxes)} outbox(es), {len(cfg.brokers)} broker(s)")
        _preview(report.rows)
    if report.problems:
        raise typer.Exit(1)


def _history(
    config: Path | None,
    as_json: bool,
    offline: bool,
    range_: tuple[int | None, bool, datetime | None, int | None],
) -> None:
    """`relay check --history`: relay/cli/history.py."""
    from relay.cli.history import HistoryRange, run_history, say_history

    if sum([range_[0] is not None, range_[1], range_[2] is not None]) > 1:
        say("error: give at most one of --from, --from-start, --from-time", err=True)
        raise typer.Exit(2)
    cfg = load_config_or_exit(config)
    result = run_or_exit(lambda: run_history(cfg, HistoryRange(*range_), offline=offline))
    if as_json:
        say(pretty(result))
    else:
        say_history(result)
    if not result["ok"]:
        raise typer.Exit(1)


def _preview(rows: list[dict[str, Any]]) -> None:
    """What `relay check` makes of the last events: every value from the event, printable."""
    for found in rows:
        row = {key: printable(value) for key, value in found.items()}
        head = f"#{row['position']} {row['event']} [{row['outbox']}]"
        if found.get("rule"):
            head += f" ({row['rule']})"
        if found.get("skipped"):
            say(f"{head}: skipped ({row['skipped']})")
        elif found.get("violations"):
            say(f"{head}: would be parked (schema), {len(found['violations'])} violation(s):")
            for violation in found["violations"]:
                say(f"    {printable(violation)}")
        elif found.get("error"):
            say(f"{head}: would be parked ({row['parked']}): {row['error']}")
        else:
            say(
                f"{head} -> {row['destination']} type={row['type']} id={row['id']} "
                f"key={row['key']}\n    {row['body']}"
            )


@app.command()
def status(
    config: ConfigOption = None,
    as_json: JsonOption = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="Show long values (last_error) whole.")
    ] = False,
    watch: Annotated[
        bool,
        typer.Option("--watch", "-w", help="Refresh every second until Ctrl-C."),
    ] = False,
) -> None:
    """Who relays each outbox, how far behind it is, and what it waits for."""
    from relay.fleet.status import status as read_status

    cfg = load_config_or_exit(config)
    if not watch:
        _show_status(cfg, run_or_exit(lambda: read_status(cfg)), as_json=as_json, wide=wide)
        return
    terminal = sys.stdout.isatty()

    async def refresh() -> None:
        from relay.postgres.database import DatabaseUnavailable

        while True:
            try:
                lanes, down = await read_status(cfg), None
            except DatabaseUnavailable as exc:  # a restart or a failover: shown, and waited out
                lanes, down = [], redact(str(exc))
            if terminal:
                typer.echo("\x1b[H\x1b[2J", nl=False)  # clear, then draw from the top
            elif not as_json:
                say(f"-- {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC")
            if down is None:
                _show_status(cfg, lanes, as_json=as_json, wide=wide, compact=True)
            else:  # stdout keeps one JSON array per refresh
                say(f"database unreachable: {down}", err=as_json)
            await asyncio.sleep(1.0)

    try:
        run_or_exit(refresh)
    except KeyboardInterrupt:
        return  # Ctrl-C is how --watch ends: a success


def _show_status(
    cfg: RelayConfig, lanes: list[Any], *, as_json: bool, wide: bool, compact: bool = False
) -> None:
    """The status table (or JSON: every field whole); a hint when a value was cut short."""
    from relay.cli.console import cut
    from relay.fleet.status import TABLE_COLUMNS, summary

    rows = [row.as_json() for row in lanes]
    if as_json:
        say(json.dumps(rows, default=str) if compact else pretty(rows))
        return
    for line in [*summary(cfg, lanes), *table(rows, TABLE_COLUMNS, wide=wide)]:
        say(line)
    if not wide and cut(rows, "last_error"):
        say("(last_error cut short: --wide shows it whole, and so does --json)")


TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout",
        min=0.1,
        help="Seconds to wait for the lease holder to act (with --wait: to take the command,"
        " or to come back when no replica holds the lease).",
    ),
]
FollowOption = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="Show progress until the work is done; with --json, one JSON object a line,"
        " the result last.",
    ),
]


@app.command()
def replay(
    outbox: Annotated[str, typer.Argument(help="The outbox to replay.")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
    from_position: Annotated[
        int | None, typer.Option("--from", min=1, help="Publish again from this position.")
    ] = None,
    from_start: FromStartOption = False,
    from_time: FromTimeOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only count the events.")] = False,
    timeout: TimeoutOption = 30.0,
    follow: FollowOption = False,
) -> None:
    """Move the checkpoint back so events are published again (same ids: consumers dedup)."""
    from relay.cli.operator import Operator, ReplayFrom
    from relay.cli.progress import follow_replay
    from relay.fleet.identity import identity
    from relay.fleet.recorded import as_recorded
    from relay.postgres.command_queue import CommandKind, ReplayArgs

    chosen = [from_position is not None, from_start, from_time is not None]
    if sum(chosen) != 1:
        say("error: give exactly one of --from, --from-start, --from-time", err=True)
        raise typer.Exit(2)
    cfg = load_config_or_exit(config)
    spec = ReplayFrom(position=from_position, start=from_start, time=in_utc(from_time))
    follow = follow and not dry_run
    view = progress_view(f"replay {outbox}", "events", as_json)

    async def work() -> dict[str, Any]:
        recorded = await on_recorded_partitions(cfg, outbox)
        controller = Operator(recorded, outbox, identity())
        target, current = await controller.replay_target(spec)
        result: dict[str, Any] = {
            "outbox": outbox,
            "from_position": target + 1,
            "checkpoint": current,
            "events": 0,
            "dry_run": dry_run,
        }
        if dry_run:
            result["events"] = await controller.count(target, current)
        else:
            head = await controller.head()
            outcome = await controller.run(
                CommandKind.REPLAY, ReplayArgs(to=target).as_row(), timeout, patient=follow
            )
            # What the lanes did, not what they held when it was asked (another command may
            # have moved them since); refused if that made it a replay forwards.
            done = await controller.replayed(target, outcome)
            result.update(
                checkpoint=current if done.checkpoint is None else done.checkpoint,
                events=done.events,
                ok=outcome.ok,
                executed_by=outcome.executed_by,
                direct=outcome.direct,
                detail=outcome.detail,
            )
            if follow and outcome.ok:
                now, _ = await as_recorded(cfg, [outbox])  # its lanes may have changed since
                wait = follow_replay(now, outbox, head, outcome.detail, view=view, unheld=timeout)
                result.update(await wait)
        return result

    result = run_or_exit(work)
    if as_json:
        say(json.dumps(result, default=str) if follow else pretty(result))
    elif dry_run:
        say(
            f"dry run: {result['events']} event(s) of {outbox} would be published again "
            f"(positions {result['from_position']}..{result['checkpoint']})"
        )
    else:
        _say_outcome(
            result,
            f"replay of {outbox} from position {result['from_position']}: "
            f"{result['events']} event(s) will be published again",
        )
        if result.get("caught_up"):
            say(
                f"{outbox} caught up with position {result['head']}:"
                f" {result['progress']['done']} event(s) published"
            )
    if not dry_run and not result["ok"]:
        raise typer.Exit(1)
    if result.get("wait_error"):
        say(f"error: {result['wait_error']}", err=True)
        raise typer.Exit(1)


@app.command("retry-parked")
def retry_parked(
    outbox: Annotated[str, typer.Argument(help="The outbox whose parked messages to retry.")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
    ids: Annotated[list[int] | None, typer.Option("--id", help="A parked message id.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Every parked message.")] = False,
    timeout: TimeoutOption = 30.0,
    follow: FollowOption = False,
) -> None:
    """Map parked messages again with the current config and publish them, in batches."""
    from relay.cli.operator import Operator
    from relay.cli.progress import follow_retry
    from relay.fleet.identity import identity
    from relay.postgres.command_queue import CommandKind, RetryParkedArgs

    ids_or_all(ids, all_, "--id ID (repeatable)")
    cfg = load_config_or_exit(config)
    view = progress_view(f"retry-parked {outbox}", "messages", as_json)

    async def work() -> dict[str, Any]:
        recorded = await on_recorded_partitions(cfg, outbox)
        command = functools.partial(
            Operator(recorded, outbox, identity()).run,
            CommandKind.RETRY_PARKED,
            RetryParkedArgs(ids=ids or None).as_row(),
            timeout,
            patient=follow,
        )
        extra: dict[str, Any] = {}
        if follow:
            outcome, done = await follow_retry(recorded, outbox, ids or None, view, command)
            extra["progress"] = done.as_json()
        else:
            outcome = await command()
        return {
            "outbox": outbox,
            "ok": outcome.ok,
            "executed_by": outcome.executed_by,
            "direct": outcome.direct,
            "detail": outcome.detail,
            **extra,
        }

    result = run_or_exit(work)
    detail = result["detail"] or {}
    if as_json:
        say(json.dumps(result, default=str) if follow else pretty(result))
    else:
        _say_outcome(
            result,
            f"retry-parked {outbox}: {len(detail.get('published', []))} "
            f"published, {len(detail.get('still_parked', {}))} still parked",
        )
        for item in detail.get("outcomes", []):
            said = item["outcome"] + (f": {item['error']}" if item["error"] else "")
            rule = f" ({item['rule']})" if item.get("rule") else ""
            said = printable(
                f"#{item['id']} position {item['position']} {item['event']}{rule}: {said}"
            )
            say(f"  {said}")
    if detail.get("not_found"):
        ids_text = ", ".join(map(str, detail["not_found"]))
        say(f"error: no parked message of {outbox} with id {ids_text}", err=True)
    if not result["ok"] or detail.get("still_parked") or detail.get("not_found"):
        raise typer.Exit(1)


async def on_recorded_partitions(cfg: RelayConfig, outbox: str | None) -> RelayConfig:
    """The config with the outbox's partitions as it runs (relay/fleet/recorded.py), saying so
    on stderr when this config's count differs."""
    from relay.fleet.recorded import as_recorded

    recorded, notes = await as_recorded(cfg, None if outbox is None else [outbox])
    for note in notes:
        say(note, err=True)
    return recorded


def _say_outcome(result: dict[str, Any], text: str) -> None:
    who = "this command (no replica held the lease)" if result["direct"] else result["executed_by"]
    if result["ok"]:
        say(f"{text}; carried out by {who}")
    else:
        say(f"failed, carried out by {who}: {result['detail']}", err=True)


@app.command()
def repartition(
    outbox: Annotated[str, typer.Argument(help="The outbox to split into a new number of lanes.")],
    partitions: Annotated[
        int, typer.Option("--partitions", min=1, max=1024, help="The new number of lanes.")
    ],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change an outbox's partitions, with its replicas stopped: nothing lost or sent twice."""
    from relay.fleet.repartition import repartition as do_repartition

    cfg = load_config_or_exit(config)
    done = run_or_exit(lambda: do_repartition(cfg, outbox, partitions))
    if as_json:
        say(json.dumps(dataclasses.asdict(done)))
        return
    if done.before == done.after:
        say(f"{outbox} already has {done.after} partition(s): nothing changed")
    else:
        say(
            f"{outbox}: {done.before} -> {done.after} partition(s); every lane starts after"
            f" position {done.start} and skips the {done.skipped} event(s) after it that the"
            f" old lanes had published; {done.resent} event(s) already published will be sent"
            f" again; {done.parked_moved} parked message(s) moved to their new lanes"
        )
    if cfg.outboxes[outbox].partitions != partitions:
        say(
            f"now set outboxes.{outbox}.partitions to {partitions} in the config before the"
            f" replicas start again: replicas with another count wait, and say so",
            err=True,
        )


register_audit(app)
app.add_typer(parked_app, name="parked")
app.add_typer(contract_app, name="contract")


@app.command()
def demo(
    database_url: Annotated[
        str | None,
        typer.Option("--database-url", envvar="DATABASE_URL", help="Use this Postgres."),
    ] = None,
    nats_url: Annotated[
        str | None, typer.Option("--nats-url", envvar="NATS_URL", help="Use this NATS server.")
    ] = None,
) -> None:
    """The whole product in under a minute, on embedded Postgres and NATS."""
    from relay.demo.tour import run_demo

    configure("warning", "console")
    raise typer.Exit(run_or_exit(lambda: run_demo(database_url, nats_url)))


@app.command("config-schema")
def config_schema() -> None:
    """Print the config file's JSON Schema (for editors; the Helm chart embeds it)."""
    from relay.config.config_schema import config_schema as schema
    from relay.config.config_schema import render

    say(render(schema()), nl=False)


@app.command()
def version() -> None:
    """Print the relay's version."""
    say(__version__)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - Ctrl-C outside `run`
        sys.exit(130)
