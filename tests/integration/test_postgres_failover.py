"""A failover of Postgres itself: a private primary, its streaming standby, a promotion.

What a user checks: a relay that reaches only a standby (at start-up, or after the primary
died) relays nothing from it, stays up and says which host is a standby, and carries on
once the standby is promoted; `relay check` says the same and fails; a multi-host URL
finds the primary wherever it is, and no committed event is lost across the switch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.demo.embedded import EmbeddedPostgres
from tests.support.db import append_many, connect
from tests.support.delivery import append_backlog, book_lent, event_id
from tests.support.lanes import delivered, status
from tests.support.postgres import create_database, run_sql_file, with_database
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.replication import Standby, multi_host, replicated_pair
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
