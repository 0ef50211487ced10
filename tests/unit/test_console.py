"""What the CLI draws for long operations: progress on a terminal, in a log, as JSON."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from relay.cli.console import ProgressView, cut, say, table
from relay.printable import printable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bar_is_redrawn_in_place_and_ended_once() -> None:
    out = io.StringIO()
    view = ProgressView("replay loans", "events", "bar", out)
    view.show(0, 200)
    view.show(100, 200)
    view.close()
    view.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "[###############---------------]  50% 100/200 events" in text


def test_plain_lines_every_tenth_or_every_few_seconds_and_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    view = ProgressView("replay loans", "events", "lines", out, clock=clock)
    for done in (0, 5, 9, 10, 11, 15, 20):  # within one second
        view.show(done, 100)
    clock.now = 6.0
    view.show(21, 100)  # no tenth more, but five seconds later
    view.show(100, 100)
    view.show(100, 100)  # the end is said once
    assert out.getvalue().splitlines() == [
        "replay loans: 0/100 events (0%)",
        "replay loans: 10/100 events (10%)",
        "replay loans: 20/100 events (20%)",
        "replay loans: 21/100 events (21%)",
        "replay loans: 100/100 events (100%)",
    ]


def test_json_lines_are_objects_one_a_line() -> None:
    out = io.StringIO()
    view = ProgressView("retry-parked loans", "messages", "json", out)
    view.show(0, 0)  # nothing to do is done at once
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records == [
        {"progress": {"label": "retry-parked loans", "done": 0, "total": 0, "unit": "messages"}}
    ]


def test_table_cuts_long_values_unless_wide() -> None:
    error = "the event table's head (5) is below the checkpoint (10): " + "x" * 100
    rows: list[dict[str, Any]] = [
        {"name": "loans", "last_error": error},
        {"name": "fines", "last_error": None},
    ]
    narrow = table(rows, ["name", "last_error"])
    assert narrow[0].split() == ["NAME", "LAST_ERROR"]
    assert narrow[1].endswith("...") and len(narrow[1]) < 80 and narrow[2].endswith("-")
    assert cut(rows, "last_error") and not cut(rows, "name")
    assert error in table(rows, ["name", "last_error"], wide=True)[1]
    # One row stays one line, and `a\nb` does not pass for `a b`.
    assert table([{"e": "two\nlines"}], ["e"])[1] == "two\\x0alines"


def test_printable_escapes_every_control_character_and_bidi_override() -> None:
    assert printable("a\x1b]0;T\x07b\nc\td\x7f\x9b\u202e\u2066z") == (
        "a\\x1b]0;T\\x07b\\x0ac\\x09d\\x7f\\x9b\\u202e\\u2066z"
    )
    assert printable("Łódź/ü 書 😀") == "Łódź/ü 書 😀"  # printable text passes as it is


def test_say_keeps_its_own_line_breaks_and_tabs(capsys: pytest.CaptureFixture[str]) -> None:
    say("one\ttwo\nthree\x1b[2J\r")
    assert capsys.readouterr().out == "one\ttwo\nthree\\x1b[2J\\x0d\n"


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logs_show_event_data_escaped_never_obeyed(
    fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`logging.format: console` is what `auto` picks on a terminal."""
    import structlog

    from relay.runtime.logs import configure

    configure("info", fmt)
    hostile = "u/\x1b]0;PWNED\x07\x1b[2J\u2028dave\x9b31m@1"
    structlog.get_logger("relay.test").error("message parked", aggregate=hostile, ids=[hostile])
    err = capsys.readouterr().err
    for raw in ("\x1b", "\x07", "\u2028", "\x9b"):
        assert raw not in err, (raw, err)
    shown = "\\x1b]0;PWNED\\x07\\x1b[2J\\u2028dave\\x9b31m" if fmt == "console" else "PWNED"
    assert shown in err
