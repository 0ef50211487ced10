"""An older replica meets a newer release's rows (docs/upgrading.md), and keeps relaying.

During a rolling upgrade, replicas of release N-1 run beside those of N and read the rows N
writes in the relay's tables. Each test here writes, through SQL, a row this release cannot
read as it stands: a kind, args or state of a command it does not know, a partition count
outside what it knows, a heartbeat of another shape, a parked message with an unknown reason
and NULLs, a checkpoint's state and skip of a newer shape. Where the table's CHECK would
refuse it, the check is dropped first, standing in for the one N's migration widened. A real
relay (a process of its own) runs throughout: it must go on relaying, and `relay status`
must work, never a crash and never a crash loop.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema

from relay.runtime.status_page import page_file
from tests.support.db import NewEvent, append_many, connect
from tests.support.delivery import wait_for_count
from tests.support.jetstream import create_stream, unique_name
from tests.support.operator_cli import cli
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, eventually, migrate_cli, save


@dataclass
class Relaying:
    """A relay process on an outbox `loans` of its own stream, and the events sent so far."""

    dsn: str
    nats_url: str
    config: Path
    stream: str
    relay: RelayProcess
    sent: int = 0

    async def still_relaying(self, aggregate_type: str = "book") -> None:
        """New events reach the stream, and the relay process has not exited."""
        data = {"loanId": "L", "memberId": "m"}
        loans = [
            NewEvent(aggregate_type, f"n{self.sent + i}", 1, "BookLent", data) for i in range(3)
        ]
        async with connect(self.dsn) as conn:
            await append_many(conn, loans)
        self.sent += len(loans)
        await wait_for_count(
            self.nats_url, self.stream, lambda n: n >= self.sent, process=self.relay
        )
        assert self.relay.returncode is None, self.relay.output()

    async def passes(self, count: int = 2) -> None:
        """Until the replica has begun `count` looks at its lanes from now (each begins with
        its heartbeat), so that what the database holds now was read."""
        async with connect(self.dsn) as conn:
            for _ in range(count):
                since = await conn.fetchval("SELECT clock_timestamp()")

                async def beat(since: Any = since) -> bool:
                    assert self.relay.returncode is None, self.relay.output()
                    return bool(
                        await conn.fetchval(
                            "SELECT EXISTS (SELECT 1 FROM relay.replicas WHERE identity LIKE $1"
                            " AND seen_at > $2)",
                            f"%:{self.relay.pid}",
                            since,
                        )
                    )

                await eventually(beat, timeout=30)

    def status(self) -> list[dict[str, Any]]:
        """`relay status` works, as a table and as JSON; the JSON rows."""
        table = run_cli(["status", "--config", str(self.config)])
        assert table.returncode == 0, table.stdout + table.stderr
        assert "Traceback" not in table.stderr
        rows: list[dict[str, Any]] = cli(self.config, "status")
        return rows

    def status_page(self) -> dict[str, Any]:
        """The running relay's `/status.json`."""
        record = next(r for r in self.relay.logs() if r.get("event") == "http listening")
        url = f"http://127.0.0.1:{record['port']}/status.json"
        with urllib.request.urlopen(url, timeout=10) as answer:
            page: dict[str, Any] = json.loads(answer.read())
        return page


async def relaying(
    dsn: str, nats_url: str, tmp_path: Path, relay_process: Any, *, returns: bool = False
) -> Relaying:
    """A relay of `loans` (books), and with `returns` of a second outbox (magazines)."""
    stream = unique_name("newer")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    data = config_dict(dsn, nats_url, stream, aggregates=["book"])
    if returns:
        data["outboxes"]["returns"] = {**data["outboxes"]["loans"], "aggregates": ["magazine"]}
    config = save(tmp_path, data)
    migrate_cli(config)
    relay = relay_process(["run", "--config", str(config)])
    running = Relaying(dsn, nats_url, config, stream, relay)
    await running.still_relaying()
    return running


async def command(
    conn: asyncpg.Connection, kind: str, args: Any, *, state: str = "pending", age: str = "0s"
) -> int:
    """A command row as a newer release's CLI would write it, `age` old."""
    return int(
        await conn.fetchval(
            "INSERT INTO relay.commands (outbox, kind, args, requested_by, state, requested_at)"
            " VALUES ('loans', $1, $2::jsonb, 'newer', $3, now() - $4::text::interval)"
            " RETURNING id",
            kind,
            json.dumps(args),
            state,
            age,
        )
    )


async def commands(dsn: str) -> dict[int, asyncpg.Record]:
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT id, kind, state, outcome FROM relay.commands")
    return {row["id"]: row for row in rows}


async def test_commands_a_newer_release_wrote_are_left_to_it_then_failed(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A kind it does not know, args with a key it does not know, a state it does not know:
    the holder takes none of them and carries on, taking the commands it knows past them.
    Once one has waited long enough for a replica that knows it, it is failed, saying why."""
    fleet = await relaying(events_table, nats_url, tmp_path, relay_process)
    async with connect(events_table) as conn:
        await conn.execute(
            "ALTER TABLE relay.commands DROP CONSTRAINT commands_kind_check,"
            " DROP CONSTRAINT commands_state_check"
        )
        waiting = [
            await command(conn, "pause", {}),
            await command(conn, "replay", {"to": 0, "dry_run": True}),
        ]
        queued = await command(conn, "replay", {"to": 0}, state="queued")
        await conn.execute("SELECT pg_notify('relay_commands', 'loans')")
    await fleet.still_relaying()
    done = cli(fleet.config, "retry-parked", "loans", "--all")  # one it knows, after them
    assert done["ok"] is True and done["executed_by"].endswith(f":{fleet.relay.pid}"), done
    await fleet.still_relaying()
    rows = await commands(events_table)
    assert [rows[i]["state"] for i in [*waiting, queued]] == ["pending", "pending", "queued"]
    assert await wait_for_count(nats_url, fleet.stream, lambda n: n >= fleet.sent) == fleet.sent

    async with connect(events_table) as conn:
        stale = [
            await command(conn, "pause", {}, age="1 hour"),
            await command(conn, "replay", {"to": 0, "dry_run": True}, age="1 hour"),
        ]
        await conn.execute("SELECT pg_notify('relay_commands', 'loans')")

    async def failed() -> bool:
        rows = await commands(events_table)
        return all(rows[i]["state"] == "failed" for i in stale)

    await eventually(failed, timeout=30)
    rows = await commands(events_table)
    pause, extra = (json.loads(rows[i]["outcome"])["error"] for i in stale)
    assert "kind 'pause'" in pause and "no replica that knows it took it" in pause, pause
    assert "'dry_run'" in extra and "no replica that knows it took it" in extra, extra
    assert [rows[i]["state"] for i in [*waiting, queued]] == ["pending", "pending", "queued"]
    await fleet.still_relaying()
    assert fleet.status()[0]["state"] in ("relaying", "caught up")


async def test_heartbeats_of_a_shape_it_does_not_know_are_not_read_as_its_own(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Live replicas whose `outboxes` is another shape (a list, an object per outbox, a
    string), or whose room is NULL: this replica shares no lane with what it cannot read,
    changes no count for it, and `relay status` and the status page still read the fleet."""
    fleet = await relaying(events_table, nats_url, tmp_path, relay_process)
    shapes = {
        "newer-list": '["loans"]',
        "newer-object": '{"loans": {"partitions": 1, "weight": 2}}',
        "newer-text": '"loans"',
    }
    async with connect(events_table) as conn:
        for identity, outboxes in shapes.items():
            await conn.execute(
                "INSERT INTO relay.replicas (identity, namespace, pid, seen_at, outboxes, room)"
                " VALUES ($1, 'relay', pg_backend_pid(), now() + interval '1 hour', $2::jsonb,"
                " NULL)",
                identity,
                outboxes,
            )
        await fleet.passes()
        await fleet.still_relaying()
        rows = fleet.status()
        page = fleet.status_page()
    assert rows[0]["waiting_replicas"] == [], rows
    assert rows[0]["holder"] is not None
    assert {r["identity"] for r in page["replicas"]} >= set(shapes)


async def test_a_partition_count_it_cannot_run_leaves_that_outbox_to_a_newer_release(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A partition set of 0 or NULL partitions (its CHECK and NOT NULL dropped): this replica
    lets go of that outbox's lanes, says why, and never changes the record over; its other
    outbox goes on. Once the record holds a count it can run, it relays the outbox again."""
    fleet = await relaying(events_table, nats_url, tmp_path, relay_process, returns=True)
    async with connect(events_table) as conn:
        await conn.execute(
            "ALTER TABLE relay.outboxes DROP CONSTRAINT outboxes_partitions_check,"
            " ALTER COLUMN partitions DROP NOT NULL"
        )
    for written, shown in [("0", "0"), ("NULL", "NULL")]:
        async with connect(events_table) as conn:
            await conn.execute(
                f"UPDATE relay.outboxes SET partitions = {written} WHERE outbox = 'loans'"
            )

        async def let_go() -> bool:
            assert fleet.relay.returncode is None, fleet.relay.output()
            return fleet.status()[0]["holder"] is None

        await eventually(let_go, timeout=30)
        loans, returns = fleet.status()
        assert f"holds {shown} partitions, a count this release cannot run" in str(
            loans["waiting_replicas"]
        ), loans
        assert returns["holder"] is not None, returns
        await fleet.passes()
        await fleet.still_relaying("magazine")
        async with connect(events_table) as conn:
            recorded = "SELECT partitions::text FROM relay.outboxes WHERE outbox = 'loans'"
            assert await conn.fetchval(recorded) == (None if written == "NULL" else written)
        replay = run_cli(["replay", "loans", "--from-start", "--config", str(fleet.config)])
        assert replay.returncode == 1, replay.stdout + replay.stderr
        assert "a count this release cannot run" in replay.stderr, replay.stderr
    async with connect(events_table) as conn:
        await conn.execute("UPDATE relay.outboxes SET partitions = 1 WHERE outbox = 'loans'")
    await fleet.still_relaying()


async def test_parked_messages_with_an_unknown_reason_and_nulls_are_listed_and_retried(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A reason this release does not know, and NULL in every column a newer release might
    leave empty (their NOT NULL dropped): `relay status`, `relay parked list` and `show` and
    the status page read them, and `retry-parked` publishes them again through the holder."""
    fleet = await relaying(events_table, nats_url, tmp_path, relay_process)
    async with connect(events_table) as conn:
        await conn.execute(
            "ALTER TABLE relay.parked ALTER COLUMN reason DROP NOT NULL,"
            " ALTER COLUMN error DROP NOT NULL, ALTER COLUMN attempts DROP NOT NULL,"
            " ALTER COLUMN rule DROP NOT NULL, ALTER COLUMN parked_at DROP NOT NULL"
        )
        ids = [
            await conn.fetchval(
                "INSERT INTO relay.parked (outbox, position, reason, error, attempts, rule,"
                " parked_at) VALUES ('loans', $1, $2, $3, $4, $5, $6) RETURNING id",
                *row,
            )
            for row in [
                (1, "quarantined", "held by a newer release's rule", 1, "", None),
                (2, None, None, None, None, None),
            ]
        ]
        await conn.execute("UPDATE relay.parked SET parked_at = now() WHERE id = $1", ids[0])
    rows = fleet.status()
    assert rows[0]["parked"] == 2, rows
    listed = cli(fleet.config, "parked", "list", "loans")
    assert [(p["id"], p["reason"]) for p in listed] == [(ids[0], "quarantined"), (ids[1], None)]
    for id_ in ids:
        assert cli(fleet.config, "parked", "show", str(id_))["id"] == id_
        shown = run_cli(["parked", "show", str(id_), "--config", str(fleet.config)])
        assert shown.returncode == 0, shown.stdout + shown.stderr
    table = run_cli(["parked", "list", "loans", "--config", str(fleet.config)])
    assert table.returncode == 0, table.stdout + table.stderr
    page = fleet.status_page()
    jsonschema.validate(page, json.loads(page_file("status.schema.json")))
    assert {p["id"] for p in page["parked"]} == set(ids)
    retried = cli(fleet.config, "retry-parked", "loans", "--all")
    assert retried["ok"] is True and sorted(retried["detail"]["published"]) == sorted(ids)
    await fleet.still_relaying()
    assert fleet.status()[0]["parked"] == 0


async def test_a_checkpoint_with_a_state_and_a_skip_of_a_newer_shape(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A skip of another shape: a replica that claims the lane (here, after a restart) reads
    it as none, says so, and relays on (what it covers goes out again: a duplicate, never a
    loss). A state and a `blocking` of another shape: `relay status` and the status page
    show the state as written and leave out the detail they cannot read."""
    fleet = await relaying(events_table, nats_url, tmp_path, relay_process)
    fleet.relay.terminate()
    assert await fleet.relay.wait_async(30) == 0, fleet.relay.output()
    async with connect(events_table) as conn:
        await conn.execute(
            "UPDATE relay.checkpoints"
            """ SET skip = '{"layers": [{"partitions": 2, "positions": [100, 200]}]}'"""
        )
    fleet.relay = relay_process(["run", "--config", str(fleet.config)])
    await fleet.relay.wait_for_log(lambda r: "the checkpoint's skip" in r.get("event", ""))
    await fleet.still_relaying()
    for blocking in ['["newer"]', '{"pid": 7, "transaction_age": "long"}']:
        async with connect(events_table) as conn:
            await conn.execute(
                "UPDATE relay.checkpoints SET state = 'draining', blocking = $1::jsonb", blocking
            )
        (row,) = fleet.status()
        assert row["state"] == "draining", row
        shown = row["blocking_transaction"]
        assert shown is None if blocking.startswith("[") else shown["pid"] == 7, row
        assert fleet.status_page()["lanes"][0]["state"] == "draining"
    await fleet.still_relaying()
    assert fleet.status()[0]["state"] in ("relaying", "caught up")
