"""The relay as an operator runs it: a real `relay run` process, real Postgres, real JetStream.

Each test checks what a user would check afterwards: every appended event is on the stream
(read back with a consumer), each exactly once (by `Nats-Msg-Id`, which equals `ce-id`), each
book's versions strictly increasing in stream order, the checkpoint never ahead of what the
stream holds, and the exit codes and `relay status` an operator sees on the way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import postgres
from tests.support.db import NewEvent, append_many
from tests.support.db import connect as db_connect
from tests.support.delivery import (
    Delivery,
    Writer,
    analyse,
    append_backlog,
    checkpoint,
    checkpoint_position,
    settled_count,
    wait_for_checkpoint,
    wait_for_count,
)
from tests.support.jetstream import create_stream, fetch_all, unique_name
from tests.support.nats_server import NatsServer
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import eventually, write_config

pytestmark = pytest.mark.timeout(90)

OUTBOX = "loans"
BACKLOG = 3000
BOOKS = 20
# Small batches make a 3000-event backlog take ~1 s to relay, so a signal lands mid-stream.
SMALL_BATCHES = {"max_messages": 20}
GRACE = 5.0  # scenario.config_dict's shutdown.grace_period

StartRelay = Callable[..., RelayProcess]


# -- helpers ---------------------------------------------------------------------------------


def nats_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def migrate(path: Path) -> None:
    result = run_cli(["migrate", "--config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


async def status(path: Path) -> dict[str, Any]:
    """This outbox's row of `relay status --json` (run off the event loop: it takes ~0.5 s)."""
    result = await asyncio.to_thread(run_cli, ["status", "--json", "--config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return next(row for row in rows if row["name"] == OUTBOX)


async def wait_for_status(
    path: Path,
    done: Callable[[dict[str, Any]], bool],
    timeout: float = 10.0,  # noqa: ASYNC109 - one deadline across many polls
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        row = await status(path)
        if done(row):
            return row
        seen.append(row)
    raise AssertionError(f"status never matched within {timeout}s; last rows: {seen[-3:]}")


async def stop(process: RelayProcess, timeout: float = GRACE + 5) -> int:  # noqa: ASYNC109
    process.terminate()
    code = await process.wait_async(timeout)
    assert code == 0, process.output()
    return code


def assert_exactly_once(delivery: Delivery, expected: set[str]) -> None:
    """Every expected id stored once, nothing else, each book's versions increasing."""
    assert delivery.missing(expected) == [], f"lost: {delivery.missing(expected)[:20]}"
    assert delivery.unexpected(expected) == [], f"unexpected: {delivery.unexpected(expected)}"
    assert delivery.duplicates == {}, delivery.report("duplicates")
    assert delivery.order_violations == [], delivery.order_violations[:20]
    assert delivery.header_mismatches == [], delivery.header_mismatches[:5]
    assert len(delivery.ids) == len(expected)


def resumed_from(process: RelayProcess) -> int:
    """The checkpoint the relay logged when it started relaying the outbox."""
    record = next(
        r
        for r in process.logs()
        if r.get("event") in ("relaying", "lease acquired: relaying") and "checkpoint" in r
    )
    return int(record["checkpoint"])


def duplicates_acknowledged(process: RelayProcess) -> int:
    """How many PubAcks said `duplicate`, summed from the relay's debug log."""
    return sum(
        int(r.get("duplicates", 0))
        for r in process.logs()
        if r.get("event") == "batch acknowledged"
    )


# -- restarts ----------------------------------------------------------------------------------


async def test_sigterm_mid_stream_then_restart_delivers_every_event_once(
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, events_table, nats_url, stream, batch=SMALL_BATCHES)
    migrate(path)
    expected = await append_backlog(events_table, BACKLOG, BOOKS)
    last = max(expected)

    first = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n >= 200, process=first)
    first.terminate()
    signalled = time.monotonic()
    code = await first.wait_async(GRACE + 5)
    took = time.monotonic() - signalled
    assert code == 0, first.output()
    assert took < GRACE, f"graceful stop took {took:.2f}s"

    position = await checkpoint_position(events_table, OUTBOX)
    before = analyse(await fetch_all(nats_url, stream))
    print(f"SIGTERM: exit 0 after {took:.2f}s, checkpoint {position} of {last}")
    print(before.report("after SIGTERM"))
    assert 0 < position < last, "the signal did not land mid-stream; restart not exercised"
    through = {i for p, i in expected.items() if p <= position}
    assert before.missing(through) == [], "checkpoint is ahead of what the stream holds"
    # A graceful stop leaves no acknowledged-but-unrecorded batch behind.
    assert set(before.counts) == through, before.unexpected(through)[:20]

    second = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n >= len(expected), process=second)
    await stop(second)
    assert resumed_from(second) == position
    after = analyse(await fetch_all(nats_url, stream, expected=len(expected)))
    print(after.report("after restart"))
    resent = duplicates_acknowledged(second)
    print(f"PubAcks marked duplicate after the restart: {resent}")
    assert resent == 0, "a graceful stop left published-but-unrecorded messages"
    assert_exactly_once(after, set(expected.values()))
    assert await checkpoint_position(events_table, OUTBOX) == last


@pytest.mark.parametrize("moment", ["mid-stream", "between-ack-and-checkpoint"])
async def test_sigkill_then_restart_loses_nothing(
    *,
    moment: str,
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tcp_proxy: Callable[[str, int], TcpProxy],
    tmp_path: Path,
) -> None:
    """kill -9 wherever it lands; the second moment forces published-but-not-checkpointed.

    For that one, Postgres and NATS are reached through proxies: NATS is held while a batch is
    in flight, then Postgres is held and NATS let go, so the batch is acknowledged but its
    checkpoint write cannot reach the database when the relay is killed.
    """
    stall = moment == "between-ack-and-checkpoint"
    pg = tcp_proxy(*postgres.address(events_table))
    broker = tcp_proxy("127.0.0.1", nats_port(nats_url))
    dsn = postgres.with_address(events_table, pg.host, pg.port) if stall else events_table
    url = f"nats://{broker.host}:{broker.port}" if stall else nats_url
    path = write_config(tmp_path, dsn, url, stream, batch=SMALL_BATCHES)
    migrate(path)
    expected = await append_backlog(events_table, BACKLOG, BOOKS)
    last = max(expected)

    first = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n >= 200, process=first)
    if stall:
        broker.pause()
        # The relay writes its next batch into the silence: it now awaits the PubAcks.
        await eventually(lambda: broker.waiting_from_clients() > 0, timeout=10)
        pg.pause()
        broker.resume()  # the batch is stored and acknowledged; its checkpoint write hangs
        await settled_count(nats_url, stream, quiet=0.2)
    first.kill()
    assert await first.wait_async(5) == -9
    if stall:
        pg.cut()  # drop the dead relay's sessions (and its lease) with what they had queued
        pg.resume()
    # Let whatever the dead process had already written to NATS or Postgres land.
    stored = await settled_count(nats_url, stream)
    at_kill = await checkpoint_position(events_table, OUTBOX)
    before = analyse(await fetch_all(nats_url, stream))
    through = {i for p, i in expected.items() if p <= at_kill}
    beyond = {i for p, i in expected.items() if p > at_kill} & set(before.counts)
    print(f"SIGKILL ({moment}): checkpoint {at_kill} of {last}, {stored} stored")
    print(f"published but not checkpointed (re-sent after restart): {len(beyond)}")
    print(before.report("after SIGKILL"))
    assert 0 < at_kill < last, "the kill did not land mid-stream; restart not exercised"
    assert before.missing(through) == [], "checkpoint is ahead of what the stream holds"
    assert set(before.counts) <= set(expected.values())
    assert before.duplicates == {}
    if stall:
        assert beyond, "the kill did not land between PubAck and checkpoint"

    second = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n >= len(expected), process=second)
    await wait_for_checkpoint(events_table, OUTBOX, last)
    await stop(second)
    assert resumed_from(second) == at_kill
    after = analyse(await fetch_all(nats_url, stream, expected=len(expected)))
    print(after.report("after restart"))
    absorbed = duplicates_acknowledged(second)
    print(f"PubAcks marked duplicate after the restart: {absorbed}")
    # What was re-sent is exactly what was beyond the checkpoint, and it was re-sent within the
    # stream's duplicate window: JetStream acknowledged it as a duplicate and stored nothing.
    assert absorbed == len(beyond)
    assert_exactly_once(after, set(expected.values()))


# -- signals -----------------------------------------------------------------------------------


async def test_sigint_stops_gracefully(
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, events_table, nats_url, stream)
    migrate(path)
    expected = await append_backlog(events_table, 50, 5)
    process = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n >= len(expected), process=process)

    process.interrupt()
    assert await process.wait_async(GRACE + 5) == 0, process.output()
    signals = [r for r in process.logs() if r.get("event") == "signal received, stopping"]
    assert [r["signal"] for r in signals] == ["SIGINT"]
    assert await checkpoint_position(events_table, OUTBOX) == max(expected)


async def events_read(process: RelayProcess) -> float:
    """The relay's own relay_events_read_total, scraped from its /metrics."""
    port = int((await process.wait_for_log("http listening"))["port"])

    def scrape() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "relay_events_read_total"
        )

    return await asyncio.to_thread(scrape)


async def stalled_relay(
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    *,
    tcp_proxy: Callable[[str, int], TcpProxy],
    tmp_path: Path,
    grace: str,
) -> tuple[RelayProcess, TcpProxy, Path]:
    """A relay whose second batch is in flight to a NATS that no longer answers (a black hole).

    The acknowledgement timeout is long, so the batch stays in flight until shutdown.
    """
    proxy = tcp_proxy("127.0.0.1", nats_port(nats_url))
    path = write_config(
        tmp_path,
        events_table,
        f"nats://{proxy.host}:{proxy.port}",
        stream,
        broker={"ack_timeout": "60s"},
        shutdown={"grace_period": grace},
    )
    migrate(path)
    await append_backlog(events_table, 1, 1)
    process = relay_process(["run", "--config", str(path)])
    await wait_for_count(nats_url, stream, lambda n: n == 1, process=process)

    proxy.pause()
    async with db_connect(events_table) as conn:
        await append_many(conn, [NewEvent("book", "book-1", 2, "BookLent", {"loanId": "l2"})])

    async def second_event_read() -> bool:
        return await events_read(process) >= 2  # read, mapped: now awaiting its PubAck

    await eventually(second_event_read, timeout=10)
    return process, proxy, path


async def test_second_sigterm_during_shutdown_exits_at_once(
    *,
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tcp_proxy: Callable[[str, int], TcpProxy],
    tmp_path: Path,
) -> None:
    """A batch stuck waiting for PubAcks holds the graceful stop; a second SIGTERM cuts it short.

    NATS is reached through a proxy that is then paused (a black hole), and the acknowledgement
    timeout and grace period are long, so after the first SIGTERM the relay is reliably still
    shutting down when the second one arrives.
    """
    process, _, _ = await stalled_relay(
        events_table,
        nats_url,
        stream,
        relay_process,
        tcp_proxy=tcp_proxy,
        tmp_path=tmp_path,
        grace="60s",
    )

    process.terminate()
    await process.wait_for_log("stopping", timeout=5)
    await asyncio.sleep(0.3)
    assert process.returncode is None, "nothing was in flight: the test did not set up a stall"

    process.terminate()
    signalled = time.monotonic()
    code = await process.wait_async(2)
    took = time.monotonic() - signalled
    print(f"second SIGTERM: exit {code} after {took:.3f}s")
    assert code == 130, process.output()
    assert any(r.get("event") == "second signal, exiting now" for r in process.logs())
    assert await checkpoint_position(events_table, OUTBOX) == 1


async def test_grace_period_abandons_a_stuck_batch_without_moving_the_checkpoint(
    *,
    events_table: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tcp_proxy: Callable[[str, int], TcpProxy],
    tmp_path: Path,
) -> None:
    process, proxy, path = await stalled_relay(
        events_table,
        nats_url,
        stream,
        relay_process,
        tcp_proxy=tcp_proxy,
        tmp_path=tmp_path,
        grace="1s",
    )

    process.terminate()
    signalled = time.monotonic()
    code = await process.wait_async(10)
    took = time.monotonic() - signalled
    print(f"stuck batch: exit {code} after {took:.2f}s (grace 1s)")
    assert code == 0, process.output()
    assert 1.0 <= took < 4.0
    assert any(
        r.get("event") == "grace period over, abandoning the in-flight batch"
        for r in process.logs()
    )
    assert await checkpoint_position(events_table, OUTBOX) == 1

    proxy.resume()  # whatever the dead relay left in the proxy may now reach the stream
    restarted = relay_process(["run", "--config", str(path)])
    await wait_for_checkpoint(events_table, OUTBOX, 2)
    await stop(restarted)
    assert_exactly_once(
        analyse(await fetch_all(nats_url, stream, expected=2)), {"book/book-1@1", "book/book-1@2"}
    )


# -- broker outages ----------------------------------------------------------------------------


async def test_broker_outage_with_a_live_writer(
    events_table: str,
    nats_factory: Callable[[], NatsServer],
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    server = nats_factory()
    name = unique_name("outage")
    await create_stream(server.url, name, [f"{name}.>"])
    path = write_config(tmp_path, events_table, server.url, name)
    migrate(path)
    process = relay_process(["run", "--config", str(path)])

    async with Writer(events_table, rate=20, aggregates=5) as writer:
        await wait_for_count(server.url, name, lambda n: n >= 10, process=process)
        await asyncio.to_thread(server.stop)
        down = time.monotonic()
        retrying = await wait_for_status(path, lambda r: r["state"] == "retrying")
        noticed = time.monotonic() - down
        print(f"status while down ({noticed:.2f}s after stop): {retrying}")
        assert retrying["last_error"] is not None
        assert retrying["last_error"].startswith("attempt "), retrying
        assert retrying["lag_events"] > 0
        assert process.returncode is None, process.output()
        assert writer.errors == []
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - down)))  # down for 2 s at least
        during = len(writer.appended)

        await asyncio.to_thread(server.restart)
        up = time.monotonic()
        await wait_for_count(server.url, name, lambda n: n >= during, process=process)
        recovered = time.monotonic() - up
        await asyncio.sleep(0.5)  # relay a few more live events after recovery
    assert writer.errors == []
    expected = writer.appended
    await wait_for_count(server.url, name, lambda n: n >= len(expected), process=process)
    caught_up = await wait_for_status(
        path, lambda r: r["state"] == "relaying" and r["lag_events"] == 0
    )
    print(
        f"outage {up - down:.2f}s, {during} appended by restart, backlog relayed "
        f"{recovered:.2f}s after restart; {len(expected)} appended in all; {caught_up}"
    )
    assert caught_up["checkpoint"] == max(expected)
    assert caught_up["last_error"] is None
    await stop(process)
    delivery = analyse(await fetch_all(server.url, name, expected=len(expected)))
    print(delivery.report("after outage"))
    assert_exactly_once(delivery, set(expected.values()))
    failures = [r for r in process.logs() if r.get("event") == "publish failed, retrying"]
    print(f"publish attempts failed during the outage: {len(failures)}")
    resent = duplicates_acknowledged(process)
    print(f"PubAcks marked duplicate (re-sent after the outage): {resent}")
    assert failures


async def test_broker_unreachable_at_start_up(
    events_table: str,
    nats_factory: Callable[[], NatsServer],
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    server = nats_factory()
    server.stop()  # its port is now closed; the same server starts there later
    name = unique_name("late")
    path = write_config(tmp_path, events_table, server.url, name)
    migrate(path)
    expected = await append_backlog(events_table, 100, 10)

    process = relay_process(["run", "--config", str(path)])
    started = time.monotonic()
    row = await wait_for_status(path, lambda r: r["state"] == "retrying")
    print(f"status with the broker down: {row}")
    assert row["last_error"].startswith("attempt "), row
    assert "cannot connect" in row["last_error"], row
    while time.monotonic() - started < 3.0:
        assert process.returncode is None, process.output()
        await asyncio.sleep(0.1)
    assert process.returncode is None, process.output()

    await asyncio.to_thread(server.start)
    await create_stream(server.url, name, [f"{name}.>"])
    up = time.monotonic()
    await wait_for_count(server.url, name, lambda n: n >= len(expected), process=process)
    print(f"all {len(expected)} delivered {time.monotonic() - up:.2f}s after the stream appeared")
    row = await wait_for_status(path, lambda r: r["state"] == "relaying" and r["lag_events"] == 0)
    assert row["last_error"] is None
    await stop(process)
    assert_exactly_once(
        analyse(await fetch_all(server.url, name, expected=len(expected))),
        set(expected.values()),
    )


# -- database problems at start-up -------------------------------------------------------------


async def test_run_refuses_an_unmigrated_database(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    path = write_config(tmp_path, events_table, nats_url, unique_name("unmigrated"))
    result = await asyncio.to_thread(run_cli, ["run", "--config", str(path)], timeout=30)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "relay migrate" in result.stderr, result.stderr


PASSWORD_URL = "postgresql://postgres:hunter2@127.0.0.1:1/x"


async def test_unreachable_database_is_retried_without_leaking_the_password(
    nats_url: str, relay_process: StartRelay, tmp_path: Path
) -> None:
    path = write_config(tmp_path, PASSWORD_URL, nats_url, unique_name("nodb"))
    process = relay_process(["run", "--config", str(path)])
    started = time.monotonic()
    await process.wait_for_log("database unreachable, retrying", timeout=10)
    while time.monotonic() - started < 2.0:
        assert process.returncode is None, process.output()
        await asyncio.sleep(0.1)
    attempts = [r for r in process.logs() if r.get("event") == "database unreachable, retrying"]
    assert len(attempts) > 1
    assert "hunter2" not in process.output()

    process.terminate()
    signalled = time.monotonic()
    code = await process.wait_async(5)
    took = time.monotonic() - signalled
    print(f"SIGTERM while waiting for the database: exit {code} after {took:.2f}s")
    print(process.output()[-600:])
    assert took < 2.0
    assert "hunter2" not in process.output()


async def test_sigterm_while_waiting_for_the_database_exits_0_at_once(
    nats_url: str, relay_process: StartRelay, tmp_path: Path
) -> None:
    """runner.py: the first SIGTERM stops gracefully and exits 0, whatever the relay waits for.

    With a long backoff (the default retry.max is 30s) the start-up wait must still end at once.
    """
    path = write_config(
        tmp_path, PASSWORD_URL, nats_url, unique_name("nodb"), database={"retry": {"initial": "5s"}}
    )
    process = relay_process(["run", "--config", str(path)])
    await process.wait_for_log("database unreachable, retrying", timeout=10)

    process.terminate()
    signalled = time.monotonic()
    code = await process.wait_async(15)
    took = time.monotonic() - signalled
    print(f"SIGTERM during a 5s start-up backoff: exit {code} after {took:.2f}s")
    print(process.output()[-600:])
    assert took < 2.0, f"SIGTERM took {took:.2f}s to stop a relay waiting for its database"
    assert code == 0, process.output()


# -- a neighbour: another database on the same Postgres server ---------------------------------
#
# Advisory locks are scoped to a database, so the same outbox name in two databases (one per
# tenant, or per test) makes two independent leases. Whatever reads pg_locks must say so too.


@pytest.fixture
def other_database(pg_admin_dsn: str) -> Iterator[str]:
    """A second fresh database with the example `events` table, on the same server."""
    dsn = postgres.create_database(pg_admin_dsn)
    try:
        postgres.run_sql_file(dsn)
        yield dsn
    finally:
        postgres.drop_database(pg_admin_dsn, dsn)


async def test_status_names_no_holder_from_another_database(
    *,
    events_table: str,
    other_database: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path, events_table, nats_url, stream)
    neighbour_path = write_config(tmp_path, other_database, nats_url, stream, name="other.yaml")
    migrate(path)
    migrate(neighbour_path)
    neighbour = relay_process(["run", "--config", str(neighbour_path)])
    await wait_for_checkpoint(other_database, OUTBOX, 0)  # it holds its lease and relays

    assert (await status(neighbour_path))["holder"] is not None
    mine = await status(path)  # nothing runs against this database
    print(f"status of an outbox nobody relays: {mine}")
    assert mine["holder"] is None, mine
    assert mine["state"] == "no holder", mine
    await stop(neighbour)


async def test_takeover_never_ends_a_relay_in_another_database(
    *,
    events_table: str,
    other_database: str,
    nats_url: str,
    stream: str,
    relay_process: StartRelay,
    tmp_path: Path,
) -> None:
    """A standby ends its own outbox's silent holder, and nobody else's."""
    lease = {"takeover_after": "2s", "check_interval": "500ms", "check_timeout": "500ms"}
    path = write_config(tmp_path, events_table, nats_url, stream, lease=lease)
    neighbour_path = write_config(
        tmp_path, other_database, nats_url, stream, name="other.yaml", lease=lease
    )
    migrate(path)
    migrate(neighbour_path)
    # The neighbour takes its lock first, so it is listed first in pg_locks.
    neighbour = relay_process(["run", "--config", str(neighbour_path)])
    await wait_for_checkpoint(other_database, OUTBOX, 0)
    holder = relay_process(["run", "--config", str(path)])
    await wait_for_checkpoint(events_table, OUTBOX, 0)
    standby = relay_process(["run", "--config", str(path)])
    await standby.wait_for_log("standing by")

    os.kill(holder.pid, signal.SIGSTOP)  # a paused process: its heartbeat goes stale
    try:
        await standby.wait_for_log(lambda r: r.get("event", "").startswith("lease acquired"))
        await asyncio.sleep(1.0)  # two of the neighbour's lease checks
    finally:
        holder.kill()
    ended = [r for r in standby.logs() if r.get("event") == "silent holder's session terminated"]
    lost = [r for r in neighbour.logs() if str(r.get("event", "")).startswith("lease lost")]
    print(f"sessions the standby ended: {ended}")
    print(f"the neighbour's lease losses: {lost}")
    assert lost == [], "a relay in another database lost its lease"
    assert [r["holder"].rsplit(":", 1)[1] for r in ended] == [str(holder.pid)]
    await stop(standby)
    await stop(neighbour)


# -- one-shot commands -------------------------------------------------------------------------


async def test_migrate_is_idempotent_and_check_previews_without_publishing(
    events_table: str, nats_url: str, stream: str, tmp_path: Path
) -> None:
    path = write_config(tmp_path, events_table, nats_url, stream)
    first = run_cli(["migrate", "--config", str(path)])
    assert first.returncode == 0, first.stderr
    assert "schema 'relay': applied migration(s) 1" in first.stdout
    second = run_cli(["migrate", "--config", str(path)])
    assert second.returncode == 0, second.stderr
    assert "schema 'relay': up to date" in second.stdout

    async with db_connect(events_table) as conn:
        positions = await append_many(
            conn,
            [
                NewEvent("book", "book-1", 1, "BookLent", {"loanId": "l1", "memberId": "m1"}),
                NewEvent("book", "book-1", 2, "BookReserved", {"memberId": "m2"}),
                NewEvent("book", "book-1", 3, "BookReturned", {"loanId": "l1"}),
            ],
        )
    result = await asyncio.to_thread(run_cli, ["check", "--config", str(path), "--json"])
    assert result.returncode == 0, result.stderr
    rows = {row["position"]: row for row in json.loads(result.stdout)}
    assert sorted(rows) == positions

    lent = rows[positions[0]]
    assert lent["outbox"] == OUTBOX
    assert lent["event"] == "book/book-1@1 BookLent"
    assert lent["id"] == "book/book-1@1"
    assert lent["type"] == "library.book-lent.v1"
    assert lent["destination"] == f"{stream}.book"
    assert lent["key"] == "book-1"
    assert json.loads(lent["body"]) == {
        "bookId": "book-1",
        "loanId": "l1",
        "memberId": "m1",
        "version": 1,
    }
    reserved = rows[positions[1]]
    assert reserved["event"] == "book/book-1@2 BookReserved"
    assert "skipped" in reserved
    assert "id" not in reserved
    returned = rows[positions[2]]
    assert returned["id"] == "book/book-1@3"
    assert returned["destination"] == f"{stream}.book"
    assert json.loads(returned["body"]) == {"bookId": "book-1", "loanId": "l1", "version": 3}

    assert await fetch_all(nats_url, stream) == []
    assert await checkpoint(events_table, OUTBOX) is None
