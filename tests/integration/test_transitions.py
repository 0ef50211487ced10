"""Split outboxes through the transitions an operator goes through.

A change of K (by `relay repartition`, or by a rolling deploy whose new config says
another K), a rollout that adds an outbox, a fleet whose replicas run different outbox
sets, replicas that start at the same moment with different counts, a replica at its
`lease.max_per_replica`. Every promise must hold while the system moves: each committed
event reaches the stream, each aggregate's first deliveries keep their order, and one K
relays an outbox at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from relay.core.lanes import lanes_of
from relay.postgres.command_queue import CommandKind, CommandQueue, CommandRequest
from relay.postgres.partitions import PartitionsChanged
from tests.support.db import append, append_many, connect
from tests.support.delivery import Writer, append_backlog, book_lent, event_id
from tests.support.http import get, http_port
from tests.support.jetstream import STREAM_REFUSED, cap_messages, fetch_all
from tests.support.lanes import (
    LEASE,
    MESSAGES,
    Rows,
    delivered,
    delivered_all,
    held_by,
    relayed_more,
    report,
    shape,
    status,
    until,
)
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, eventually, migrate_cli, save

Start = Callable[..., RelayProcess]
REPLAY = CommandKind.REPLAY


def outbox(stream: str, k: int, **options: Any) -> dict[str, Any]:
    """The `loans` outbox of `config_dict`, with K partitions."""
    data = config_dict("unused", "unused", stream, messages=MESSAGES, partitions=k, **options)
    loans: dict[str, Any] = data["outboxes"]["loans"]
    loans["batch"] = {"max_messages": 50}
    return loans


@dataclass
class Configs:
    """Config files of one test's fleet: one database, one stream (`copies`)."""

    tmp_path: Path
    dsn: str
    nats_url: str
    stream: str
    made: int = 0

    def loans(self, k: int, *, lease: dict[str, Any] | None = None, **options: Any) -> Path:
        """A config with the `loans` outbox only, of K partitions."""
        self.made += 1
        outboxes = {"loans": outbox(self.stream, k, **options)}
        return self.of(f"loans-{self.made}-k{k}.yaml", outboxes, lease)

    def of(
        self, name: str, outboxes: dict[str, dict[str, Any]], lease: dict[str, Any] | None = None
    ) -> Path:
        data = config_dict(self.dsn, self.nats_url, self.stream, messages=MESSAGES)
        data["outboxes"] = outboxes
        data["lease"] = {**LEASE, **(lease or {})}
        return save(self.tmp_path, data, name)

    def side(self) -> dict[str, Any]:
        """An outbox `y` of the same events, its ids marked `/y`."""
        y = outbox(self.stream, 1)
        rule = y["messages"]["BookLent"]
        y["messages"] = {"BookLent": {**rule, "id": "{aggregate_type}/{aggregate_id}@{version}/y"}}
        return y


@pytest.fixture
def configs(tmp_path: Path, events_table: str, nats_url: str, copies: str) -> Configs:
    return Configs(tmp_path, events_table, nats_url, copies)


async def lane_rows(dsn: str, name: str = "loans") -> list[str]:
    """The outbox's checkpoint rows, by lane name."""
    async with connect(dsn) as conn:
        rows = await conn.fetch(
            "SELECT outbox FROM relay.checkpoints WHERE outbox = $1 OR outbox LIKE $1 || '/%'"
            " ORDER BY outbox",
            name,
        )
    return [r["outbox"] for r in rows]


async def copies_once_all_are_in(nats_url: str, stream: str, messages: int) -> set[int]:
    """How many copies of each id the stream holds, once it holds `messages` in all."""

    async def all_in() -> bool:
        return len(await fetch_all(nats_url, stream)) >= messages

    await eventually(all_in, timeout=30)
    return set(Counter(m.headers["ce-id"] for m in await fetch_all(nats_url, stream)).values())


async def recorded(dsn: str, name: str = "loans") -> int | None:
    async with connect(dsn) as conn:
        value = await conn.fetchval("SELECT partitions FROM relay.outboxes WHERE outbox = $1", name)
    return None if value is None else int(value)


def lane_names(k: int, name: str = "loans") -> list[str]:
    return sorted(lane.name for lane in lanes_of(name, k))


async def relayed_then_stopped(
    relay_process: Start, config: Path, dsn: str, nats_url: str, stream: str
) -> None:
    """60 events over 6 books, relayed by one replica of `config` that then stops
    gracefully, every lane's checkpoint at the head."""
    migrate_cli(config)
    backlog = await append_backlog(dsn, 60, aggregates=6)
    first = relay_process(["run", "--config", str(config)])
    await delivered(nats_url, stream, set(backlog.values()))
    await until(config, lambda rows: all(row["checkpoint"] == max(backlog) for row in rows))
    first.terminate()
    assert await first.wait_async(15) == 0


async def caught_up(dsn: str, rows: Rows) -> bool:
    """Every held lane's checkpoint is at the table's head."""
    async with connect(dsn) as conn:
        head = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
    return all(row["checkpoint"] == head for row in rows if row["holder"])


# -- 1. relay repartition and lanes that never ran ------------------------------------------


async def test_repartition_counts_a_lane_that_never_ran_from_where_it_would_have_started(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """K = 4 on one replica capped at two lanes: two lanes never run and have no row.
    `relay repartition` to 2 must not start the new lanes past their events."""
    stream = copies
    four = configs.loans(4, lease={"max_per_replica": 2})
    two = configs.loans(2)
    migrate_cli(four)
    backlog = await append_backlog(events_table, 400, aggregates=40)
    replica = relay_process(["run", "--config", str(four)])

    async def two_lanes_done() -> bool:
        rows = await status(four)
        held = [row for row in rows if row["holder"]]
        return len(held) == 2 and await caught_up(events_table, rows)

    await eventually(two_lanes_done, timeout=30)
    replica.terminate()
    assert await replica.wait_async(15) == 0
    done = run_cli(["repartition", "loans", "--partitions", "2", "--json", "--config", str(two)])
    assert done.returncode == 0, done.stderr
    relay_process(["run", "--config", str(two)])
    delivery = await delivered(nats_url, stream, set(backlog.values()))
    resent = report("repartition after lanes that never ran", delivery)
    assert resent == json.loads(done.stdout)["resent"], "the command said how many go again"


# -- 2. a replica with the old count, after a repartition ----------------------------------


async def test_a_replica_with_the_old_count_never_relays_a_repartitioned_outbox(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """The holder's lease session is cut; while it rests, the outbox goes from 4 to 2
    partitions. The replica, still configured for 4, must not relay it with 4."""
    stream = copies
    slow = {"retry_interval": "2s", "takeover_after": "5s"}
    four = configs.loans(4, lease=slow)
    two = configs.loans(2, lease=slow)
    migrate_cli(four)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        old = relay_process(["run", "--config", str(four)])
        await until(four, lambda rows: shape(rows) == [4])
        await relayed_more(four, writer)

        async def repartitioned() -> bool:
            """Cut its lease session, then repartition while it rests (2 x retry_interval);
            a slow start of the command misses the window, and the next cut opens another."""
            async with connect(events_table) as conn:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name LIKE '%:' || $1::text || ':lease'"
                    " AND datname = current_database()",
                    str(old.pid),
                )
            args = ["repartition", "loans", "--partitions", "2", "--config", str(two)]
            return (await asyncio.to_thread(run_cli, args)).returncode == 0

        await eventually(repartitioned, timeout=60, interval=0.1)
        new = relay_process(["run", "--config", str(two)])
        await until(two, lambda rows: len(held_by(rows, new)) == 2)
        await relayed_more(two, writer)
    delivery = await delivered_all(nats_url, stream, writer)
    report("old count after a repartition", delivery)
    assert await lane_rows(events_table) == lane_names(2), "no lane row of the old count"
    assert old.returncode is None, "the old replica stays up and says why it does not relay"
    assert any(
        "relay repartition" in json.dumps(r)
        for r in old.logs()
        if r.get("level") in ("warning", "error")
    )


# -- 3. a rollout that adds a split outbox with start: end ---------------------------------


async def test_a_rollout_that_adds_a_split_outbox_publishes_everything_after_its_first_claim(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """An old replica runs only `y`; a new one runs `y` and a new `loans` (K = 4,
    start: end). Every event committed after the new outbox's first claim goes out."""
    stream = copies
    y = configs.side()
    old_config = configs.of("y.yaml", {"y": y})
    new_config = configs.of("both.yaml", {"y": y, "loans": outbox(stream, 4, start="end")})
    migrate_cli(new_config)
    old = relay_process(["run", "--config", str(old_config)])
    await until(old_config, lambda rows: all(row["holder"] for row in rows))
    relay_process(["run", "--config", str(new_config)])
    await until(
        new_config,
        lambda rows: any(
            row["checkpoint"] is not None for row in rows if row["name"].startswith("loans/")
        ),
    )
    events = [book_lent(f"book-{i % 30}", i // 30 + 1) for i in range(300)]
    async with connect(events_table) as conn:
        for event in events:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
                " VALUES ($1, $2, $3, $4, $5::jsonb)",
                *event[:4],
                json.dumps(event.payload),
            )
    old.terminate()
    assert await old.wait_async(15) == 0
    expected = {event_id(e.aggregate_id, e.version) for e in events}
    delivery = await delivered(nats_url, stream, expected, keep=lambda i: not i.endswith("/y"))
    report("rollout adding a split outbox", delivery)


# -- 4. two counts at the same moment on a new outbox ---------------------------------------


@pytest.mark.parametrize(("first", "second"), [(2, 4), (1, 3), (5, 2)])
async def test_two_counts_started_at_the_same_moment_never_relay_side_by_side(
    *,
    first: int,
    second: int,
    events_table: str,
    nats_url: str,
    relay_process: Start,
    copies: str,
    configs: Configs,
) -> None:
    """Replicas of two counts start on a fresh outbox, released at the same instant: one
    count wins, the other replica relays nothing of it and creates no lane row."""
    stream = copies
    paths = {k: configs.loans(k) for k in (first, second)}
    migrate_cli(paths[first])
    backlog = await append_backlog(events_table, 200, aggregates=20)
    async with connect(events_table) as gate, connect(events_table) as watch:
        # Hold the relay's tables: both replicas queue behind this lock, then go together.
        # (Watched from another session: pg_stat_activity is read once per transaction.)
        tx = gate.transaction()
        await tx.start()
        await gate.execute("LOCK TABLE relay.outboxes, relay.checkpoints IN ACCESS EXCLUSIVE MODE")
        replicas = {k: relay_process(["run", "--config", str(path)]) for k, path in paths.items()}

        async def both_waiting() -> bool:
            waiting = await watch.fetchval(
                "SELECT count(DISTINCT a.pid) FROM pg_locks l"
                " JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE NOT l.granted AND a.application_name LIKE 'relay:%'"
            )
            return int(waiting) >= 2

        await eventually(both_waiting, timeout=30)
        await tx.rollback()

    async def decided() -> bool:
        return await recorded(events_table) is not None

    await eventually(decided)
    winner = await recorded(events_table)
    assert winner in (first, second)
    delivery = await delivered(nats_url, stream, set(backlog.values()))
    report(f"counts {first} and {second} at once, {winner} won", delivery)
    assert await lane_rows(events_table) == lane_names(winner), "lanes of one count only"
    loser = replicas[second if winner == first else first]
    assert held_by(await status(paths[winner]), loser) == []
    assert all(r.returncode is None for r in replicas.values())


# -- 5. a fleet whose replicas run different outbox sets ------------------------------------


async def test_lanes_stay_held_while_the_fleet_runs_different_outbox_sets(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """Replica A runs `loans` (K = 4); replica B, in the same namespace, runs only `y`.
    B does not run `loans`, so A keeps all four of its lanes."""
    stream = copies
    y = configs.side()
    a = configs.loans(4)
    b = configs.of("y.yaml", {"y": y})
    migrate_cli(a)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        relay_process(["run", "--config", str(a)])
        await until(a, lambda rows: shape(rows) == [4])
        relay_process(["run", "--config", str(b)])
        await until(b, lambda rows: all(row["holder"] for row in rows))
        await relayed_more(a, writer, events=60)
        await until(a, lambda rows: shape(rows) == [4])
    expected = set(writer.appended.values())
    await delivered(nats_url, stream, expected, keep=lambda i: not i.endswith("/y"))


async def test_a_replica_at_its_cap_leaves_no_lane_unheld_while_another_has_room(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """K = 4 over A (max_per_replica 1) and B (no cap): B holds three, above its share of
    two, because nobody else can; no lane stays unheld."""
    stream = copies
    capped = configs.loans(4, lease={"max_per_replica": 1})
    roomy = configs.loans(4)
    migrate_cli(capped)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        a = relay_process(["run", "--config", str(capped)])
        await until(capped, lambda rows: len(held_by(rows, a)) == 1)
        joined = time.time()
        b = relay_process(["run", "--config", str(roomy)])
        await until(roomy, lambda rows: shape(rows) == [3, 1])
        taken = [
            datetime.fromisoformat(r["timestamp"]).timestamp()
            for r in b.logs()
            if r.get("event") == "lease acquired: relaying"
        ]
        print(
            f"the lane nobody else could take was held {max(taken) - joined:.2f} s after the"
            " second replica started (retry_interval 300 ms)"
        )
        await relayed_more(roomy, writer)
    await delivered_all(nats_url, stream, writer)


# -- 6. CLI commands with a config whose count differs --------------------------------------


async def test_cli_commands_act_on_the_recorded_partitions_whatever_the_config_says(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    stream = copies
    two = configs.loans(2)
    four = configs.loans(4)
    migrate_cli(two)
    backlog = await append_backlog(events_table, 100, aggregates=10)
    replica = relay_process(["run", "--config", str(two)])
    await delivered(nats_url, stream, set(backlog.values()))
    await until(two, lambda rows: all(row["checkpoint"] == max(backlog) for row in rows))

    replay = run_cli(["replay", "loans", "--from-start", "--json", "--config", str(four)])
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["events"] == 100
    assert "runs with 2 partition(s)" in replay.stderr

    async def sent_twice() -> bool:
        return len(await fetch_all(nats_url, stream)) >= 200

    await eventually(sent_twice, timeout=30)
    delivery = await delivered(nats_url, stream, set(backlog.values()))
    assert len(delivery.ids) == 200, "each event sent once more, not more"
    assert await lane_rows(events_table) == lane_names(2)

    rows = await status(four)
    assert [row["name"] for row in rows] == lane_names(2)
    text = run_cli(["status", "--config", str(four)]).stdout
    assert "this config says 4" in text

    replica.terminate()
    assert await replica.wait_async(15) == 0
    async with connect(events_table) as conn:  # what an older relay could leave behind
        await conn.execute(
            "INSERT INTO relay.checkpoints (outbox, position) VALUES ('loans/2', 0), ('loans/3', 0)"
        )
    done = run_cli(["repartition", "loans", "--partitions", "4", "--config", str(four)])
    assert done.returncode == 0, done.stderr
    assert await lane_rows(events_table) == lane_names(4)
    assert delivery.order_violations == []


# -- changing K in a rolling deploy ---------------------------------------------------------


@pytest.mark.parametrize(("before", "after"), [(4, 2), (1, 3)])
async def test_a_rolling_deploy_that_changes_partitions_changes_over_by_itself(
    *,
    before: int,
    after: int,
    events_table: str,
    nats_url: str,
    relay_process: Start,
    copies: str,
    configs: Configs,
) -> None:
    """Two replicas of the old count; new ones come up one at a time, old ones leave one at
    a time (SIGTERM). The new replicas wait, Ready, until no replica runs the old count,
    then change the outbox over; no hand-run step, nothing lost, order kept."""
    stream = copies
    old = configs.loans(before)
    new = configs.loans(after)
    migrate_cli(old)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        olds = [relay_process(["run", "--config", str(old)]) for _ in range(2)]
        await until(old, lambda rows: all(row["holder"] for row in rows))
        await relayed_more(old, writer)
        first = relay_process(["run", "--config", str(new), "--http-port", "0"])
        port = await http_port(first)
        await first.wait_for_log(lambda r: "every live replica" in json.dumps(r))

        async def ready() -> bool:
            code, _ = await get(port, "/readyz")
            return code == 200

        await eventually(ready, timeout=20)
        _, metrics = await get(port, "/metrics")
        assert 'relay_partitions_mismatch{outbox="loans"} 1.0' in metrics
        text = run_cli(["status", "--config", str(new)]).stdout
        assert f"this config says {after}" in text
        olds[0].terminate()
        assert await olds[0].wait_async(15) == 0
        await relayed_more(old, writer)
        second = relay_process(["run", "--config", str(new)])
        await second.wait_for_log("not relaying the outbox: it runs with another partition count")
        last_old_stopped = time.time()
        olds[1].terminate()
        assert await olds[1].wait_async(15) == 0
        await until(
            new,
            lambda rows: (
                [row["name"] for row in rows] == lane_names(after)
                and all(row["holder"] for row in rows)
            ),
        )
        await relayed_more(new, writer)
        assert second.returncode is None
        taken = [
            datetime.fromisoformat(r["timestamp"]).timestamp()
            for replica in (first, second)
            for r in replica.logs()
            if r.get("event") == "lease acquired: relaying"
        ]
        print(
            f"{before} -> {after}: every new lane held {max(taken) - last_old_stopped:.2f} s"
            " after SIGTERM to the last old replica"
        )
    delivery = await delivered_all(nats_url, stream, writer)
    resent = report(f"rolling deploy {before} -> {after}", delivery)
    assert resent == 0, "the change-over re-sends nothing"
    assert await recorded(events_table) == after
    assert await lane_rows(events_table) == lane_names(after)
    _, metrics = await get(port, "/metrics")
    assert 'relay_partitions_mismatch{outbox="loans"} 0.0' in metrics


async def test_after_relay_repartition_a_replica_with_the_old_count_waits_instead_of_reverting(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """The operator's repartition stands: a replica started with the old count does not
    change it back, and says what to do; one with the new count relays."""
    stream = copies
    four = configs.loans(4)
    two = configs.loans(2)
    migrate_cli(four)
    backlog = await append_backlog(events_table, 100, aggregates=10)
    first = relay_process(["run", "--config", str(four)])
    await delivered(nats_url, stream, set(backlog.values()))
    first.terminate()
    assert await first.wait_async(15) == 0
    done = run_cli(["repartition", "loans", "--partitions", "2", "--config", str(two)])
    assert done.returncode == 0, done.stderr
    stale = relay_process(["run", "--config", str(four)])
    await stale.wait_for_log(lambda r: "relay repartition loans --partitions 4" in json.dumps(r))
    assert await recorded(events_table) == 2
    later = [book_lent(f"book-{i % 10 + 1}", 11 + i // 10) for i in range(50)]
    async with connect(events_table) as conn:
        await append_many(conn, later)
    more = {event_id(e.aggregate_id, e.version) for e in later}
    relay_process(["run", "--config", str(two)])
    await delivered(nats_url, stream, set(backlog.values()) | more)
    assert await recorded(events_table) == 2
    assert await lane_rows(events_table) == lane_names(2)
    assert held_by(await status(two), stale) == []


async def pinned(dsn: str, name: str = "loans") -> bool:
    async with connect(dsn) as conn:
        return bool(
            await conn.fetchval("SELECT pinned FROM relay.outboxes WHERE outbox = $1", name)
        )


async def test_a_cli_command_on_a_pinned_outbox_leaves_the_pin_in_place(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """Only a replica's claim ends an operator's pin. The CLI claims the pinned lanes
    itself to carry a replay out while no replica holds them; were that claim to end the
    pin, a replica still configured with the old count would change the outbox back at
    once, and the replayed range would go out a third time."""
    two, three = configs.loans(2), configs.loans(3)
    await relayed_then_stopped(relay_process, two, events_table, nats_url, copies)
    done = run_cli(["repartition", "loans", "--partitions", "3", "--config", str(three)])
    assert done.returncode == 0, done.stderr
    stale = relay_process(["run", "--config", str(two)])
    await stale.wait_for_log(lambda r: "relay repartition loans --partitions 2" in json.dumps(r))

    replay = await asyncio.to_thread(
        run_cli, ["replay", "loans", "--from-start", "--json", "--config", str(two)]
    )
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["events"] == 60
    assert await pinned(events_table), "the CLI's claim ended the operator's pin"
    assert await recorded(events_table) == 3

    fresh = relay_process(["run", "--config", str(three)])
    await until(three, lambda rows: held_by(rows, fresh) == lane_names(3))
    assert not await pinned(events_table), "a replica's claim with the pinned count ends it"
    assert await recorded(events_table) == 3
    assert await copies_once_all_are_in(nats_url, copies, 120) == {2}, "no third copy"
    assert held_by(await status(three), stale) == []


async def test_a_frozen_last_replica_of_the_old_count_does_not_stall_the_change_over(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """The last replica of the old count is paused (SIGSTOP) while it holds every lane: its
    heartbeat goes stale, so it is no longer live, and the new replicas end its session,
    as a standby ends a silent holder's, then change the outbox over."""
    stream = copies
    quick = {"takeover_after": "2s"}
    old = configs.loans(2, lease=quick)
    new = configs.loans(4, lease=quick)
    migrate_cli(old)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        frozen = relay_process(["run", "--config", str(old)])
        await until(old, lambda rows: shape(rows) == [2])
        await relayed_more(old, writer)
        fresh = relay_process(["run", "--config", str(new)])
        await fresh.wait_for_log("not relaying the outbox: it runs with another partition count")
        frozen.pause()
        try:
            await until(new, lambda rows: held_by(rows, fresh) == lane_names(4))
            await relayed_more(new, writer)
        finally:
            frozen.resume()
    delivery = await delivered_all(nats_url, stream, writer)
    resent = report("frozen last replica of the old count", delivery)
    assert resent <= 2 * 50, "at most the frozen replica's batches in flight"
    assert await lane_rows(events_table) == lane_names(4)


async def test_changes_in_quick_succession_send_nothing_twice_and_lose_nothing(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """Two lanes far apart (one stuck behind, say): 2 -> 3, then 3 -> 4 before any new lane
    moved. The lanes of the second change must still leave out what the lanes of the first
    count had published, and send everything else once."""
    stream = copies
    three = configs.loans(3)
    four = configs.loans(4)
    migrate_cli(four)
    backlog = await append_backlog(events_table, 40, aggregates=40)
    async with connect(events_table) as conn:
        lanes = {
            r["position"]: r["lane"]
            for r in await conn.fetch(
                "SELECT position, ((hashtextextended(aggregate_type || '/' || aggregate_id, 0)"
                " % 2) + 2) % 2 AS lane FROM events"
            )
        }
        # As a relay with two lanes leaves them: loans/0 at 30, loans/1 behind at 6.
        await conn.execute(
            "INSERT INTO relay.outboxes (outbox, partitions, start_position)"
            " VALUES ('loans', 2, 0); INSERT INTO relay.checkpoints (outbox, position)"
            " VALUES ('loans/0', 30), ('loans/1', 6)"
        )
    sent = {p for p, lane in lanes.items() if p <= 6 or (lane == 0 and p <= 30)}
    for path, k in ((three, 3), (four, 4)):
        done = run_cli(
            ["repartition", "loans", "--partitions", str(k), "--json", "--config", str(path)]
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["skipped"] == len(sent - set(range(7))), done.stdout
    relay_process(["run", "--config", str(four)])
    expected = {backlog[p] for p in backlog if p not in sent}
    delivery = await delivered(nats_url, stream, expected)
    assert report("2 -> 3 -> 4 in quick succession", delivery) == 0
    assert delivery.unexpected(expected) == [], "what the first lanes had sent is left out"


async def test_a_stray_replica_of_another_count_does_not_flip_the_fleet_when_sessions_are_cut(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """Two replicas run K = 4, a stray one K = 1. Every relay session is ended: the
    replicas reconnect one by one, and the stray one, first back, must not take the
    others' fresh heartbeats for gone and change the outbox to 1."""
    four, one = configs.loans(4), configs.loans(1)
    migrate_cli(four)
    async with Writer(events_table, rate=60, aggregates=12) as writer:
        fleet = [relay_process(["run", "--config", str(four)]) for _ in range(2)]
        await until(four, lambda rows: all(row["holder"] for row in rows))
        stray = relay_process(["run", "--config", str(one)])
        await stray.wait_for_log("not relaying the outbox: it runs with another partition count")
        for _ in range(3):
            async with connect(events_table) as conn:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name LIKE 'relay:%' AND pid <> pg_backend_pid()"
                    " AND datname = current_database()"  # the shared server's other tests'
                )
            await relayed_more(four, writer)
    assert await recorded(events_table) == 4
    assert not any(r.get("event", "").startswith("partitions changed over") for r in stray.logs())
    assert all(replica.returncode is None for replica in (*fleet, stray))
    await delivered_all(nats_url, copies, writer)


async def test_a_replay_waiting_for_a_holder_when_the_outbox_changes_over_reaches_every_event(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """`relay replay --from-start` is waiting for the holder to take it when the holder
    leaves and the outbox changes over to another count: the command expires with the old
    lanes, and the CLI carries it out on the new ones, so every event goes out again."""
    old, new = configs.loans(2), configs.loans(3)
    migrate_cli(old)
    backlog = await append_backlog(events_table, 120, aggregates=12)
    holder = relay_process(["run", "--config", str(old)])
    await delivered(nats_url, copies, set(backlog.values()))
    await until(old, lambda rows: all(row["checkpoint"] == max(backlog) for row in rows))
    waiting = relay_process(["run", "--config", str(new)])
    await waiting.wait_for_log("not relaying the outbox: it runs with another partition count")
    holder.pause()  # it takes no command
    replay = relay_process(["replay", "loans", "--from-start", "--json", "--config", str(old)])
    async with connect(events_table) as conn:

        async def submitted() -> bool:
            return bool(await conn.fetchval("SELECT count(*) FROM relay.commands"))

        await eventually(submitted)
    # It leaves before it could take the command (SIGTERM is pending when it wakes, and a
    # replica that is stopping takes no new command): the waiting replica changes over.
    holder.terminate()
    holder.resume()
    assert await replay.wait_async(60) == 0, replay.output()
    assert json.loads(replay.stdout_path.read_text())["events"] == 120

    copies_each = await copies_once_all_are_in(nats_url, copies, 240)
    assert copies_each == {2}, "every event once more, none left out"
    assert await recorded(events_table) == 3


async def test_a_command_asked_of_a_lane_of_the_old_count_never_reaches_the_new_lane_of_its_name(
    events_table: str, configs: Configs
) -> None:
    """The CLI asks each lane in turn. If the outbox changes over between two of them, the
    request for the next old lane (`loans/1` of 2) must not be taken by the new lane of the
    same name (`loans/1` of 3 holds other aggregates): a replay would then skip a third of
    the events. It is refused, so the CLI carries the command out on the new lanes; one
    asked while a change is being committed waits for it and is refused too."""
    old = configs.loans(2)
    migrate_cli(old)
    done = run_cli(["repartition", "loans", "--partitions", "3", "--config", str(old)])
    assert done.returncode == 0, done.stderr
    queue = CommandQueue("relay")
    replay = {"to": 0}
    async with connect(events_table) as conn, connect(events_table) as change:
        with pytest.raises(PartitionsChanged, match="3 partition"):
            await queue.submit(
                conn, CommandRequest(lanes_of("loans", 2)[1], REPLAY, replay, "test")
            )
        assert await queue.submit(
            conn, CommandRequest(lanes_of("loans", 3)[1], REPLAY, replay, "test")
        )
        # A change in its transaction, as `relay repartition` and the change-over hold it.
        changing = change.transaction()
        await changing.start()
        await change.execute("SELECT 1 FROM relay.outboxes WHERE outbox = 'loans' FOR UPDATE")
        await change.execute("UPDATE relay.outboxes SET partitions = 2 WHERE outbox = 'loans'")
        asked = asyncio.create_task(
            queue.submit(conn, CommandRequest(lanes_of("loans", 3)[2], REPLAY, replay, "test"))
        )
        try:

            async def waits_for_the_change() -> bool:
                return bool(
                    await change.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()"
                    )
                )

            await eventually(waits_for_the_change)
            await changing.commit()
            with pytest.raises(PartitionsChanged, match="2 partition"):
                await asked
        finally:
            asked.cancel()
        rows = await conn.fetch("SELECT outbox FROM relay.commands ORDER BY id")
    assert [r["outbox"] for r in rows] == ["loans/1"], "only the request of the count in force"


async def test_a_replay_that_times_out_on_one_lane_says_which_lanes_it_already_moved(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """The CLI asks each lane in turn. When the holder of the second does not answer in
    time, the first lane's replay has happened: the error must say so, not that nothing
    was changed (found attacking: an operator was told nothing happened while one lane
    re-sent 1,080 events). The paused holder stays the holder: a minute passes before the
    other replica may end it as silent, whatever the machine's load."""
    config = configs.loans(2, lease={"max_per_replica": 1, "takeover_after": "60s"})
    migrate_cli(config)
    backlog = await append_backlog(events_table, 40, aggregates=8)
    one = relay_process(["run", "--config", str(config)])
    two = relay_process(["run", "--config", str(config)])
    await delivered(nats_url, copies, set(backlog.values()))
    await until(config, lambda rows: shape(rows) == [1, 1])
    rows = await status(config)
    stuck = one if held_by(rows, one) == ["loans/1"] else two
    assert held_by(rows, stuck) == ["loans/1"]
    stuck.pause()
    try:
        done = await asyncio.to_thread(
            run_cli, ["replay", "loans", "--from-start", "--timeout", "3", "--config", str(config)]
        )
    finally:
        stuck.resume()
    assert done.returncode == 1, done.stderr
    assert "nothing was changed" not in done.stderr, done.stderr
    assert "already carried out on loans/0" in done.stderr, done.stderr


async def test_a_message_being_retried_keeps_its_count_of_failures_across_a_change(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """A message the stream refuses (above its max_msg_size) is retried; the outbox goes from
    2 to 3 partitions meanwhile. Its failures so far still count towards `park_after`."""
    slow: dict[str, Any] = {"retry": {"initial": "100ms", "max": "100ms"}, "park_after": 1000}
    two, three = configs.loans(2, **slow), configs.loans(3, **slow)
    migrate_cli(two)
    await cap_messages(nats_url, copies)
    async with connect(events_table) as conn:
        poison = await append(conn, "book", "big", 1, "BookLent", {"loanId": "x" * STREAM_REFUSED})
    replica = relay_process(["run", "--config", str(two)])

    async def failures() -> int:
        async with connect(events_table) as conn:
            value = await conn.fetchval(
                "SELECT max(attempts) FROM relay.checkpoints WHERE retry_position = $1", poison
            )
        return int(value or 0)

    await eventually(lambda: _at_least(failures(), 5), timeout=30)
    replica.terminate()
    assert await replica.wait_async(15) == 0
    before = await failures()
    done = run_cli(["repartition", "loans", "--partitions", "3", "--config", str(three)])
    assert done.returncode == 0, done.stderr
    assert await failures() == before, "the count moved to the lane that owns the aggregate"


async def _at_least(value: Awaitable[int], least: int) -> bool:
    return await value >= least


@dataclass
class Replica:
    """A replica's heartbeat row and nothing else: live to the fleet, holding no lane."""

    dsn: str
    count: int
    identity: str = "relay:about-to-change:1"

    async def beat(self) -> None:
        """Keep the row fresh until cancelled."""
        async with connect(self.dsn) as conn:
            await conn.execute(
                "INSERT INTO relay.replicas (identity, namespace, pid, seen_at, outboxes)"
                " VALUES ($1, 'relay', 0, now(), $2::jsonb)",
                self.identity,
                json.dumps({"loans": self.count}),
            )
            while True:
                await conn.execute(
                    "UPDATE relay.replicas SET seen_at = now() WHERE identity = $1", self.identity
                )
                await asyncio.sleep(0.25)


async def test_the_cli_leaves_a_command_to_a_fleet_about_to_change_the_count_over(
    events_table: str, nats_url: str, relay_process: Start, copies: str, configs: Configs
) -> None:
    """No replica holds the outbox's lanes, and every live replica that runs it says another
    count: they change it over as soon as its lanes are free. A replay carried out by the CLI
    on an old lane meanwhile would be carried out again on the new ones (a third copy of
    that lane's events), so the CLI waits for the change, and then asks the new lanes."""
    old, new = configs.loans(2), configs.loans(3)
    await relayed_then_stopped(relay_process, old, events_table, nats_url, copies)
    beating = asyncio.create_task(Replica(events_table, 3).beat())
    try:
        async with connect(events_table) as conn:

            async def beating_now() -> bool:
                return bool(await conn.fetchval("SELECT count(*) FROM relay.replicas"))

            await eventually(beating_now)
        timed_out = await asyncio.to_thread(
            run_cli, ["replay", "loans", "--from-start", "--timeout", "3", "--config", str(old)]
        )
        assert timed_out.returncode == 1, timed_out.stderr
        assert "changing over" in timed_out.stderr, timed_out.stderr
        assert len(await fetch_all(nats_url, copies)) == 60, "nothing was replayed"
        replay = relay_process(["replay", "loans", "--from-start", "--json", "--config", str(old)])
        await replay.wait_for_log(
            "waiting for the outbox to change over before carrying the command out"
        )
        relay_process(["run", "--config", str(new)])
        assert await replay.wait_async(60) == 0, replay.output()
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
    assert json.loads(replay.stdout_path.read_text())["events"] == 60

    copies_each = await copies_once_all_are_in(nats_url, copies, 120)
    assert copies_each == {2}, "every event once more, on the new lanes only"
    assert await recorded(events_table) == 3
