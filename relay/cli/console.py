"""What the CLI draws: tables, and progress as a bar, as plain lines or as JSON lines.

A terminal gets a bar redrawn in place with `\\r`; a log file or a CI job gets a line
every few seconds or every tenth of the way; `--json` gets one JSON object a line.
No dependency: this is all it takes.

Event data and errors reach the terminal through `say` and `printable` (relay/printable.py):
control characters are shown escaped, never obeyed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import typer

from relay.printable import printable, printable_lines

CELL_WIDTH = 60  # a longer value is cut in the default table; --wide shows it whole
BAR_WIDTH = 30

Mode = Literal["bar", "lines", "json"]


def say(message: str = "", *, err: bool = False, nl: bool = True) -> None:
    """Print `message` with its control characters escaped, but its line breaks and tabs."""
    typer.echo(printable_lines(message), err=err, nl=nl)


def table(rows: list[dict[str, Any]], columns: list[str], *, wide: bool = False) -> list[str]:
    """The rows as aligned text lines, a header first; long values cut unless `wide`."""
    cells = [[cell(r.get(c), wide=wide) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return [line.rstrip() for line in lines]


def cell(value: Any, *, wide: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    text = printable(value)  # a newline shown as \\x0a: `a\\nb` and `a b` stay apart
    return text if wide or len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 3] + "..."


def cut(rows: list[dict[str, Any]], column: str) -> bool:
    """Whether the default table cuts some value of `column` short."""
    return any(cell(r.get(column)) != cell(r.get(column), wide=True) for r in rows)


@dataclass
class ProgressView:
    """Progress of one long command, drawn for where the output goes.

    `bar`: redrawn in place on `out` (a terminal's stderr). `lines`: a line on `out` at
    the start, every `every_seconds` or `every_fraction` of the way, and at the end.
    `json`: the same moments, as `{"progress": {...}}` objects, one a line, on `out`.
    """

    label: str
    unit: str
    mode: Mode
    out: TextIO
    every_seconds: float = 5.0
    every_fraction: float = 0.1
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, float] | None = field(default=None, init=False)  # (time, fraction)
    _drawn: bool = field(default=False, init=False)

    def show(self, done: int, total: int) -> None:
        fraction = 1.0 if total <= 0 else min(done / total, 1.0)
        now = self.clock()
        if self.mode == "bar":
            filled = round(fraction * BAR_WIDTH)
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            self._write(f"\r{self.label} [{bar}] {fraction:4.0%} {done}/{total} {self.unit}\x1b[K")
            self._drawn = True
            return
        if self._last is not None and self._last[1] >= 1.0:
            return  # the end was shown already
        due = (
            self._last is None
            or now - self._last[0] >= self.every_seconds
            or fraction - self._last[1] >= self.every_fraction
            or (fraction >= 1.0 > self._last[1])
        )
        if not due:
            return
        self._last = (now, fraction)
        if self.mode == "json":
            record = {"label": self.label, "done": done, "total": total, "unit": self.unit}
            self._write(json.dumps({"progress": record}) + "\n")
        else:
            self._write(f"{self.label}: {done}/{total} {self.unit} ({fraction:.0%})\n")

    def close(self) -> None:
        """End the bar's line, so that what follows starts on its own."""
        if self.mode == "bar" and self._drawn:
            self._write("\n")
            self._drawn = False

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def progress_view(label: str, unit: str, as_json: bool) -> ProgressView:
    """JSON lines on stdout with --json; else a bar on a terminal's stderr, or lines."""
    if as_json:
        return ProgressView(label, unit, "json", sys.stdout)
    return ProgressView(label, unit, "bar" if sys.stderr.isatty() else "lines", sys.stderr)
