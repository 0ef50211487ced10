"""Leases with real processes: three `relay run` replicas on one database and JetStream.

What a user checks: exactly one replica publishes at a time (from the replicas'
own logs and from `relay status`), a standby takes over when the holder goes
away, nothing is lost, and the duplicates are counted, bounded and absorbed by
JetStream's `Nats-Msg-Id` deduplication. Takeover times are printed; the
benchmarks in docs/ carry the figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.support.db import connect
from tests.support.delivery import Writer, analyse, append_backlog, checkpoint, wait_for_count
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.postgres import address, with_address
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import (
    LIBRARY_MESSAGES,
    config_dict,
    eventually,
    migrate_cli,
    save,
    write_config,
)

Start = Callable[..., RelayProcess]
MESSAGES = {"BookLent": {**LIBRARY_MESSAGES["BookLent"], "destination": "{subject}.loans"}}


def when(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"]).timestamp()


def events(process: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [r for r in process.logs() if r.get("event") == name]


def batches(process: RelayProcess) -> list[dict[str, Any]]:
    return events(process, "batch acknowledged")


def duplicates_reported(process: RelayProcess) -> int:
    return sum(int(r.get("duplicates", 0)) for r in batches(process))


class Cluster:
    """N replicas sharing one config; tells which one holds the lease."""

    def __init__(self, start: Start, config: Path, count: int, env: dict[str, str] | None = None):
        self.config = config
        self.replicas = [start(["run", "--config", str(config)], env=env) for _ in range(count)]

    async def holder(self, among: list[RelayProcess] | None = None) -> RelayProcess:
        candidates = among or self.replicas
        found: list[RelayProcess] = []

        async def one_holds() -> bool:
            found[:] = [p for p in candidates if p.returncode is None and _holds(p)]
            return len(found) == 1

        await eventually(one_holds, timeout=20)
        return found[0]

    async def successor(self, old: RelayProcess) -> RelayProcess:
        """The replica that takes over from `old`, once it relays the live writer's events."""
        new = await self.holder([r for r in self.replicas if r is not old])
        await publishes(new)
        return new

    def status(self) -> dict[str, Any]:
        result = run_cli(["status", "--json", "--config", str(self.config)])
        assert result.returncode == 0, result.stderr
        rows: list[dict[str, Any]] = json.loads(result.stdout)
        return rows[0]


async def publishes(process: RelayProcess, more: int = 3) -> None:
    """Wait until `process` has acknowledged `more` further batches (the writer is live)."""
    seen = len(batches(process))
    await eventually(lambda: len(batches(process)) >= seen + more, timeout=20)


def _holds(process: RelayProcess) -> bool:
    """The replica's own log says it holds the lease now."""
    last = None
    for record in process.logs():
        if record.get("event") in (
            "lease acquired: relaying",
            "lease released",
            "lease lost: stopped publishing, back to standby",
        ):
            last = record["event"]
    return last == "lease acquired: relaying"


async def _setup(
    events_table: str, nats_url: str, tmp_path: Path, **lease: Any
) -> tuple[Path, str]:
    stream = unique_name("failover")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    path = write_config(
        tmp_path,
        events_table,
        nats_url,
        stream,
        lease={"retry_interval": "1s", **lease},
        messages=MESSAGES,
        batch={"max_messages": 50},
    )
    migrate_cli(path)
    return path, stream


async def _all_delivered(nats_url: str, stream: str, writer: Writer) -> None:
    expected = set(writer.appended.values())
    received = await fetch_all(nats_url, stream, expected=len(expected), timeout=30)
    delivery = analyse(received)
    print(delivery.report("stream"))
    assert delivery.missing(expected) == []
    assert delivery.duplicates == {}, "JetStream's dedup window absorbs re-sent messages"
    assert delivery.order_violations == []
    assert writer.errors == []


async def test_three_replicas_exactly_one_publishes(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    config, stream = await _setup(events_table, nats_url, tmp_path)
    try:
        async with Writer(events_table, rate=50) as writer:
            cluster = Cluster(relay_process, config, 3)
            holder = await cluster.holder()
            await publishes(holder, more=20)
            status = cluster.status()
            assert status["state"] == "relaying"
            assert status["holder"] is not None and status["holder"].endswith(f":{holder.pid}")
        await _all_delivered(nats_url, stream, writer)
        for replica in cluster.replicas:
            replica.terminate()
        for replica in cluster.replicas:
            assert await replica.wait_async(15) == 0
        standbys = [r for r in cluster.replicas if r is not holder]
        assert batches(holder), "the holder published"
        for standby in standbys:
            assert batches(standby) == [], "a standby never publishes"
            assert events(standby, "lease acquired: relaying") == []
            seen = events(standby, "standing by")
            assert seen and seen[0]["holder"].endswith(f":{holder.pid}")
    finally:
        await delete_stream(nats_url, stream)


async def test_sigterm_holder_hands_over_without_duplicates(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    config, stream = await _setup(events_table, nats_url, tmp_path)
    try:
        async with Writer(events_table, rate=50) as writer:
            cluster = Cluster(relay_process, config, 3)
            old = await cluster.holder()
            await publishes(old)
            old.terminate()
            assert await old.wait_async(15) == 0
            new = await cluster.successor(old)
        await _all_delivered(nats_url, stream, writer)
        released = when(events(old, "lease released")[-1])
        acquired = when(events(new, "lease acquired: relaying")[-1])
        takeover = acquired - released
        print(f"graceful takeover: {takeover * 1000:.0f} ms (target < 1000 ms)")
        assert takeover >= 0
        assert duplicates_reported(new) == 0, "a graceful handover re-sends nothing"
        assert batches(old) and batches(new)
        # The new holder starts exactly where the old one's last acknowledged batch ended.
        first_new = batches(new)[0]["first_position"]
        assert first_new > batches(old)[-1]["last_position"]
    finally:
        await delete_stream(nats_url, stream)


async def test_kill_9_holder_loses_nothing_and_counts_duplicates(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    config, stream = await _setup(events_table, nats_url, tmp_path)
    try:
        async with Writer(events_table, rate=80) as writer:
            cluster = Cluster(relay_process, config, 2)
            old = await cluster.holder()
            await publishes(old)
            killed_at = time.time()
            old.kill()
            await old.wait_async(10)
            new = await cluster.successor(old)
        await _all_delivered(nats_url, stream, writer)
        took = when(events(new, "lease acquired: relaying")[-1]) - killed_at
        dups = duplicates_reported(new)
        print(f"kill -9 takeover: {took * 1000:.0f} ms; duplicates re-sent and absorbed: {dups}")
        assert dups <= 50, "only the unacknowledged batch (max_messages=50) is sent again"
    finally:
        await delete_stream(nats_url, stream)


async def test_terminated_lease_connection_stops_the_holder(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    config, stream = await _setup(events_table, nats_url, tmp_path)
    try:
        async with Writer(events_table, rate=50) as writer:
            cluster = Cluster(relay_process, config, 2)
            old = await cluster.holder()
            async with connect(events_table) as admin:
                pid = await admin.fetchval(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1",
                    f"%:{old.pid}:lease",
                )
                assert pid is not None
                terminated_at = time.time()
                assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
            lost = await old.wait_for_log("lease lost: stopped publishing, back to standby")
            new = await cluster.successor(old)
        await _all_delivered(nats_url, stream, writer)
        stopped = when(lost) - terminated_at
        took = when(events(new, "lease acquired: relaying")[-1]) - terminated_at
        print(
            f"pg_terminate_backend: holder stopped after {stopped * 1000:.0f} ms, "
            f"standby took over after {took * 1000:.0f} ms"
        )
        assert not [b for b in batches(old) if when(b) > when(lost)], "no publish after loss"
    finally:
        await delete_stream(nats_url, stream)


@pytest.mark.timeout(120)
async def test_network_cut_holder_fences_itself_and_standby_takes_over(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start, tcp_proxy: Any
) -> None:
    config, stream = await _setup(events_table, nats_url, tmp_path, takeover_after="5s")
    proxy: TcpProxy = tcp_proxy(*address(events_table))  # the test database's own server
    cut_url = with_address(events_table, proxy.host, proxy.port)
    try:
        async with Writer(events_table, rate=50) as writer:
            # The first replica reaches Postgres through the proxy and takes the lease.
            behind = relay_process(
                ["run", "--config", str(config)], env={"RELAY_DATABASE__URL": cut_url}
            )
            await eventually(lambda: _holds(behind), timeout=20)
            direct = relay_process(["run", "--config", str(config)])
            await direct.wait_for_log("standing by")
            await publishes(behind)
            proxy.pause()  # packets stop, sockets stay open: a half-open network path
            cut_at = time.time()
            lost = await behind.wait_for_log(
                "lease lost: stopped publishing, back to standby", timeout=20
            )
            acquired = await direct.wait_for_log("lease acquired: relaying", timeout=30)
            await publishes(direct)
        await _all_delivered(nats_url, stream, writer)
        fenced = when(lost) - cut_at
        took = when(acquired) - cut_at
        print(
            f"network cut: holder fenced itself after {fenced * 1000:.0f} ms "
            f"(check_interval + check_timeout = 2000 ms); standby took over after "
            f"{took * 1000:.0f} ms (takeover_after = 5000 ms)"
        )
        assert fenced < took, "the cut-off holder stops before anyone else starts"
        assert not [b for b in batches(behind) if when(b) > when(lost)]
        row = await checkpoint(events_table, "loans")
        assert row is not None and row["holder"].endswith(f":{direct.pid}")
        proxy.resume()
    finally:
        await delete_stream(nats_url, stream)


@pytest.mark.timeout(120)
async def test_paused_holder_is_replaced_and_its_resends_are_deduplicated(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    """SIGSTOP freezes the holder mid-backlog: keepalives alone would never free its lock.

    The standby sees the heartbeat go stale and ends the frozen session. The new
    holder re-sends what was published but not checkpointed; JetStream drops
    those by `Nats-Msg-Id`, so the stream holds every event once.
    """
    config, stream = await _setup(
        events_table,
        nats_url,
        tmp_path,
        check_interval="500ms",
        check_timeout="500ms",
        takeover_after="2s",
    )
    writer = Writer(events_table)
    writer.appended = await append_backlog(events_table, 20000, aggregates=40)
    try:
        cluster = Cluster(relay_process, config, 2)
        old = await cluster.holder()
        await wait_for_count(nats_url, stream, lambda n: n >= 200, interval=0.002)
        old.pause()
        paused_at = time.time()
        new = await cluster.successor(old)
        took = when(events(new, "lease acquired: relaying")[-1]) - paused_at
        old.resume()
        await old.wait_for_log("lease lost: stopped publishing, back to standby")
        await _all_delivered(nats_url, stream, writer)
        dups = duplicates_reported(new)
        print(
            f"SIGSTOP: standby took over after {took * 1000:.0f} ms; "
            f"re-sent and absorbed by JetStream dedup: {dups}"
        )
        assert dups <= 50 * 2, "at most the batches in flight when the holder froze"
        assert events(new, "silent holder's session terminated")
        assert batches(new), "the holder was frozen mid-backlog"
    finally:
        await delete_stream(nats_url, stream)


async def test_max_per_replica_spreads_outboxes(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Start
) -> None:
    stream = unique_name("spread")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    data = config_dict(events_table, nats_url, stream, messages=MESSAGES)
    second = dict(data["outboxes"]["loans"])
    data["outboxes"]["loans-copy"] = {
        **second,
        "messages": {"BookLent": {**MESSAGES["BookLent"], "destination": f"{stream}.copy"}},
    }
    data["lease"] = {"max_per_replica": 1}
    config = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    try:
        replicas = [relay_process(["run", "--config", str(config)]) for _ in range(2)]

        async def both_held() -> bool:
            result = run_cli(["status", "--json", "--config", str(config)])
            rows = json.loads(result.stdout)
            holders = {row["holder"] for row in rows}
            return None not in holders and len(holders) == 2

        await eventually(both_held, timeout=20)
        for replica in replicas:
            assert len(events(replica, "lease acquired: relaying")) == 1
    finally:
        await delete_stream(nats_url, stream)
