"""`relay check --history`: does the whole stored history still map, and go out, under this
config? The walk itself is relay/fleet/history.py; this is the command's side: the range,
the brokers' limits (probed unless `--offline`), a read-only connection, the report."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.cli.check import Report, probes, publishers_of
from relay.cli.console import ProgressView, say
from relay.config import RelayConfig
from relay.errors import SourceError, UsageError
from relay.fleet.history import HistoryCheck
from relay.fleet.identity import identity
from relay.postgres.database import Database
from relay.postgres.source import EventSource
from relay.postgres.sql import quote
from relay.printable import printable


@dataclass(frozen=True, slots=True)
class HistoryRange:
    """The options' range; none of them: every event, up to the last one stored now."""

    start: int | None = None  # --from
    from_start: bool = False
    time: datetime | None = None  # --from-time
    to: int | None = None  # --to


async def run_history(cfg: RelayConfig, asked: HistoryRange, *, offline: bool) -> dict[str, Any]:
    """The walk's result as `--json` prints it; problems (brokers, the table) in it too."""
    report = Report()
    publishers = publishers_of(cfg, report)
    if not offline:
        for problems in await asyncio.gather(*probes(cfg, publishers)):
            report.problems += problems
    view = ProgressView("check --history", "events", "bar", sys.stderr)
    source = EventSource(cfg.source)
    async with Database.of(cfg, identity()).one_shot("check") as conn:
        # Reads only: it may run against a replica database, or a copy of the table.
        await conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        await source.check(conn)
        after, upto = await _range(conn, source, asked)
        walk = HistoryCheck(cfg, publishers, probe=not offline)
        outboxes, seconds = await walk.run(
            conn, after, upto, view.show if sys.stderr.isatty() else None
        )
    view.close()
    read = max((o.events for o in outboxes), default=0)
    return {
        "from": after + 1,
        "to": upto,
        "seconds": round(seconds, 3),
        "outboxes": [o.as_json() for o in outboxes],
        "problems": report.problems,
        "ok": not report.problems and not any(o.failing for o in outboxes),
        "events_per_second": round(read / seconds) if seconds else None,
    }


async def _range(conn: Any, source: EventSource, asked: HistoryRange) -> tuple[int, int]:
    """(after, upto]: the end fixed when the walk begins (a writer may go on writing). A
    range the options give by position that starts after its end is a usage error; one
    that is empty because the table is (a new service's CI) or no event is as new as
    `--from-time`, is an empty walk."""
    position = quote(source.config.columns.position)
    last = int(await conn.fetchval(f"SELECT coalesce(max({position}), 0) FROM {source.table}"))
    upto = last if asked.to is None else asked.to
    if asked.start is not None:
        after = asked.start - 1
        if asked.to is not None and after >= upto:
            raise UsageError(
                f"the range starts at position {asked.start}, after its end ({asked.to})"
            )
    elif asked.time is not None:
        try:
            first = await source.first_position_since(conn, asked.time)
        except SourceError as exc:  # no created_at column: the options are wrong here
            raise UsageError(str(exc)) from exc
        after = upto if first is None else first - 1
    else:
        after = 0
    return min(after, upto), upto


def say_history(result: dict[str, Any]) -> None:
    """The text report: a line per outbox, then the first examples of each outcome."""
    say(
        f"history of positions {result['from']}..{result['to']}"
        f" ({result['seconds']:.1f}s, {result['events_per_second'] or 0:,} events/s)"
    )
    if result["from"] > result["to"]:
        say(
            "note: the range holds no event (the table is empty, or the range starts after"
            " its last event): nothing was checked"
        )
    for found in result["outboxes"]:
        say(_outbox_line(found))
        for outcome, examples in found["examples"].items():
            for example in examples:
                say(
                    printable(
                        f"  would park ({outcome}): #{example['position']} {example['event']}"
                        + (f" ({example['rule']})" if example["rule"] else "")
                        + f": {example['error']}"
                    )
                )
        for problem in found["destinations"]:
            say(printable(f"  would hold the outbox back: {problem}"))
        for note in found["notes"]:
            say(printable(f"  note: {note}"))
        for shared in found["shared"]:
            positions = ", ".join(map(str, shared["positions"]))
            say(
                printable(
                    f"  id {shared['id']} shared by {shared['events']} events, at positions"
                    f" {positions}: the broker (or consumers) would drop all but one"
                )
            )
        for shared in found["shared_across"]:
            positions = ", ".join(map(str, shared["positions"]))
            say(
                printable(
                    f"  id {shared['id']} (positions {positions}) also published by"
                    f" {', '.join(shared['with'])} into {shared['scope']}, which keeps the first"
                    " message of an id and drops the other"
                )
            )
    for problem in result["problems"]:
        say(f"error: {problem}", err=True)
    say("result: " + ("nothing would park" if result["ok"] else "some events would not go out"))


def _outbox_line(found: dict[str, Any]) -> str:
    parked = found["would_park"]
    parks = ", ".join(f"{reason} {count}" for reason, count in parked.items())
    line = (
        f"{found['outbox']}: {found['events']} event(s): {found['published']} published,"
        f" {found['skipped']} skipped by `when`, would park {sum(parked.values())}"
    )
    if parks:
        line += f" ({parks})"
    if found["shared_ids"]:
        line += f"; {found['shared_ids']} id(s) shared by two events or more"
    if found["shared_across_outboxes"]:
        line += f"; {found['shared_across_outboxes']} id(s) shared with another outbox"
    if found["destinations"]:
        line += f"; {len(found['destinations'])} destination(s) the broker would not take"
    if found["before_start"]:
        line += f"; {found['before_start']} before its start (start: end), never read"
    return line
