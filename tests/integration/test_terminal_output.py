"""Event data that reaches the operator's terminal: control characters are shown, never obeyed.

An application user chooses aggregate ids. One holding an OSC sequence retitles the
operator's terminal, a CSI sequence clears it, a newline forges a line of `relay check`'s
output, a right-to-left override reorders what a line appears to say.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.support.db import NewEvent, append_many, connect
from tests.support.jetstream import delete_stream
from tests.support.operator_cli import relay_then_stop, setup_outbox
from tests.support.relay_process import run_cli

HOSTILE_ID = "b1\x1b]0;PWNED\x07\x1b[2J\n#999 forged line\u202eexe.txt\x9b31m"
RAW = ["\x1b", "\x07", "\u202e", "\x9b"]


def assert_shown_not_obeyed(output: str, *, whole: bool = True) -> None:
    """No raw control character, no forged line; `whole`: the id shown in full, escaped."""
    present = [repr(char) for char in RAW if char in output]
    assert not present, f"raw control characters {present} in:\n{output}"
    assert not any(line.startswith("#999 forged line") for line in output.splitlines()), output
    escaped = "\\x1b]0;PWNED\\x07\\x1b[2J\\x0a#999 forged line\\u202eexe.txt\\x9b31m"
    # A table puts a value on one line (a newline becomes a space) and may cut it short.
    assert (escaped if whole else "\\x1b]0;PWNED\\x07\\x1b[2J") in output, output


async def test_check_and_parked_print_a_hostile_aggregate_id_escaped(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        huge = "x" * (2 * 1024 * 1024)  # above NATS's default max_payload: parked
        async with connect(events_table) as conn:
            positions = await append_many(
                conn,
                [
                    NewEvent("book", HOSTILE_ID, 1, "BookLent", {"loanId": huge}),
                    NewEvent("book", HOSTILE_ID, 2, "BookLent", {"loanId": "L2"}),
                ],
            )
        await relay_then_stop(relay_process, config, positions[-1])

        for args, whole in (
            (["check", "--offline", "--last", "2"], True),
            (["parked", "list", "loans"], False),
        ):
            result = await asyncio.to_thread(run_cli, [*args, "--config", str(config)])
            assert result.returncode == 0, result.stderr
            assert_shown_not_obeyed(result.stdout + result.stderr, whole=whole)
        listed = await asyncio.to_thread(
            run_cli, ["parked", "list", "loans", "--json", "--config", str(config)]
        )
        parked_id = str(json.loads(listed.stdout)[0]["id"])
        shown = await asyncio.to_thread(
            run_cli, ["parked", "show", parked_id, "--config", str(config)]
        )
        assert shown.returncode == 0, shown.stderr
        assert_shown_not_obeyed(shown.stdout + shown.stderr)
    finally:
        await delete_stream(nats_url, stream)
