"""Operations from the CLI, against real Postgres and NATS and real `relay run` processes.

Replay and retry-parked go to the lease holder through the commands table, or
are done by the CLI itself under the lease when no replica runs; a standby
never acts. Every command is run as a separate process, as an operator would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relay.cli.console import progress_view
from relay.cli.progress import follow_retry
from relay.config import load_config
from relay.postgres.database import DatabaseUnavailable
from relay.postgres.lease import lock_key
from tests.support.db import NewEvent, append_many, connect
from tests.support.jetstream import delete_stream, fetch_all
from tests.support.net import free_port
from tests.support.operator_cli import (
    cli,
    holds,
    park_huge_loans,
    relay_then_stop,
    relayed_up_to,
    setup_outbox,
)
from tests.support.relay_process import run_cli
from tests.support.scenario import LIBRARY_MESSAGES, config_dict, eventually, save

LENT = LIBRARY_MESSAGES["BookLent"]


def loans(count: int) -> list[NewEvent]:
    return [
        NewEvent("book", f"b{i % 3}", i // 3 + 1, "BookLent", {"loanId": f"L{i}"})
        for i in range(count)
    ]


async def test_replay_is_carried_out_by_the_holder_never_the_standby(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(30))
        first = relay_process(["run", "--config", str(config)])
        await eventually(lambda: holds(first), timeout=20)
        second = relay_process(["run", "--config", str(config)])
        await second.wait_for_log("standing by")
        await relayed_up_to(config, positions[-1])

        dry = cli(config, "replay", "loans", "--from", str(positions[10]), "--dry-run")
        assert dry["events"] == 20 and dry["dry_run"] is True
        done = cli(config, "replay", "loans", "--from", str(positions[10]))
        assert done["ok"] is True and done["direct"] is False
        assert done["executed_by"].endswith(f":{first.pid}")
        assert done["detail"] == {"checkpoint": positions[9], "previous_checkpoint": positions[-1]}

        # The holder publishes the 20 again; JetStream's dedup absorbs them (same ids).
        async def republished() -> bool:
            return bool(sum(r.get("duplicates", 0) for r in first.logs()) == 20)

        await eventually(republished, timeout=20)
        assert len(await fetch_all(nats_url, stream, expected=30)) == 30
        assert any(r.get("event") == "carrying out command" for r in first.logs())
        assert not [r for r in second.logs() if r.get("event") == "carrying out command"]
        await relayed_up_to(config, positions[-1])
    finally:
        await delete_stream(nats_url, stream)


async def test_cli_replays_under_the_lease_when_no_replica_runs(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])

        status = cli(config, "status")[0]
        assert status["state"] == "no holder" and status["holder"] is None
        done = cli(config, "replay", "loans", "--from-start")
        assert done["ok"] is True and done["direct"] is True
        assert cli(config, "status")[0]["checkpoint"] == 0
        async with connect(events_table) as conn:
            row = await conn.fetchrow("SELECT state, executed_by FROM relay.commands")
        assert row["state"] == "done"  # recorded for the audit trail, like any command

        forward = run_cli(["replay", "loans", "--from", "999", "--config", str(config)])
        assert forward.returncode == 2 and "only moves back" in forward.stderr
        both = run_cli(["replay", "loans", "--from", "1", "--from-start", "--config", str(config)])
        assert both.returncode == 2
    finally:
        await delete_stream(nats_url, stream)


async def test_retry_parked_after_the_config_is_fixed(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    broken = {
        **LIBRARY_MESSAGES,
        "FineCharged": {
            "type": "library.fine-charged.v1",
            "destination": "{subject}.fines",
            "payload": {"amount": "abs(data.amount)"},  # fails at run time on a string
        },
    }
    config, stream = await setup_outbox(events_table, nats_url, tmp_path, messages=broken)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn,
                [
                    NewEvent("book", "b1", 1, "FineCharged", {"amount": "three"}),
                    NewEvent("book", "b1", 2, "FineCharged", {"amount": -2}),
                ],
            )
        await relay_then_stop(relay_process, config, positions[-1])
        (parked,) = cli(config, "parked", "list", "loans")
        assert parked["position"] == positions[0] and parked["reason"] == "mapping"
        shown = cli(config, "parked", "show", str(parked["id"]))
        assert "abs" in shown["error"] and shown["event_type"] == "FineCharged"

        # Still broken: the message stays parked and its attempt count goes up.
        again = run_cli(["retry-parked", "loans", "--all", "--config", str(config), "--json"])
        assert again.returncode == 1
        assert cli(config, "parked", "list", "loans")[0]["attempts"] == parked["attempts"] + 1

        # The operator fixes the mapping; a replica runs the new config.
        fixed = json.loads(json.dumps(broken).replace("abs(data.amount)", "data.amount"))
        fixed_config = save(
            tmp_path, config_dict(events_table, nats_url, stream, messages=fixed), "fixed.yaml"
        )
        holder = relay_process(["run", "--config", str(fixed_config)])
        await eventually(lambda: holds(holder), timeout=20)
        done = cli(fixed_config, "retry-parked", "loans", "--id", str(parked["id"]))
        assert done["ok"] is True and done["executed_by"].endswith(f":{holder.pid}")
        assert done["detail"]["published"] == [parked["id"]]
        assert cli(fixed_config, "parked", "list", "loans") == []
        received = await fetch_all(nats_url, stream, expected=2)
        # A parked message is published after its successors: the documented exception to order.
        assert [m.json()["amount"] for m in received] == [2, "three"]
    finally:
        await delete_stream(nats_url, stream)


async def test_parked_drop(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        await park_huge_loans(events_table, relay_process, config, 3)
        ids = [row["id"] for row in cli(config, "parked", "list", "loans")]
        assert len(ids) == 3
        assert cli(config, "parked", "drop", str(ids[0])) == {"dropped": [ids[0]]}
        missing = run_cli(["parked", "drop", str(ids[0]), "--config", str(config)])
        assert missing.returncode == 1 and "no parked message" in missing.stderr
        assert cli(config, "parked", "drop", "--all", "--outbox", "loans", "--yes") == {
            "dropped": ids[1:]
        }
        assert cli(config, "status")[0]["parked"] == 0
    finally:
        await delete_stream(nats_url, stream)


async def test_command_is_withdrawn_when_the_holder_does_not_act(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(3))
        holder = relay_process(["run", "--config", str(config)])
        await relayed_up_to(config, positions[-1])
        holder.pause()  # holds the lease but does nothing
        try:
            result = run_cli(
                ["replay", "loans", "--from-start", "--timeout", "1", "--config", str(config)]
            )
        finally:
            holder.resume()
        assert result.returncode == 1
        assert "withdrawn and nothing was changed" in result.stderr
        async with connect(events_table) as conn:
            assert await conn.fetchval("SELECT state FROM relay.commands") == "expired"
        # The resumed holder relays a new event, so its loop has passed its command
        # checks; it must not have acted on the withdrawn command.
        async with connect(events_table) as conn:
            (later,) = await append_many(conn, [NewEvent("book", "b9", 1, "BookLent", {})])
        await relayed_up_to(config, later)
        async with connect(events_table) as conn:
            assert await conn.fetchval("SELECT state FROM relay.commands") == "expired"
        assert not [r for r in holder.logs() if r.get("event") == "carrying out command"]
    finally:
        await delete_stream(nats_url, stream)


async def test_two_operators_at_once_are_serialised_by_the_lease(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(9))
        await relay_then_stop(relay_process, config, positions[-1])

        def replay(position: int) -> Any:
            args = ["replay", "loans", "--from", str(position), "--config", str(config), "--json"]
            return run_cli(args)

        first, second = await asyncio.gather(
            asyncio.to_thread(replay, positions[6]), asyncio.to_thread(replay, positions[3])
        )
        async with connect(events_table) as conn:
            states = [r["state"] for r in await conn.fetch("SELECT state FROM relay.commands")]
            checkpoint = await conn.fetchval("SELECT position FROM relay.checkpoints")
        # Each operator held the lease in turn. The later one either moved the
        # checkpoint further back (both succeed) or was refused because the other had
        # already gone further back than it asked: never a half-done or forward move.
        assert second.returncode == 0, second.stderr  # back to p2: allowed in any order
        if first.returncode != 0:  # back to p5 after the other went to p2: refused
            said = first.stdout + first.stderr
            assert "already before that position" in said or "only moves back" in said
        assert checkpoint == positions[2]
        assert states.count("done") == 1 + (first.returncode == 0)
        assert "running" not in states and "pending" not in states
    finally:
        await delete_stream(nats_url, stream)


# Args of a known shape that this release can tell are wrong. A key it does not know is a
# newer release's: left pending for a replica that knows it (test_newer_rows.py).
HOSTILE_ARGS = [
    ("replay", '{"to": "abc"}', "to: Input should be a valid integer"),
    ("replay", '{"to": -5}', "to: Input should be greater than or equal to 0"),
    ("replay", '{"to": 1.5}', "to: Input should be a valid integer"),
    ("replay", '{"to": 99999999999999999999}', "to: Input should be less than or equal to"),
    ("replay", "{}", "to: Field required"),
    ("replay", '"abc"', "args: Input should be an object"),
    ("retry-parked", '{"ids": "abc"}', "ids: Input should be a valid array"),
    ("retry-parked", '{"ids": [1, "x"]}', "ids.1: Input should be a valid integer"),
    ("retry-parked", '{"ids": [0]}', "ids.0: Input should be greater than or equal to 1"),
]


async def test_a_bad_command_row_fails_and_the_holder_carries_on(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Rows written by hand, not by the CLI: each fails with its reason; none stops the relay."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(6))
        holder = relay_process(["run", "--config", str(config)])
        await relayed_up_to(config, positions[-1])
        async with connect(events_table) as conn:
            ids = [
                await conn.fetchval(
                    "INSERT INTO relay.commands (outbox, kind, args, requested_by)"
                    " VALUES ('loans', $1, $2::jsonb, 'someone') RETURNING id",
                    kind,
                    args,
                )
                for kind, args, _ in HOSTILE_ARGS
            ]
            await conn.execute("SELECT pg_notify('relay_commands', 'loans')")

            async def all_finished() -> bool:
                states = await conn.fetch(
                    "SELECT state FROM relay.commands WHERE id = ANY($1)", ids
                )
                return all(r["state"] in ("done", "failed") for r in states)

            await eventually(all_finished, timeout=30)
            rows = await conn.fetch(
                "SELECT id, state, outcome FROM relay.commands WHERE id = ANY($1) ORDER BY id",
                ids,
            )
            for row, (kind, args, reason) in zip(rows, HOSTILE_ARGS, strict=True):
                assert row["state"] == "failed", (kind, args)
                error = json.loads(row["outcome"])["error"]
                assert error.startswith(f"bad args for {kind}: "), error
                assert reason in error, (args, error)
            more = await append_many(
                conn,
                [NewEvent("book", f"later{i}", 1, "BookLent", {"loanId": "L"}) for i in range(6)],
            )
        await relayed_up_to(config, more[-1])
        assert holder.returncode is None, "the holder stopped"
        assert not [r for r in holder.logs() if r.get("event") == "task died, stopping the relay"]
        done = cli(config, "replay", "loans", "--from", str(positions[3]))
        assert done["ok"] is True and done["direct"] is False
        assert len(await fetch_all(nats_url, stream, expected=12)) == 12
    finally:
        await delete_stream(nats_url, stream)


async def split_relayed(config: Path, position: int) -> None:
    """Until every lane of the outbox has relayed up to `position`."""

    async def caught_up() -> bool:
        return all(row["checkpoint"] == position for row in cli(config, "status"))

    await eventually(caught_up, timeout=30)


async def held_by_another_then_moved_back(
    dsn: str,
    lanes: list[str],
    args: list[str],
    move: dict[str, int],
    meanwhile: Callable[[], Any] = lambda: None,
) -> tuple[Any, Any]:
    """Run `relay ARGS` while a session holds the lanes' leases (a holder that takes no
    command); once it has asked, move the lanes in `move` back, as another operator's
    command that came first would, and run `meanwhile`; then let go. The CLI carries it
    out itself then. Its result, and what `meanwhile` returned."""
    async with connect(dsn) as holder, connect(dsn) as conn:
        for lane in lanes:
            await holder.execute("SELECT pg_advisory_lock($1)", lock_key("relay", lane))
        asked = asyncio.create_task(asyncio.to_thread(run_cli, args))

        async def waiting() -> bool:
            pending = "SELECT count(*) FROM relay.commands WHERE state = 'pending'"
            return bool(await conn.fetchval(pending) == 1)

        await eventually(waiting, timeout=30)
        for lane, position in move.items():
            await conn.execute(
                "UPDATE relay.checkpoints SET position = $2 WHERE outbox = $1", lane, position
            )
        seen = await asyncio.to_thread(meanwhile)
    return await asked, seen


async def test_a_replay_reports_what_its_lanes_did_not_what_they_held_when_asked(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Replays and repartitions run at once: a replay from 200 printed `ok`, checkpoint 2000
    and 1801 events, read when it was asked, while its lanes had been moved back to 99 by
    the time it ran, and moved nothing. Here one of two lanes is moved back below the
    replay's position between its asking and its carrying out."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path, partitions=2)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(
                conn, [NewEvent("book", f"b{i}", 1, "BookLent", {}) for i in range(40)]
            )
        relay = relay_process(["run", "--config", str(config)])
        await split_relayed(config, positions[-1])
        relay.terminate()
        assert await relay.wait_async(15) == 0
        start = str(positions[20])
        asked = cli(config, "replay", "loans", "--from", start, "--dry-run")["events"]

        def dry_run_now() -> Any:
            return cli(config, "replay", "loans", "--from", start, "--dry-run")

        args = ["replay", "loans", "--from", start, "--json", "--timeout", "60"]
        async with connect(events_table) as conn:
            moved_back = positions[4]
            done, now = await held_by_another_then_moved_back(
                events_table,
                ["loans/0", "loans/1"],
                [*args, "--config", str(config)],
                {"loans/1": moved_back},
                lambda: dry_run_now()["events"],
            )
            lanes = {
                r["outbox"]: r["position"]
                for r in await conn.fetch("SELECT outbox, position FROM relay.checkpoints")
            }
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        # loans/1 was before the replay's position when it ran: it is left as it is.
        assert lanes == {"loans/0": positions[19], "loans/1": moved_back}
        detail = result["detail"]["lanes"]
        assert detail["loans/0"] == {
            "checkpoint": positions[19],
            "previous_checkpoint": positions[-1],
        }
        assert (detail["loans/1"]["checkpoint"], detail["loans/1"]["previous_checkpoint"]) == (
            moved_back,
            moved_back,
        )
        # The summary counts what it sends again: loans/0's events after position 20 only,
        # as a dry run said once loans/1 had moved back, not both lanes' as one said when
        # the replay was asked.
        assert 0 < now < asked
        assert (result["ok"], result["events"], result["checkpoint"]) == (True, now, positions[-1])
    finally:
        await delete_stream(nats_url, stream)


async def test_a_replay_that_became_forwards_is_refused_and_changes_nothing(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """The checkpoint moved back past the replay's position after it was asked: carried out,
    it would move nothing. It says so (a replay forwards, exit 2), never `ok` with counts."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])
        args = ["replay", "loans", "--from", str(positions[8]), "--json", "--timeout", "60"]
        done, _ = await held_by_another_then_moved_back(
            events_table, ["loans"], [*args, "--config", str(config)], {"loans": positions[2]}
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == ""
        assert f"replay only moves back: position {positions[8]} is after the checkpoint" in (
            done.stderr
        )
        assert "nothing was changed" in done.stderr
        assert cli(config, "status")[0]["checkpoint"] == positions[2]
        async with connect(events_table) as conn:
            rows = await conn.fetch("SELECT state, outcome FROM relay.commands ORDER BY id")
        # Withdrawn from the holder that never took it, then refused under the lease.
        assert [r["state"] for r in rows] == ["expired", "failed"]
        assert "only moves back" in json.loads(rows[1]["outcome"])["error"]
    finally:
        await delete_stream(nats_url, stream)


async def test_commands_no_holder_will_carry_out_are_shown_then_failed_with_a_reason(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Rows for a lane the outbox does not have (its bare name when split, `loans/9` of
    three) stayed `pending` for ever, and one left `running` by a replica that died stayed
    `running`; nothing reported them. `relay status` shows them stuck while no replica
    runs; a holder fails each, naming why; status then shows them failed."""
    config, stream = await setup_outbox(events_table, nats_url, tmp_path, partitions=3)
    insert = (
        "INSERT INTO relay.commands (outbox, kind, args, requested_by, state, executed_by)"
        " VALUES ($1, $2, $3::jsonb, 'someone', $4, $5) RETURNING id"
    )
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(9))
            bare = await conn.fetchval(insert, "loans", "replay", '{"to": 0}', "pending", None)
            nine = await conn.fetchval(insert, "loans/9", "replay", '{"to": 0}', "pending", None)
            gone = await conn.fetchval(
                insert, "loans/1", "retry-parked", "{}", "running", "relay:gone:1"
            )
        shown = cli(config, "status")[0]["commands"]
        assert [(c["id"], c["state"], c["stuck"]) for c in shown] == [
            (bare, "pending", True),
            (nine, "pending", True),
            (gone, "running", True),
        ]
        assert "loans is split into 3 partitions" in shown[0]["reason"]
        assert "'loans/9' is not a lane of loans" in shown[1]["reason"]
        assert "by 'relay:gone:1', which no longer holds 'loans/1'" in shown[2]["reason"]
        table = run_cli(["status", "--config", str(config)]).stdout
        assert f"loans: command {nine} (replay of loans/9, asked" in table
        assert "is stuck pending: 'loans/9' is not a lane of loans" in table

        relay = relay_process(["run", "--config", str(config)])
        await split_relayed(config, positions[-1])
        async with connect(events_table) as conn:
            # Written while the holders run: the first lane's holder fails it too.
            seven = await conn.fetchval(insert, "loans/7", "replay", '{"to": 0}', "pending", None)

            async def all_failed() -> bool:
                states = await conn.fetch(
                    "SELECT state FROM relay.commands WHERE id = ANY($1)", [bare, nine, seven]
                )
                return all(r["state"] == "failed" for r in states)

            await eventually(all_failed, timeout=30)
            rows = await conn.fetch("SELECT id, state, outcome FROM relay.commands ORDER BY id")
        errors = {r["id"]: json.loads(r["outcome"])["error"] for r in rows}
        assert {r["state"] for r in rows} == {"failed"}
        assert "bare name is none of its lanes (loans/0 to loans/2)" in errors[bare]
        assert "'loans/9' is not a lane of loans, which runs with 3 partition(s)" in errors[nine]
        assert "'loans/7' is not a lane of loans" in errors[seven]
        assert "stopped while carrying it out" in errors[gone]
        # None was carried out: every checkpoint stayed where the holders had it.
        assert all(row["checkpoint"] == positions[-1] for row in cli(config, "status"))
        assert not [r for r in relay.logs() if r.get("event") == "carrying out command"]
        shown = cli(config, "status")[0]["commands"]
        assert {(c["id"], c["state"], c["stuck"]) for c in shown} == {
            (bare, "failed", False),
            (nine, "failed", False),
            (gone, "failed", False),
            (seven, "failed", False),
        }
        table = run_cli(["status", "--config", str(config)]).stdout
        assert f"loans: command {seven} (replay of loans/7, asked" in table
        assert "failed: 'loans/7' is not a lane of loans" in table
    finally:
        await delete_stream(nats_url, stream)


async def test_a_followed_retry_whose_watch_cannot_connect_never_begins_the_command(
    tmp_path: Path,
) -> None:
    """A black-box attack cut `retry-parked --follow` off as it began: the command had been
    made before the watch's connection failed, was never awaited, and Python said so
    (`coroutine 'Operator.run' was never awaited`). It is now begun only once watched."""
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    config = load_config(save(tmp_path, config_dict(dead, "nats://127.0.0.1:1", "s")))
    begun: list[bool] = []

    async def command() -> None:
        begun.append(True)

    with pytest.raises(DatabaseUnavailable):
        await follow_retry(config, "loans", None, progress_view("t", "messages", True), command)
    assert begun == []
