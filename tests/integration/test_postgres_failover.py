"""A failover of Postgres itself: a private primary, its streaming standby, a promotion.

What a user checks: a relay that reaches only a standby (at start-up, or after the primary
died) relays nothing from it, stays up and says which host is a standby, and carries on
once the standby is promoted; `relay check` says the same and fails; a multi-host URL
finds the primary wherever it is, and no committed event is lost across the switch; with
`source.survive_failover` nothing a failover takes back was published; an old primary
started again beside the promoted one gets no holder. The last four tests came from a
black-box attack (each failed when it was written).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relay.demo.embedded import EmbeddedPostgres
from tests.support.db import append_many, connect
from tests.support.delivery import append_backlog, book_lent, event_id
from tests.support.http import get, http_port
from tests.support.jetstream import fetch_all
from tests.support.lanes import delivered, status
from tests.support.postgres import create_database, run_sql_file, with_database
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.replication import Standby, free_port, multi_host, replicated_pair
from tests.support.scenario import config_dict, eventually, migrate_cli, save

Start = Callable[..., RelayProcess]
STANDBY_SAID = "is a standby (in recovery"


async def replayed_all(primary: EmbeddedPostgres, standby: Standby, database: str) -> None:
    """Wait until the standby has replayed everything the primary has written."""
    async with connect(with_database(primary.dsn, database)) as conn:
        target = await conn.fetchval("SELECT pg_current_wal_lsn()")

    async def caught_up() -> bool:
        async with connect(with_database(standby.dsn, database)) as conn:
            return bool(await conn.fetchval("SELECT pg_last_wal_replay_lsn() >= $1", target))

    await eventually(caught_up, timeout=30)


@dataclass
class Relaying:
    """A relay on a multi-host URL (primary first) that has relayed a first backlog, which
    the standby has replayed."""

    dsn: str  # on the primary
    database: str
    relay: RelayProcess
    first: dict[int, str]


async def relaying(  # noqa: PLR0917 - the test's fixtures, passed on
    tmp_path: Path,
    pair: tuple[EmbeddedPostgres, Standby],
    nats_url: str,
    stream: str,
    relay_process: Start,
    survive: dict[str, Any] | None,
    backlog: int,
) -> Relaying:
    primary, standby = pair
    dsn = create_database(primary.dsn)
    database = dsn.rpartition("/")[2]
    run_sql_file(dsn)
    data = config_dict(multi_host(dsn, primary, standby), nats_url, stream)
    if survive is not None:
        data["source"]["survive_failover"] = survive
    config = save(tmp_path, data)
    migrate_cli(config)
    first = await append_backlog(dsn, backlog, aggregates=backlog // 5)
    relay = relay_process(["run", "--config", str(config)])
    await delivered(nats_url, stream, set(first.values()))
    await replayed_all(primary, standby, database)
    return Relaying(dsn, database, relay, first)


def said(record: dict[str, Any], words: str) -> bool:
    return words in json.dumps(record)


async def test_a_relay_that_reaches_only_a_standby_waits_and_relays_once_it_is_promoted(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start
) -> None:
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        database = dsn.rpartition("/")[2]
        run_sql_file(dsn)
        config = save(tmp_path, config_dict(dsn, nats_url, stream))
        migrate_cli(config)
        backlog = await append_backlog(dsn, 20, aggregates=4)
        await replayed_all(primary, standby, database)
        primary.halt("immediate")

        on_standby = save(
            tmp_path,
            config_dict(with_database(standby.dsn, database), nats_url, stream),
            "standby.yaml",
        )
        checked = await asyncio.to_thread(run_cli, ["check", "--offline", "-c", str(on_standby)])
        assert checked.returncode == 1, checked.stdout
        assert STANDBY_SAID in checked.stderr, checked.stderr

        relay = relay_process(["run", "--config", str(on_standby)])
        await relay.wait_for_log(lambda r: said(r, f"127.0.0.1:{standby.port} {STANDBY_SAID}"))
        assert relay.returncode is None, "it waits for a primary instead of exiting"

        standby.promote()
        await delivered(nats_url, stream, set(backlog.values()))
        assert relay.returncode is None


async def test_a_multi_host_url_follows_the_primary_through_a_failover(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start
) -> None:
    """The standby is listed first: the relay passes over it to the primary, and after the
    primary is killed and the standby promoted, carries on there with nothing lost and one
    holder."""
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        database = dsn.rpartition("/")[2]
        run_sql_file(dsn)
        both = multi_host(dsn, standby, primary)
        config = save(tmp_path, config_dict(both, nats_url, stream))
        migrate_cli(config)
        first = await append_backlog(dsn, 30, aggregates=5)
        replicas = [relay_process(["run", "--config", str(config)]) for _ in range(2)]
        await delivered(nats_url, stream, set(first.values()))

        await replayed_all(primary, standby, database)
        primary.halt("immediate")
        for replica in replicas:
            await replica.wait_for_log(
                lambda r: (
                    said(r, f"127.0.0.1:{standby.port} {STANDBY_SAID}")
                    and said(r, f"127.0.0.1:{primary.port} cannot be reached")
                )
            )
        standby.promote()
        promoted = with_database(standby.dsn, database)
        later = [book_lent(f"after-{i % 5 + 1}", i // 5 + 1) for i in range(30)]
        async with connect(promoted) as conn:
            await append_many(conn, later)
        second = {event_id(e.aggregate_id, e.version) for e in later}
        await delivered(nats_url, stream, set(first.values()) | second)

        rows = await status(config)
        assert all(row["holder"] for row in rows), rows
        assert all(replica.returncode is None for replica in replicas)


async def ids_in(dsn: str) -> set[str]:
    async with connect(dsn) as conn:
        rows = await conn.fetch("SELECT aggregate_id, version FROM events")
    return {event_id(r["aggregate_id"], r["version"]) for r in rows}


@pytest.mark.parametrize("survive", [True, False], ids=["survive_failover", "plain"])
async def test_events_a_failover_takes_back_are_published_only_without_survive_failover(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start, survive: bool
) -> None:
    """Asynchronous replication, and the standby's link frozen while writers commit: the
    primary acknowledges commits the standby never gets, then dies, and the standby is
    promoted. Plainly, the relay has published those events already (phantoms: consumers
    hold events the database no longer has). With `source.survive_failover`, it held them
    back until a standby had them, so it published none of them; nothing is lost either
    way."""
    with replicated_pair(frozen_link=True) as (primary, standby):
        assert standby.via is not None
        # After the failover no standby is left: publish without one then.
        option = {"standbys": 1, "without_standbys": "publish"} if survive else None
        r = await relaying(
            tmp_path, (primary, standby), nats_url, stream, relay_process, option, 20
        )
        dsn, database, relay, first = r.dsn, r.database, r.relay, r.first

        standby.via.pause()
        lost_commits = [book_lent(f"lost-{i % 5 + 1}", i // 5 + 1) for i in range(30)]
        async with connect(dsn) as conn:
            await append_many(conn, lost_commits)
        taken_back = {event_id(e.aggregate_id, e.version) for e in lost_commits}
        if survive:
            await relay.wait_for_log("holding events back until standbys have them")
            on_stream = {m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)}
            assert not on_stream & taken_back, "published before a standby had them"
        else:
            await delivered(nats_url, stream, set(first.values()) | taken_back)
        primary.halt("immediate")
        standby.promote()

        promoted = with_database(standby.dsn, database)
        later = [book_lent(f"after-{i % 5 + 1}", i // 5 + 1) for i in range(10)]
        async with connect(promoted) as conn:
            await append_many(conn, later)
        survived = await ids_in(promoted)
        assert not survived & taken_back, "the failover took those commits back"
        delivery = await delivered(
            nats_url, stream, survived, keep=lambda i: not i.startswith("book/lost-")
        )
        phantoms = {m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)}
        phantoms -= survived
        print(f"survive_failover={survive}: {len(phantoms)} phantom(s), {len(delivery.ids)} stored")
        assert phantoms == (set() if survive else taken_back)


async def test_with_no_standby_streaming_events_are_held_back_and_status_says_why(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start
) -> None:
    """`without_standbys: wait`: while the standby is down nothing is published; the lane's
    `relay status` and the `relay_standbys_missing` gauge say why; once the standby streams
    again and has the events, they go out."""
    with replicated_pair() as (primary, standby):
        dsn = create_database(primary.dsn)
        run_sql_file(dsn)
        data = config_dict(dsn, nats_url, stream)
        data["source"]["survive_failover"] = {"standbys": 1}
        config = save(tmp_path, data)
        migrate_cli(config)
        relay = relay_process(["run", "--config", str(config)])
        port = await http_port(relay)
        first = await append_backlog(dsn, 10, aggregates=2)
        await delivered(nats_url, stream, set(first.values()))

        standby.halt()
        held = [book_lent(f"held-{i % 2 + 1}", i // 2 + 1) for i in range(10)]
        async with connect(dsn) as conn:
            await append_many(conn, held)
        await relay.wait_for_log("holding events back until standbys have them")

        async def says_why() -> bool:
            (row,) = await status(config)
            return bool(row["state"] == "waiting for standbys")

        await eventually(says_why, timeout=30)
        (row,) = await status(config)
        assert "0 standby(s) streaming, 1 needed" in row["last_error"], row
        _, metrics = await get(port, "/metrics")
        assert 'relay_standbys_missing{outbox="loans"} 1.0' in metrics
        assert 'relay_lag_events{outbox="loans"} 10.0' in metrics, "the lag is measured"
        on_stream = {m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)}
        assert on_stream == set(first.values()), "nothing published while no standby streams"

        standby.resume()
        later = {event_id(e.aggregate_id, e.version) for e in held}
        await delivered(nats_url, stream, set(first.values()) | later)
        (row,) = await status(config)
        assert row["state"] != "waiting for standbys", row
        _, metrics = await get(port, "/metrics")
        assert 'relay_standbys_missing{outbox="loans"} 0.0' in metrics


# -- found attacking ---------------------------------------------------------------------


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
    reach the standby. The application then writes its next events on the new primary at the
    versions its store now has, the lost ones' versions: the same message ids, other events.
    Had the relay published the lost ones (phantoms), JetStream would drop the new ones as
    their duplicates and consumers that deduplicate on the id would never see them (found
    attacking: 118 of them in one run). With `source.survive_failover` the lost ones were
    never published, so the new ones go out under those ids; the promoted primary gets a
    standby of its own (rebuilt from it, as an operator does) before anything goes out."""
    with replicated_pair() as (primary, standby):
        r = await relaying(
            tmp_path, (primary, standby), nats_url, stream, relay_process, {"standbys": 1}, 10
        )
        dsn, database, relay = r.dsn, r.database, r.relay

        await cut_off(standby)
        books = [f"book-{i}" for i in range(1, 6)]
        lost = await next_loans(dsn, books, "before-failover")
        await relay.wait_for_log("holding events back until standbys have them")
        stored = {m.headers.get("ce-id") for m in await fetch_all(nats_url, stream)}
        assert not stored & set(lost), "published before a standby had them"
        primary.halt("immediate")
        standby.promote()
        rebuilt = Standby(standby)  # the promoted primary's own standby
        try:
            await asyncio.to_thread(rebuilt.start)
            promoted = with_database(standby.dsn, database)
            later = await next_loans(promoted, books, "after-failover")
            assert set(later) == set(lost), "the application reuses the lost versions"

            async def on_stream() -> bool:
                messages = await fetch_all(nats_url, stream)
                seen = {
                    (m.headers.get("ce-id"), json.loads(m.data).get("loanId")) for m in messages
                }
                return all((msg_id, loan) in seen for msg_id, loan in later.items())

            await eventually(on_stream, timeout=60, interval=0.5)
            loans = {json.loads(m.data).get("loanId") for m in await fetch_all(nats_url, stream)}
            assert not loans & set(lost.values()), "no phantom: nothing lost was published"
        finally:
            rebuilt.stop()
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
    each host whether it is in recovery but did not notice that two hosts of its URL both
    said no (found attacking: both lanes held on both databases). Now it uses neither while
    two hosts answer as primaries, and says so."""
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
        await restarted.wait_for_log(lambda r: "split brain" in json.dumps(r), timeout=60)
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
