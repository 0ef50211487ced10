"""Holes found by attacking the relay as an operator would, through its docs and its CLI.

Each test fails today and says what the docs promise.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from relay.demo.embedded import EmbeddedPostgres
from tests.support.db import append_many, connect
from tests.support.delivery import append_backlog
from tests.support.jetstream import fetch_all
from tests.support.lanes import delivered
from tests.support.postgres import create_database, run_sql_file, with_database
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.replication import Standby, free_port, multi_host, replicated_pair
from tests.support.scenario import config_dict, eventually, migrate_cli, save

Start = Callable[..., RelayProcess]


async def replayed_all(primary: EmbeddedPostgres, standby: Standby, database: str) -> None:
    """Wait until the standby has replayed everything the primary has written."""
    async with connect(with_database(primary.dsn, database)) as conn:
        target = await conn.fetchval("SELECT pg_current_wal_lsn()")

    async def caught_up() -> bool:
        async with connect(with_database(standby.dsn, database)) as conn:
            return bool(await conn.fetchval("SELECT pg_last_wal_replay_lsn() >= $1", target))

    await eventually(caught_up, timeout=30)


async def cut_off(standby: Standby) -> None:
    """Stop the standby's WAL receiver, as a lagging network would: asynchronous replication
    leaves the primary's next commits on the primary alone."""
    async with connect(standby.dsn) as conn:
        await conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
        await conn.execute("SELECT pg_reload_conf()")

    async def stopped() -> bool:
        async with connect(standby.dsn) as conn:
            return not await conn.fetchval("SELECT count(*) FROM pg_stat_wal_receiver")

    await eventually(stopped, timeout=30)


async def next_loans(dsn: str, books: list[str], tag: str) -> dict[str, str]:
    """One BookLent per book, at the version the application reads from its own store (as an
    event-sourced application does); message id -> loanId."""
    sent: dict[str, str] = {}
    async with connect(dsn) as conn:
        for book in books:
            version = await conn.fetchval(
                "SELECT coalesce(max(version), 0) + 1 FROM events"
                " WHERE aggregate_type = 'book' AND aggregate_id = $1",
                book,
            )
            loan = f"{tag}-{book}"
            await append_many(
                conn, [("book", book, version, "BookLent", {"loanId": loan, "memberId": "m"})]
            )
            sent[f"book/{book}@{version}"] = loan
    return sent


async def test_events_committed_on_the_promoted_primary_reach_the_stream_after_lost_commits(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start
) -> None:
    """docs/delivery.md, "A failover of PostgreSQL": the old primary's last commits may never
    reach the standby, and what the relay published of them are phantoms. But the application
    then writes its next events on the new primary at the versions its store now has, the
    phantoms' versions: the same message ids, other events. JetStream drops them as
    duplicates of the phantoms (within `duplicate_window`), the relay counts them as published
    (a debug `duplicates` count, no warning, no `relay_unexpected_duplicates_total`), and
    consumers never see them: events committed on the new primary, never delivered.

    Seen by hand (3 replicas, K=2, writer at ~40/s, standby cut off 4 s before the kill):
    118 events committed on the new primary never reached the stream, each with the id of
    one of the 118 phantoms."""
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        database = dsn.rpartition("/")[2]
        run_sql_file(dsn)
        config = save(tmp_path, config_dict(multi_host(dsn, primary, standby), nats_url, stream))
        migrate_cli(config)
        first = await append_backlog(dsn, 10, aggregates=5)
        relay = relay_process(["run", "--config", str(config)])
        await delivered(nats_url, stream, set(first.values()))
        await replayed_all(primary, standby, database)

        await cut_off(standby)
        books = [f"book-{i}" for i in range(1, 6)]
        phantoms = await next_loans(dsn, books, "before-failover")
        await delivered(nats_url, stream, {*first.values(), *phantoms})  # not replicated
        primary.halt("immediate")
        standby.promote()

        promoted = with_database(standby.dsn, database)
        later = await next_loans(promoted, books, "after-failover")
        assert set(later) == set(phantoms), "the application reuses the lost versions"

        async def on_stream() -> bool:
            messages = await fetch_all(nats_url, stream)
            seen = {(m.headers.get("ce-id"), json.loads(m.data).get("loanId")) for m in messages}
            return all((msg_id, loan) in seen for msg_id, loan in later.items())

        try:
            await eventually(on_stream, timeout=30, interval=0.5)
        except AssertionError:
            messages = await fetch_all(nats_url, stream)
            stored = {m.headers.get("ce-id"): json.loads(m.data).get("loanId") for m in messages}
            missing = {i: loan for i, loan in later.items() if stored.get(i) != loan}
            raise AssertionError(
                f"{len(missing)} event(s) committed on the promoted primary never reached "
                f"consumers; the stream holds the phantoms' bodies under their ids: "
                f"{ {i: stored.get(i) for i in missing} }"
            ) from None
        assert relay.returncode is None


async def test_a_restarted_old_primary_beside_the_promoted_one_gets_no_second_holder(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start
) -> None:
    """After a failover the old primary is started again as it was (not rebuilt as a
    standby): two primaries, split brain. A replica whose multi-host URL lists the old
    primary first (a restarted pod, or `relay status`) connects to it, since it answers as a
    primary, and claims every lane there while the fleet holds the same lanes on the promoted
    primary: two holders of each lane, publishing from two checkpoints into one stream, and
    `relay status` shows the old database's rows as if they were the fleet's. The relay asks
    each host whether it is in recovery but does not notice that two hosts of its URL both
    say no. Seen by hand: both lanes held on both databases, `relay status` with the
    primary-first URL showing the old primary's checkpoints (330 against 475)."""
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        database = dsn.rpartition("/")[2]
        run_sql_file(dsn)
        fleet = save(tmp_path, config_dict(multi_host(dsn, standby, primary), nats_url, stream))
        migrate_cli(fleet)
        first = await append_backlog(dsn, 10, aggregates=5)
        holder = relay_process(["run", "--config", str(fleet)])
        await delivered(nats_url, stream, set(first.values()))
        await replayed_all(primary, standby, database)
        primary.halt("immediate")
        standby.promote()
        await holder.wait_for_log(
            lambda r: r.get("event") == "lease acquired: relaying" and r.get("epoch", 0) > 1,
            timeout=60,
        )

        primary.resume()  # the old primary comes back as it was
        async with connect(with_database(primary.dsn, database)) as conn:
            assert not await conn.fetchval("SELECT pg_is_in_recovery()")
        old_first = save(
            tmp_path,
            config_dict(multi_host(dsn, primary, standby), nats_url, stream),
            "old-first.yaml",
        )
        restarted = relay_process(["run", "--config", str(old_first)])
        await asyncio.sleep(10)
        claims = [r for r in restarted.logs() if r.get("event") == "lease acquired: relaying"]
        assert not claims, (
            f"a second holder: the replica on the old primary claimed {len(claims)} lane(s) "
            f"while {holder.pid} holds them on the promoted primary: {claims}"
        )


async def test_hosts_given_in_the_query_are_named_when_none_is_a_primary(
    tmp_path: Path, nats_url: str, stream: str
) -> None:
    """docs/configuration.md ("Writing the URL"): the host may be left out of the URL and
    given in `?host=` (with `?port=`), and while no host is a primary the relay says which host
    is a standby and which cannot be reached; docs/delivery.md: `relay check` against a standby
    alone says so and exits 1. With the standby given as `?host=127.0.0.1&port=P`, every
    command says `no primary among the database's hosts ()`: no host named, no standby said."""
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        database = dsn.rpartition("/")[2]
        url = f"postgresql://postgres@/{database}?host=127.0.0.1&port={standby.port}"
        config = save(tmp_path, config_dict(url, nats_url, stream))
        checked = await asyncio.to_thread(run_cli, ["check", "--offline", "-c", str(config)])
        assert checked.returncode == 1, checked.stdout
        assert f"127.0.0.1:{standby.port} is a standby (in recovery" in checked.stderr, (
            checked.stderr
        )


def test_hosts_given_in_the_query_are_named_when_none_can_be_reached(
    tmp_path: Path, nats_url: str, stream: str
) -> None:
    """The same URL form with hosts that refuse connections: the error blames `the default
    host (PGHOST or the local socket)`, which the URL does not use, and names only the last
    host it tried, not each one as for hosts written before the path."""
    ports = [free_port(), free_port()]
    url = f"postgresql://postgres@/app?host=127.0.0.1,127.0.0.1&port={ports[0]},{ports[1]}"
    config = save(tmp_path, config_dict(url, nats_url, stream))
    checked = run_cli(["check", "--offline", "-c", str(config)])
    assert checked.returncode == 1, checked.stdout
    assert "default host" not in checked.stderr, checked.stderr
    for port in ports:
        assert f"127.0.0.1:{port} cannot be reached" in checked.stderr, checked.stderr
