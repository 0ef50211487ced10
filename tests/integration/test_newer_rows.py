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
