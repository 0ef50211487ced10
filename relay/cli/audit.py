"""`relay audit`: read the broker back and find every message that is not there.

The audit itself is relay/fleet/audit.py. This module is the command: the range options,
the report as text or JSON, and `--repair`, which parks each missing message (reason
`missing`) and has it published again, with its id, by retry-parked, carried out by its
lane's holder or by the CLI under the lease when no replica holds it, as `relay
retry-parked` is; then it audits the range again. A broker that drops a re-sent id
within a duplicate window (JetStream) may drop the repair too: the second audit shows
it, and the command waits the window out when `--timeout` allows, or says so.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from relay.cli.common import (
    ConfigOption,
    FromStartOption,
    FromTimeOption,
    JsonOption,
    in_utc,
    load_config_or_exit,
    pretty,
    run_or_exit,
)
from relay.cli.console import ProgressView, say
from relay.config import RelayConfig
from relay.printable import printable

if TYPE_CHECKING:
    from relay.core.audit import Finding
    from relay.core.readback import Reader
    from relay.fleet.audit import Auditor, AuditRange, AuditReport
    from relay.postgres.database import Database

NICENESS = 10  # added to the command's own: a lower CPU priority than the relay's
REPAIR_AT_MOST = 100_000  # missing messages one `--repair` puts back; more: `relay replay`


def audit(
    outbox: Annotated[str, typer.Argument(help="The outbox to audit.")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
    from_position: Annotated[
        int | None, typer.Option("--from", min=1, help="Audit from this position.")
    ] = None,
    from_start: FromStartOption = False,
    from_time: FromTimeOption = None,
    last: Annotated[
        int | None,
        typer.Option("--last", min=1, help="The last N events the outbox maps (default 1000)."),
    ] = None,
    to: Annotated[
        int | None,
        typer.Option("--to", min=1, help="Up to this position (default: the checkpoint)."),
    ] = None,
    repair: Annotated[
        bool,
        typer.Option("--repair", help="Publish the missing messages again, then audit again."),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=0.0,
            help="Seconds a repair waits for the lease holder to act, and at most for a"
            " broker's duplicate window to pass before it repairs again.",
        ),
    ] = 30.0,
) -> None:
    """Read the broker back and report every message the relay published that it does not
    hold (exit 1), with its position, id and destination. Publishes nothing unless --repair."""
    chosen = [from_position is not None, from_start, from_time is not None, last is not None]
    if sum(chosen) > 1:
        say("error: give at most one of --from, --from-start, --from-time, --last", err=True)
        raise typer.Exit(2)
    cfg = load_config_or_exit(config)
    from relay.fleet.audit import AuditRange as Range

    # An audit is a background check: on a machine it shares with a relay (or Postgres,
    # or the broker), it yields the CPU to them.
    os.nice(NICENESS)

    asked = Range(from_position, from_start, in_utc(from_time), last, to)
    view = None if as_json or not sys.stderr.isatty() else _bar(outbox)
    result = run_or_exit(lambda: _work(cfg, outbox, asked, repair, timeout, view))
    if view is not None:
        view.close()
    if as_json:
        say(pretty(result))
    else:
        _say_report(result)
        if "repair" in result:
            _say_repair(result["repair"])
            say("after the repair:")
            _say_report(result["after_repair"])
    final = result.get("after_repair", result)
    if final["missing_count"]:
        raise typer.Exit(1)


def _bar(outbox: str) -> ProgressView:
    return ProgressView(f"audit {outbox}", "events", "bar", sys.stderr)


async def _work(
    cfg: RelayConfig,
    outbox: str,
    asked: AuditRange,
    repair: bool,
    wait: float,
    view: ProgressView | None,
) -> dict[str, Any]:
    from relay.brokers import create_prober, create_reader
    from relay.fleet.audit import Auditor
    from relay.fleet.identity import identity
    from relay.postgres.database import Database
    from relay.postgres.migrations import ensure_migrated

    box = cfg.outbox(outbox)  # an unknown outbox: a ConfigError, exit 2
    broker = cfg.brokers[box.broker]
    reader = create_reader(box.broker, broker)
    listed = REPAIR_AT_MOST if repair else 1_000
    refusal = create_prober(box.broker, broker).refusal
    auditor = Auditor(
        cfg, outbox, reader, listed=listed, skew=box.audit.clock_skew, refusal=refusal
    )
    db = Database.of(cfg, identity())
    await reader.connect()
    try:
        async with db.one_shot("cli") as conn:
            await ensure_migrated(conn, cfg.database.schema_)
            running = await auditor.outbox_as_it_runs(conn)
            after, upto = await auditor.resolve(conn, asked, running)
            progress = view.show if view else None
            report = await auditor.audit(conn, after, upto, running, on_progress=progress)
        result: dict[str, Any] = report.as_json()
        if not repair or not report.missing:
            return result
        if report.missing > REPAIR_AT_MOST:
            result["repair"] = {
                "ok": False,
                "error": f"{report.missing} messages are missing, more than --repair puts back"
                f" at once ({REPAIR_AT_MOST}): replay the range (`relay replay {outbox}"
                f" --from {after + 1}`)",
            }
            result["after_repair"] = result.copy()
            return result
        deadline = time.monotonic() + wait
        first_repair = time.monotonic()
        repaired = await _repair(cfg, auditor, db, report.tally.missing, wait)
        again = await _audit_again(auditor, db, after, upto)
        window = await _window(reader, again)
        if again.missing and window is not None:
            wait_until = first_repair + window + 1.0
            if wait_until <= deadline:
                repaired["waited_for_duplicate_window"] = window
                await asyncio.sleep(max(wait_until - time.monotonic(), 0.0))
                second = await _repair(cfg, auditor, db, again.tally.missing, wait)
                repaired["published"] += second["published"]
                repaired["still_parked"].update(second["still_parked"])
                again = await _audit_again(auditor, db, after, upto)
            else:
                repaired["duplicate_window"] = window
                repaired["note"] = (
                    f"the broker drops a re-sent id for {window:g}s (its duplicate window), even"
                    " of a message it no longer holds: run `relay audit --repair` again once"
                    f" {window:g}s have passed since this repair, or give --timeout {window + 5:g}"
                )
        result["repair"] = repaired
        result["after_repair"] = again.as_json()
        return result
    finally:
        await reader.close()


async def _repair(
    cfg: RelayConfig, auditor: Auditor, db: Database, missing: list[Finding], wait: float
) -> dict[str, Any]:
    """Park the missing messages, and have retry-parked publish them again."""
    from relay.cli.operator import CommandTimeout, Operator
    from relay.fleet.identity import identity
    from relay.fleet.recorded import as_recorded
    from relay.postgres.command_queue import CommandKind, RetryParkedArgs

    async with db.one_shot("cli") as conn:
        by_lane = await auditor.park_missing(conn, missing)
    ids = sorted(i for lane_ids in by_lane.values() for i in lane_ids)
    recorded, _ = await as_recorded(cfg, [auditor.outbox])
    try:
        outcome = await Operator(recorded, auditor.outbox, identity()).run(
            CommandKind.RETRY_PARKED, RetryParkedArgs(ids=ids).as_row(), wait
        )
    except CommandTimeout as exc:
        # The messages are parked (reason `missing`): the next audit still counts them
        # missing, and `relay retry-parked` (or the holder, later) publishes them.
        return {
            "ok": False,
            "parked_ids": ids,
            "published": [],
            "still_parked": {},
            "error": f"{exc}; the {len(ids)} missing message(s) stay parked with reason"
            f" `missing` (relay parked list {auditor.outbox}), for relay retry-parked",
        }
    detail = outcome.detail or {}
    return {
        "ok": outcome.ok,
        "parked_ids": ids,
        "executed_by": outcome.executed_by,
        "direct": outcome.direct,
        "published": list(detail.get("published", [])),
        "still_parked": dict(detail.get("still_parked", {})),
    }


async def _audit_again(auditor: Auditor, db: Database, after: int, upto: int) -> AuditReport:
    async with db.one_shot("cli") as conn:
        running = await auditor.outbox_as_it_runs(conn)
        return await auditor.audit(conn, after, upto, running)


async def _window(reader: Reader, report: AuditReport) -> float | None:
    """The longest duplicate window of the destinations still missing messages."""
    windows = [
        w
        for destination in {f.destination for f in report.tally.missing}
        if (w := await reader.duplicate_window(destination)) is not None
    ]
    return max(windows, default=None)


def _say_report(result: dict[str, Any]) -> None:
    checkpoints = ", ".join(f"{k} {v}" for k, v in sorted(result["checkpoints"].items()))
    say(
        f"audit of {result['outbox']} (broker {result['broker']!r}), positions"
        f" {result['from']}..{result['to']} (checkpoints: {checkpoints})"
    )
    say(
        f"  {result['events']} event(s): {result['expected']} message(s) expected,"
        f" {result['found']} found, {result['missing_count']} missing,"
        f" {result['expired_count']} expired; {result['parked']} parked,"
        f" {result['skipped']} skipped by `when`, {result['pending']} not relayed yet"
    )
    say(
        f"  stored more than once: {result['duplicates']}; order breaks:"
        f" {result['order_breaks']}; unexplained: {result['unexplained']}"
    )
    for name, counts in result["destinations"].items():
        say(
            printable(
                f"  {name}: expected {counts['expected']}, found {counts['found']}, missing"
                f" {counts['missing']}, expired {counts['expired']}, duplicates"
                f" {counts['duplicates']}, order breaks {counts['order_breaks']}, unexplained"
                f" {counts['unexplained']}"
            )
        )
    if result["shared_ids"]:
        say(
            f"  warning: {result['shared_ids']} expected messages share their id with another:"
            " the id template is not unique, and one stored copy counts for all of them"
        )
    if result["unmappable"]:
        say(f"  {result['unmappable']} message(s) the current config cannot map, unparked:")
        for example in result["unmappable_examples"]:
            say(printable(f"    {example}"))
    for kind in ("missing", "expired"):
        if result[kind]:
            say(f"{kind}:")
            for f in result[kind]:
                say(
                    printable(
                        f"  position {f['position']} {f['id']} -> {f['destination']}"
                        f" [{f['lane']}] ({f['reason']})"
                    )
                )
            more = result[f"{kind}_count"] - len(result[kind])
            if more > 0:
                say(f"  ... and {more} more (--json lists them, up to 1000)")
    said = (
        f"{result['missing_count']} message(s) missing"
        if result["missing_count"]
        else "nothing missing"
    )
    say(f"result: {said}")


def _say_repair(repair: dict[str, Any]) -> None:
    if "error" in repair:
        say(f"repair: {repair['error']}", err=True)
        return
    by = "itself, under the lease" if repair.get("direct") else repr(repair.get("executed_by"))
    say(
        f"repair: {len(repair['published'])} published again (carried out by {by}),"
        f" {len(repair['still_parked'])} still parked"
    )
    if "waited_for_duplicate_window" in repair:
        say(f"  waited {repair['waited_for_duplicate_window']:g}s for the duplicate window")
    if "note" in repair:
        say(f"  note: {repair['note']}")
    for id_, error in repair["still_parked"].items():
        say(printable(f"  parked #{id_}: {error}"))


def register(app: typer.Typer) -> None:
    """Add `relay audit` to the CLI."""
    app.command("audit")(audit)
