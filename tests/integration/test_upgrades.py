"""Upgrading from the previous release (named in release/previous) to this checkout.

The previous release's own code runs here, unpacked from git (tests/support/previous_release.py):
it creates the schema, relays, parks, retries. Then this release migrates that schema and
takes over, the way docs/upgrading.md tells operators to upgrade. The rolling upgrade is the
check that enforces the rule every migration must follow (expand, then contract): replicas
of the previous release must keep relaying, and start, against this release's schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import StreamConfig

from relay.config import load_config
from relay.postgres.migrations import LATEST, STEPS, migrate
from tests.support.db import NewEvent, append, append_many, connect
from tests.support.delivery import (
    Delivery,
    Writer,
    append_backlog,
    book_lent,
    event_id,
    wait_for_count,
)
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import delete_stream, unique_name
from tests.support.lane_watch import LaneWatch
from tests.support.lanes import LEASE, MESSAGES, delivered, report
from tests.support.previous_release import (
    PreviousRelease,
    dependency_drift,
    previous_commit,
    unpack,
)
from tests.support.relay_process import CURRENT, RelayProcess, run_cli
from tests.support.scenario import config_dict, eventually, save, write_config

# A message the streams refuse for good until the test raises their limit: 32 KB of loan id
# against a 16 KB max_msg_size (NATS error 10054, a permanent rejection the relay counts).
LIMIT = 16 * 1024
HEAVY = {"loanId": "x" * 32 * 1024, "memberId": "m"}
PARKED = NewEvent("magazine", "heavy-1", 1, "BookLent", HEAVY)  # the plain outbox's only
RETRIED = NewEvent("journal", "heavy-1", 1, "BookLent", HEAVY)  # the split outbox's only
SPLIT = 3
BATCH = 50
OUTBOXES = {"loans": 1, "split": SPLIT}


def message_id(event: NewEvent) -> str:
    return f"{event.aggregate_type}/{event.aggregate_id}@{event.version}"


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> PreviousRelease:
    """The previous release's code, unpacked once for the module."""
    return unpack(tmp_path_factory.mktemp("previous-release"))


@pytest.fixture
async def streams(nats_url: str) -> AsyncIterator[tuple[str, str]]:
    """Two streams keeping re-sent copies (100 ms duplicate window), with a small size limit:
    the plain outbox's and the split outbox's."""
    names = (unique_name("plain"), unique_name("split"))
    async with nats_connect(nats_url) as nc:
        for name in names:
            config = StreamConfig(
                name=name, subjects=[f"{name}.>"], duplicate_window=0.1, max_msg_size=LIMIT
            )
            await nc.jetstream().add_stream(config)
    try:
        yield names
    finally:
        for name in names:
            await delete_stream(nats_url, name)


async def lift_limits(nats_url: str, names: Sequence[str]) -> None:
    """The operator's fix: the streams take large messages from now on."""
    async with nats_connect(nats_url) as nc:
        js = nc.jetstream()
        for name in names:
            info = await js.stream_info(name)
            await js.update_stream(dataclasses.replace(info.config, max_msg_size=-1))


def fleet_config(
    tmp_path: Path, dsn: str, nats_url: str, streams: tuple[str, str], *, split_parks: bool
) -> Path:
    """`loans` (one lane, parks magazines after 2 refusals) to the first stream; `split`
    (3 lanes, journals) to the second, parking after 2 refusals or retrying for ever."""
    plain, split = streams

    def outbox(stream: str, **options: Any) -> dict[str, Any]:
        data = config_dict(dsn, nats_url, stream, messages=MESSAGES, **options)
        rules: dict[str, Any] = data["outboxes"]["loans"]
        rules["batch"] = {"max_messages": BATCH}
        return rules

    data = config_dict(dsn, nats_url, plain, messages=MESSAGES)
    data["outboxes"] = {
        "loans": outbox(plain, aggregates=["book", "magazine"], park_after=2),
        "split": outbox(
            split,
            aggregates=["book", "journal"],
            partitions=SPLIT,
            park_after=2 if split_parks else 1_000_000,
        ),
    }
    data["lease"] = LEASE
    return save(tmp_path, data, f"fleet-{split_parks}.yaml")


class Fleet:
    """Replicas and commands of either release, each replica named (POD_NAME) for the logs."""

    def __init__(self, previous: PreviousRelease, config: Path, log_dir: Path) -> None:
        self.previous = previous
        self.config = config
        self.log_dir = log_dir
        self.processes: list[RelayProcess] = []

    def start(self, name: str, *, old: bool) -> RelayProcess:
        env = {"POD_NAME": name, **(self.previous.env if old else {})}
        relay = self.previous.relay if old else CURRENT
        args = ["run", "--config", str(self.config)]
        process = RelayProcess(args, self.log_dir / name, env, relay)
        self.processes.append(process)
        return process

    async def cli(self, *args: str, old: bool = False) -> dict[str, Any] | list[Any]:
        """A one-shot command of either release, with --json; it must succeed. With --wait
        it prints progress lines first: the last line is the outcome."""
        relay = self.previous.relay if old else CURRENT
        env = self.previous.env if old else None
        command = [*args, "--json", "--config", str(self.config)]
        result = await asyncio.to_thread(run_cli, command, env, 120, relay)
        assert result.returncode == 0, f"relay {' '.join(args)}: {result.stderr}"
        wait = "--wait" in args
        parsed: dict[str, Any] | list[Any] = json.loads(
            result.stdout.splitlines()[-1] if wait else result.stdout
        )
        return parsed

    def migrate(self, *, old: bool) -> None:
        relay = self.previous.relay if old else CURRENT
        env = self.previous.env if old else None
        result = run_cli(["migrate", "--config", str(self.config)], env, 120, relay)
        assert result.returncode == 0, f"relay migrate (old={old}): {result.stderr}"

    def kill_all(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture
def fleet(previous: PreviousRelease, tmp_path: Path) -> Iterator[Callable[[Path], Fleet]]:
    made: list[Fleet] = []

    def make(config: Path) -> Fleet:
        made.append(Fleet(previous, config, tmp_path))
        return made[-1]

    yield make
    for each in made:
        each.kill_all()


async def stop(process: RelayProcess) -> None:
    """SIGTERM, as Kubernetes stops a pod; a graceful stop exits 0."""
    process.terminate()
    assert await process.wait_async(30) == 0, process.output()


async def joined(dsn: str, *replicas: RelayProcess) -> None:
    """Wait until each replica is in the live set (relay.replicas), as a pod's readiness
    gates a rolling update's next step; one that exits meanwhile fails the test with its
    output (an old release refusing the new schema says so there)."""

    async def listed() -> bool:
        for replica in replicas:
            assert replica.returncode is None, f"exited {replica.returncode}\n{replica.output()}"
        async with connect(dsn) as conn:
            rows = await conn.fetch("SELECT identity FROM relay.replicas")
        live = {str(r["identity"]).rpartition(":")[2] for r in rows}
        return all(str(replica.pid) in live for replica in replicas)

    await eventually(listed, timeout=60)


async def checkpoints(dsn: str) -> dict[str, dict[str, Any]]:
    """Each lane's checkpoint row."""
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT * FROM relay.checkpoints")
    return {row["outbox"]: dict(row) for row in rows}


async def parked_ids(dsn: str) -> dict[str, str]:
    """Parked message ids, by the lane that parked them."""
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT outbox, message_id FROM relay.parked ORDER BY id")
    return {row["message_id"]: row["outbox"] for row in rows}


async def head(dsn: str) -> int:
    async with connect(dsn) as conn:
        return int(await conn.fetchval("SELECT coalesce(max(position), 0) FROM events"))


# -- the previous release, as the tests run it ---------------------------------------------


def test_the_previous_release_runs_its_own_code_on_this_venv(previous: PreviousRelease) -> None:
    """The old tree is imported, not this checkout; and it needs nothing this venv lacks."""
    assert previous.commit == previous_commit()
    probe = [*previous.relay[:2], "-c", "import relay; print(relay.__file__)"]
    result = run_cli([], previous.env, 60, probe)
    assert result.stdout.strip() == str(previous.tree / "relay" / "__init__.py"), result.stderr
    assert dependency_drift(previous) == {}, (
        "the previous release's runtime dependencies differ from this release's: it cannot"
        " run on this venv; give it a venv of its own in tests/support/previous_release.py"
    )


# -- the schema: everything the previous release wrote survives `relay migrate` -------------


async def table_rows(dsn: str) -> Tables:
    """Every row of every table in the relay's schema, as JSON."""
    async with connect(dsn) as conn:
        tables = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'relay'"
            " AND table_type = 'BASE TABLE' ORDER BY table_name"
        )
        return {
            t["table_name"]: [
                json.loads(r[0])
                for r in await conn.fetch(
                    f'SELECT to_jsonb(t)::text FROM relay."{t["table_name"]}" t ORDER BY 1'
                )
            ]
            for t in tables
        }


Tables = dict[str, list[dict[str, Any]]]


def lost(before: Tables, after: Tables) -> list[tuple[str, dict[str, Any]]]:
    """Rows of `before` that `after` no longer holds with every old column's value."""
    gone = []
    for table, rows in before.items():
        for row in rows:
            kept = [r for r in after.get(table, []) if r.items() >= row.items()]
            if not kept:
                gone.append((table, row))
    return gone


async def test_migrate_keeps_everything_the_previous_release_wrote(
    events_table: str,
    nats_url: str,
    streams: tuple[str, str],
    fleet: Callable[[Path], Fleet],
    tmp_path: Path,
) -> None:
    """The previous release migrates, relays a backlog over a plain and a split outbox and
    parks one message in each. This release's `relay migrate` keeps every row; its replica
    goes on from the old checkpoints (nothing sent again) and retries the old parked rows."""
    dsn = events_table
    relays = fleet(fleet_config(tmp_path, dsn, nats_url, streams, split_parks=True))
    relays.migrate(old=True)
    backlog = await append_backlog(dsn, 60, aggregates=6)
    async with connect(dsn) as conn:
        for event in (PARKED, RETRIED):
            await append(conn, *event[:5])
    old = relays.start("old-1", old=True)

    async def old_done() -> bool:
        rows, top = await checkpoints(dsn), await head(dsn)
        lanes = ["loans", *(f"split/{i}" for i in range(SPLIT))]
        return len(await parked_ids(dsn)) == 2 and all(
            lane in rows and rows[lane]["position"] == top for lane in lanes
        )

    await eventually(old_done, timeout=60)
    await stop(old)
    before = await table_rows(dsn)
    assert before["outboxes"] and before["parked"] and before["checkpoints"]

    relays.migrate(old=False)
    after = await table_rows(dsn)
    assert lost(before, after) == [], "rows the previous release wrote, lost by the migration"

    status = await relays.cli("status")
    assert isinstance(status, list)
    assert {row["name"]: row["checkpoint"] for row in status} == {
        lane: row["position"] for lane, row in (await checkpoints(dsn)).items()
    }
    assert sum(row["parked"] for row in status) == 2
    listed = await relays.cli("parked", "list", "loans")
    assert isinstance(listed, list)
    assert [row["message_id"] for row in listed] == [message_id(PARKED)]

    await lift_limits(nats_url, streams)
    relays.start("new-1", old=False)
    for outbox in OUTBOXES:
        done = await relays.cli("retry-parked", outbox, "--all", "--wait", "--timeout", "60")
        assert "published" in json.dumps(done), done
    later = [book_lent(f"later-{i % 3}", i // 3 + 1) for i in range(9)]
    async with connect(dsn) as conn:
        await append_many(conn, later)
    books = {*backlog.values(), *(event_id(e.aggregate_id, e.version) for e in later)}
    for stream, heavy in zip(streams, (PARKED, RETRIED), strict=True):
        delivery = await delivered(nats_url, stream, {*books, message_id(heavy)})
        assert delivery.duplicates == {}, delivery.report(f"{stream} after the upgrade")


# -- the rolling upgrade: the check that enforces expand, then contract --------------------


async def relaying(
    relays: Fleet, dsn: str, writer: Writer, watch: LaneWatch, names: tuple[str, str], *, old: bool
) -> tuple[RelayProcess, RelayProcess]:
    """Two replicas of one release started, in the live set, and relaying."""
    first, second = (relays.start(name, old=old) for name in names)
    await joined(dsn, first, second)
    await flowing(dsn, writer, watch)
    return first, second


async def flowing(dsn: str, writer: Writer, watch: LaneWatch, events: int = 20) -> None:
    """The writer commits `events` more, and every lane not held up by a refused message
    relays past them: the fleet relays, counted in events rather than seconds. A breach
    the watch has seen meanwhile fails the test at once, naming it."""
    start = len(writer.appended)
    await eventually(lambda: len(writer.appended) >= start + events, timeout=30)
    mark = max(writer.appended)

    async def passed() -> bool:
        assert watch.breaches == [], watch.breaches
        rows = (await checkpoints(dsn)).values()
        return len(rows) == 1 + SPLIT and all(
            row["position"] >= mark for row in rows if row["retry_position"] is None
        )

    await eventually(passed, timeout=60)


def behind(delivery: Delivery, refused: str, at: int, positions: dict[str, int]) -> set[str]:
    """The ids the broker stored while the refused message at position `at` was refused:
    later in the log, stored before it. delivery.md: "Messages after k that NATS had
    already stored are sent again" with each retry of k; nothing else may be re-sent."""
    first = delivery.ids.index(refused)
    return {i for i in delivery.ids[:first] if positions.get(i, 0) > at}


def held_by(watch: LaneWatch, lane: str, prefix: str) -> list[int]:
    """The failure counts the lane's row showed while a replica named `prefix`... held it."""
    return [s.rejections for s in watch.history[lane] if (s.holder or "").startswith(prefix)]


async def test_rolling_upgrade_from_the_previous_release(
    events_table: str,
    nats_url: str,
    streams: tuple[str, str],
    fleet: Callable[[Path], Fleet],
    tmp_path: Path,
) -> None:
    """Two replicas of the previous release relay a plain and a split outbox while a writer
    commits; one message is parked and another is being retried. This release migrates (as
    the chart's init container does), its replicas join one at a time and the old ones stop
    (one old pod restarts on the new schema first, as a rescheduled pod does). Sampled all
    along: one holder per lane, epochs only forward. At the end nothing is lost, nothing is
    sent twice (every stop was graceful), the retried message's count went on across the
    upgrade, and the old parked message goes out by the new release's retry-parked."""
    dsn = events_table
    relays = fleet(fleet_config(tmp_path, dsn, nats_url, streams, split_parks=False))
    relays.migrate(old=True)
    watch = LaneWatch(dsn, OUTBOXES)
    async with watch, Writer(dsn, rate=40, aggregates=12) as writer:
        watch.phase = "previous release"
        old_a, old_b = await relaying(relays, dsn, writer, watch, ("old-a", "old-b"), old=True)
        async with connect(dsn) as conn:
            heavy_at = {message_id(e): await append(conn, *e[:5]) for e in (PARKED, RETRIED)}

        async def refused_under_old() -> bool:
            retried = [r for r in (await checkpoints(dsn)).values() if r["rejections"] >= 2]
            return len(await parked_ids(dsn)) == 1 and len(retried) == 1

        await eventually(refused_under_old, timeout=60)
        (blocked,) = [lane for lane, r in (await checkpoints(dsn)).items() if r["rejections"]]
        await flowing(dsn, writer, watch)

        watch.phase = "migrated"
        relays.migrate(old=False)
        await flowing(dsn, writer, watch)
        watch.phase = "new-1 joined"
        await joined(dsn, relays.start("new-1", old=False))
        await flowing(dsn, writer, watch)
        watch.phase = "old-a stopped"
        await stop(old_a)
        await flowing(dsn, writer, watch)
        watch.phase = "old-b restarted"
        await stop(old_b)
        old_b = relays.start("old-b2", old=True)
        await joined(dsn, old_b)
        await flowing(dsn, writer, watch)
        watch.phase = "new-2 joined"
        await joined(dsn, relays.start("new-2", old=False))
        await flowing(dsn, writer, watch)
        watch.phase = "old-b2 stopped"
        await stop(old_b)
        await flowing(dsn, writer, watch)
        assert {h.split(":")[1] for h in watch.holders_seen} >= {"old-a", "old-b", "new-1"}

        async def retried_under_new() -> bool:
            return bool([n for n in held_by(watch, blocked, "relay:new-") if n > 0])

        await eventually(retried_under_new, timeout=30)
        watch.phase = "limits lifted"
        await lift_limits(nats_url, streams)
        done = await relays.cli("retry-parked", "loans", "--all", "--wait", "--timeout", "60")
        assert "published" in json.dumps(done), done
        await flowing(dsn, writer, watch)
    assert writer.errors == []

    under_old, under_new = (
        held_by(watch, blocked, "relay:old-"),
        held_by(watch, blocked, "relay:new-"),
    )
    print(
        f"lane watch: {dict(watch.samples)} samples; {blocked} refusals {under_old} -> {under_new}"
    )
    assert watch.breaches == [], watch.breaches
    assert all(watch.samples[phase] >= 3 for phase in watch.samples), watch.samples
    assert max(under_old) >= 2 and min(n for n in under_new if n > 0) >= max(under_old), (
        f"the refused message's count went on across the upgrade: {under_old} -> {under_new}"
    )
    books = set(writer.appended.values())
    positions = {event: position for position, event in writer.appended.items()}
    for stream, heavy in zip(streams, (PARKED, RETRIED), strict=True):
        delivery = await delivered(nats_url, stream, {*books, message_id(heavy)})
        report(stream, delivery)
        allowed = behind(delivery, message_id(heavy), heavy_at[message_id(heavy)], positions)
        assert set(delivery.duplicates) <= allowed, delivery.report(
            "graceful stops and joins send nothing twice; only the messages behind a refused"
            " one in its batch go again with each retry"
        )
        assert len(delivery.duplicates) < BATCH, "at most one batch behind the refused message"


async def test_a_rollback_to_the_previous_release_under_a_writer(
    events_table: str,
    nats_url: str,
    streams: tuple[str, str],
    fleet: Callable[[Path], Fleet],
    tmp_path: Path,
) -> None:
    """A rollback (new replicas stopped, old ones started on the migrated schema), under a
    writer, with a plain and a split outbox (written by a black-box attack: upgrading.md
    said a rollback was not run as a test of its own). This release migrates and relays
    with two replicas, then the previous release's replicas join one at a time and the new
    ones stop (SIGTERM). Sampled all along: one holder per lane. Nothing lost, nothing
    sent twice (every stop graceful), each aggregate in order."""
    dsn = events_table
    relays = fleet(fleet_config(tmp_path, dsn, nats_url, streams, split_parks=False))
    relays.migrate(old=True)
    relays.migrate(old=False)
    watch = LaneWatch(dsn, OUTBOXES)
    async with watch, Writer(dsn, rate=40, aggregates=12) as writer:
        watch.phase = "this release"
        new_1, new_2 = await relaying(relays, dsn, writer, watch, ("new-1", "new-2"), old=False)
        watch.phase = "old-a joined"
        await joined(dsn, relays.start("old-a", old=True))
        await flowing(dsn, writer, watch)
        watch.phase = "new-1 stopped"
        await stop(new_1)
        await flowing(dsn, writer, watch)
        watch.phase = "old-b joined"
        await joined(dsn, relays.start("old-b", old=True))
        await flowing(dsn, writer, watch)
        watch.phase = "new-2 stopped"
        await stop(new_2)
        await flowing(dsn, writer, watch)
        await flowing(dsn, writer, watch)
    assert writer.errors == []
    assert watch.breaches == [], watch.breaches
    books = set(writer.appended.values())
    for stream in streams:
        delivery = await delivered(nats_url, stream, books)
        report(stream, delivery)
        assert not delivery.duplicates, delivery.report("graceful stops send nothing twice")


# -- this release against the next one's schema --------------------------------------------

NEXT_EXPAND = "ALTER TABLE {schema}.checkpoints ADD COLUMN next_release text"
NEXT_CONTRACT = "ALTER TABLE {schema}.checkpoints DROP COLUMN next_release"


async def test_this_release_runs_on_a_later_expand_step_and_refuses_a_contract(
    events_table: str,
    nats_url: str,
    stream: str,
    tmp_path: Path,
    relay_process: Callable[..., RelayProcess],
) -> None:
    """What makes this release the next one's previous release: a later release's migration
    (played here with `migrate(steps=...)`) that only adds lets this relay start, relay and
    answer commands, saying that it is older than its schema; one that declares it removed
    what older relays use (CONTRACTS) makes it refuse, naming the version it needs."""
    path = write_config(tmp_path, events_table, nats_url, stream)
    config = load_config(path)
    async with connect(events_table) as conn:
        await migrate(conn, config, steps=(*STEPS, NEXT_EXPAND))
        await append(conn, "book", "b1", 1, "BookLent", {"loanId": "L1", "memberId": "m"})
    up_to_date = run_cli(["migrate", "--config", str(path)])
    assert up_to_date.returncode == 0 and "up to date" in up_to_date.stdout, up_to_date.stderr
    replica = relay_process(["run", "--config", str(path)])
    record = await replica.wait_for_log("relay older than its schema")
    assert f"at version {LATEST + 1}, newer than this relay ({LATEST})" in record["detail"]
    await wait_for_count(nats_url, stream, lambda n: n == 1, process=replica)
    assert run_cli(["status", "--config", str(path)]).returncode == 0
    await stop(replica)

    contracts = {LATEST + 2: LATEST + 1}
    async with connect(events_table) as conn:
        await migrate(conn, config, steps=(*STEPS, NEXT_EXPAND, NEXT_CONTRACT), contracts=contracts)
    for command in (["run"], ["status"]):
        refused = run_cli([*command, "--config", str(path)])
        assert refused.returncode == 1, refused.stderr
        assert (
            f"needs a relay of schema version {LATEST + 1} or later): upgrade the relay"
        ) in refused.stderr
