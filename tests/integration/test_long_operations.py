"""Long operations from the CLI, against real Postgres, NATS and `relay run` processes.

`--wait` shows a replay's and a retry-parked's progress (plain lines off a terminal,
JSON lines with `--json`) and fails clearly when the outbox will not catch up;
retry-parked publishes in batches and reports each message; `parked drop --all` is
confirmed; `status` shows a long last_error whole on demand and refreshes with --watch.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.db import NewEvent, append_many, connect
from tests.support.jetstream import delete_stream, fetch_all
from tests.support.operator_cli import (
    cli,
    holds,
    park_huge_loans,
    relay_then_stop,
    relayed_up_to,
    setup_outbox,
)
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, eventually, save

PLAIN_LINE = re.compile(r"^replay loans: (\d+)/(\d+) events \(\d+%\)$")


def on_terminal(args: list[str], answer: bytes = b"", until: bytes = b"") -> tuple[int, str]:
    """Run `relay ARGS` with a pseudo-terminal for stdin, stdout and stderr, as a person
    would; type `answer` once `until` was shown. (exit code, everything it wrote)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "relay", *args],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
    )
    os.close(follower)
    seen, answered = b"", not answer
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal closed: the process has ended
                    break
                seen += chunk
            if not answered and until in seen:
                os.write(leader, answer)
                answered = True
            if not ready and process.poll() is not None:
                break
        return process.wait(10), seen.decode(errors="replace")
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()


def _increasing(pairs: list[tuple[int, int]], total: int) -> None:
    """Progress counts never go back, all over the same total, ending at it."""
    assert pairs, "no progress shown"
    assert {t for _, t in pairs} == {total}
    done = [d for d, _ in pairs]
    assert done == sorted(done) and done[-1] == total


async def test_replay_wait_shows_progress_until_caught_up(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(
        events_table, nats_url, tmp_path, batch={"max_messages": 20, "linger": "0s"}
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn,
                [NewEvent("book", f"b{i % 7}", i // 7 + 1, "BookLent", {}) for i in range(300)],
            )
        holder = relay_process(["run", "--config", str(config)])
        await eventually(lambda: holds(holder), timeout=20)
        await relayed_up_to(config, positions[-1])

        # Off a terminal: plain lines on stderr, the outcome on stdout.
        plain = run_cli(["replay", "loans", "--from-start", "--wait", "--config", str(config)])
        assert plain.returncode == 0, plain.stderr
        lines = [m for line in plain.stderr.splitlines() if (m := PLAIN_LINE.match(line))]
        _increasing([(int(m[1]), int(m[2])) for m in lines], 300)
        assert "\r" not in plain.stderr  # no bar off a terminal
        assert f"loans caught up with position {positions[-1]}: 300 event(s)" in plain.stdout

        # On a terminal: a bar redrawn in place.
        code, drawn = on_terminal(["replay", "loans", "--from-start", "--wait", "-c", str(config)])
        assert code == 0, drawn
        assert "\rreplay loans [" in drawn and "] 100% 300/300 events" in drawn

        # --json: one object a line; progress first, the result last.
        machine = run_cli(
            [
                "replay",
                "loans",
                "--from",
                str(positions[100]),
                "--wait",
                "--json",
                "-c",
                str(config),
            ]
        )
        assert machine.returncode == 0, machine.stderr
        records = [json.loads(line) for line in machine.stdout.splitlines()]
        *progress, result = records
        _increasing([(p["progress"]["done"], p["progress"]["total"]) for p in progress], 200)
        assert {p["progress"]["unit"] for p in progress} == {"events"}
        assert result["ok"] is True and result["caught_up"] is True
        assert result["progress"] == {"done": 200, "total": 200, "unit": "events"}
        assert result["executed_by"].endswith(f":{holder.pid}")
        assert cli(config, "status")[0]["checkpoint"] == positions[-1]

        # The broker loses the stream: the outbox retries, and --wait says so (exit 1).
        await delete_stream(nats_url, stream)
        failing = run_cli(
            ["replay", "loans", "--from-start", "--wait", "--json", "--config", str(config)]
        )
        assert failing.returncode == 1
        assert "error: outbox loans is retrying" in failing.stderr
        last = json.loads(failing.stdout.splitlines()[-1])
        assert last["ok"] is True and last["caught_up"] is False
        assert "retrying" in last["wait_error"]
    finally:
        await delete_stream(nats_url, stream)


async def test_replay_wait_sums_the_partitions_of_a_split_outbox(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(
        events_table, nats_url, tmp_path, partitions=3, batch={"max_messages": 10}
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn,
                [NewEvent("book", f"b{i % 11}", i // 11 + 1, "BookLent", {}) for i in range(90)],
            )
        relay_process(["run", "--config", str(config)])

        await eventually(lambda: _all_caught_up(config, positions[-1]), timeout=30)
        result = run_cli(
            ["replay", "loans", "--from", str(positions[30]), "--wait", "--json", "-c", str(config)]
        )
        assert result.returncode == 0, result.stderr
        *progress, outcome = [json.loads(line) for line in result.stdout.splitlines()]
        # 60 events from position 31 on, over three lanes, each counted once.
        _increasing([(p["progress"]["done"], p["progress"]["total"]) for p in progress], 60)
        assert outcome["caught_up"] is True and outcome["head"] == positions[-1]
        assert sorted(outcome["detail"]["lanes"]) == ["loans/0", "loans/1", "loans/2"]
        assert await _all_caught_up(config, positions[-1])
    finally:
        await delete_stream(nats_url, stream)


async def _all_caught_up(config: Path, position: int) -> bool:
    return all(row["checkpoint"] == position for row in cli(config, "status"))


async def test_replay_wait_fails_when_no_replica_holds_the_lease(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, [NewEvent("book", "b1", 1, "BookLent", {})])
        await relay_then_stop(relay_process, config, positions[-1])

        result = run_cli(
            ["replay", "loans", "--from-start", "--wait", "--timeout", "1", "-c", str(config)]
        )
        assert result.returncode == 1
        assert "no replica has held outbox loans for 1s" in result.stderr
        assert "start `relay run`" in result.stderr
        assert cli(config, "status")[0]["checkpoint"] == 0  # the replay itself was done
    finally:
        await delete_stream(nats_url, stream)


FINES = {
    "FineCharged": {
        "type": "library.fine-charged.v1",
        "destination": "{subject}.fines",
        "payload": {"amount": "abs(data.amount)", "note": "data.note"},
    }
}


async def test_retry_parked_publishes_in_batches_and_reports_each_message(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    batch = {"max_messages": 3}
    config, stream = await setup_outbox(
        events_table, nats_url, tmp_path, messages=FINES, batch=batch
    )
    huge = "x" * (2 * 1024 * 1024)  # above NATS's 1 MB max_payload once it can be mapped
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn,
                [
                    NewEvent("book", "b1", 1, "FineCharged", {"amount": "1"}),
                    NewEvent("book", "b1", 2, "FineCharged", {"amount": "2", "note": huge}),
                    NewEvent("book", "b2", 1, "FineCharged", {"amount": "3"}),
                    NewEvent("book", "b1", 3, "FineCharged", {"amount": "4"}),
                ],
            )
        await relay_then_stop(relay_process, config, positions[-1])  # all parked: "abs" of "1"
        parked = cli(config, "parked", "list", "loans")
        assert [p["position"] for p in parked] == positions
        ids = [p["id"] for p in parked]

        fixed = json.loads(json.dumps(FINES).replace("abs(data.amount)", "data.amount"))
        data = config_dict(events_table, nats_url, stream, messages=fixed, batch=batch)
        fixed_config = save(tmp_path, data, "fixed.yaml")
        holder = relay_process(["run", "--config", str(fixed_config)])
        await eventually(lambda: holds(holder), timeout=20)

        result = run_cli(
            ["retry-parked", "loans", "--all", "--wait", "--json", "--config", str(fixed_config)]
        )
        assert result.returncode == 1, result.stderr  # one is still parked
        *progress, outcome = [json.loads(line) for line in result.stdout.splitlines()]
        _increasing([(p["progress"]["done"], p["progress"]["total"]) for p in progress], 4)
        assert outcome["executed_by"].endswith(f":{holder.pid}")
        assert outcome["progress"] == {"done": 4, "total": 4, "unit": "messages"}
        said = [(o["id"], o["outcome"]) for o in outcome["detail"]["outcomes"]]
        assert said == [
            (ids[0], "published"),
            (ids[1], "still parked"),
            (ids[2], "published"),
            (ids[3], "published"),
        ]
        assert "max_payload" in outcome["detail"]["outcomes"][1]["error"]
        assert outcome["detail"]["still_parked"] == {
            str(ids[1]): outcome["detail"]["outcomes"][1]["error"]
        }

        # Published in position order, each aggregate's in its order; the huge one stays.
        received = await fetch_all(nats_url, stream, expected=3)
        assert [m.json()["amount"] for m in received] == ["1", "3", "4"]
        assert [p["id"] for p in cli(config, "parked", "list", "loans")] == [ids[1]]
        # Through the batched path: a batch of 3 (sent again after the failure), then 1.
        sent = [
            r["messages"] for r in holder.logs() if r.get("event") == "retry-parked: batch sent"
        ]
        assert sent == [3, 1]

        # The text form names each message's outcome too.
        text = run_cli(["retry-parked", "loans", "--all", "--config", str(fixed_config)])
        assert text.returncode == 1
        assert "0 published, 1 still parked" in text.stdout
        assert re.search(
            rf"#{ids[1]} position {positions[1]} book/b1@2: still parked: .*max_payload",
            text.stdout,
        )
    finally:
        await delete_stream(nats_url, stream)


async def test_parked_drop_all_is_confirmed(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        positions = await park_huge_loans(events_table, relay_process, config, 3)
        ids = [row["id"] for row in cli(config, "parked", "list", "loans")]
        assert len(ids) == 3

        # Off a terminal (the subprocess's stdin is not one) and without --yes: refused.
        refused = run_cli(["parked", "drop", "--all", "--config", str(config)])
        assert refused.returncode == 2
        assert "add --yes to confirm" in refused.stderr and "nothing was dropped" in refused.stderr
        assert len(cli(config, "parked", "list", "loans")) == 3

        dry = run_cli(["parked", "drop", "--all", "--dry-run", "--config", str(config)])
        assert dry.returncode == 0, dry.stderr
        assert "dry run: 3 parked message(s) would be dropped" in dry.stdout
        for id_, position, i in zip(ids, positions, range(3), strict=True):
            assert re.search(
                rf"^{id_}\s+loans\s+{position}\s+book/b{i}@1\s+BookLent", dry.stdout, re.M
            )
        dry_json = cli(config, "parked", "drop", "--all", "--outbox", "loans", "--dry-run")
        assert [p["id"] for p in dry_json["would_drop"]] == ids
        assert len(cli(config, "parked", "list", "loans")) == 3

        # On a terminal it lists them and asks; "no" drops nothing.
        code, said = on_terminal(
            ["parked", "drop", "--all", "-c", str(config)], answer=b"n\n", until=b"[y/N]"
        )
        assert code == 1 and "Drop these 3 parked message(s) of every outbox" in said, said
        assert "nothing was dropped" in said and "book/b2@1" in said
        assert len(cli(config, "parked", "list", "loans")) == 3

        assert cli(config, "parked", "drop", "--all", "--yes") == {"dropped": ids}
        assert cli(config, "parked", "list", "loans") == []
    finally:
        await delete_stream(nats_url, stream)


async def test_status_shows_a_long_error_whole_on_demand_and_watches(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn, [NewEvent("book", "b1", v, "BookLent", {}) for v in range(1, 6)]
            )
            holder = relay_process(["run", "--config", str(config)])
            await relayed_up_to(config, positions[-1])
            # The head goes below the checkpoint: the outbox halts with a long explanation.
            await conn.execute("TRUNCATE events RESTART IDENTITY")
            await append_many(conn, [NewEvent("book", "b2", 1, "BookLent", {})])

        async def halted() -> bool:
            return bool(cli(config, "status")[0]["state"] == "halted")

        await eventually(halted, timeout=20)
        whole = cli(config, "status")[0]["last_error"]
        assert len(whole) > 200 and whole.endswith("skips what it holds now")

        table = run_cli(["status", "--config", str(config)])
        assert table.returncode == 0
        assert whole not in table.stdout and whole[:40] in table.stdout
        assert "--wide shows it whole" in table.stdout
        wide = run_cli(["status", "--wide", "--config", str(config)])
        assert whole in wide.stdout and "--wide shows it whole" not in wide.stdout

        # --watch off a terminal: a new table every second, until Ctrl-C (exit 0).
        watcher = relay_process(["status", "--watch", "--config", str(config)])

        def tables() -> int:
            return int(watcher.stdout_path.read_text().count("NAME  "))

        await eventually(lambda: tables() >= 2, timeout=20)
        watcher.interrupt()
        assert await watcher.wait_async(10) == 0
        out = watcher.stdout_path.read_text()
        assert out.count("\n-- ") + out.startswith("-- ") >= 2  # a time stamp per refresh
        assert "halted" in out and "Traceback" not in watcher.output()
        holder.terminate()
        assert await holder.wait_async(15) == 0
    finally:
        await delete_stream(nats_url, stream)
