"""asyncpg's reply to a statement whose caller gave up, failed by the connection's loss
later: asyncio logged it at error level ("Future exception was never retrieved ...
unexpected connection_lost() call") on every cut connection, though the caller had already
handled its own timeout. The relay's loop handler says it at debug instead, and lets every
other unretrieved error through."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import asyncpg
import pytest

from relay.runtime.log_noise import quiet_lost_replies
from tests.support import postgres
from tests.support.proxy import TcpProxy
from tests.support.scenario import config_dict, eventually, load_and_migrate, running


async def _timed_out_then_cut(dsn: str, proxy: TcpProxy) -> None:
    conn = await asyncpg.connect(postgres.with_address(dsn, proxy.host, proxy.port))
    proxy.pause()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conn.fetchval("SELECT 1"), 0.3)
    proxy.cut()
    await eventually(conn.is_closed)  # asyncpg sees the loss: connection_lost() fails the waiter
    del conn
    for _ in range(3):  # the waiter is logged when it is collected
        gc.collect()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("quiet", [False, True], ids=["asyncio's handler", "the relay's"])
async def test_a_reply_lost_after_its_caller_gave_up_is_not_an_error(
    quiet: bool, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    proxy = TcpProxy(*postgres.address(database))
    try:
        if quiet:
            quiet_lost_replies(loop)
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            await _timed_out_then_cut(database, proxy)
        errors = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
        if quiet:
            assert errors == []
        else:  # the scenario does reproduce what the relay quiets
            assert any("never retrieved" in r.getMessage() for r in errors), caplog.records
    finally:
        loop.set_exception_handler(previous)
        proxy.close()


async def test_other_unretrieved_errors_still_reach_asyncios_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    try:
        quiet_lost_replies(loop)
        future: asyncio.Future[None] = loop.create_future()
        future.set_exception(ConnectionError("a broker's socket closed"))
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            del future
            gc.collect()
        assert any("never retrieved" in r.getMessage() for r in caplog.records)
    finally:
        loop.set_exception_handler(previous)


async def test_the_relay_quiets_lost_replies_while_it_runs(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, "lost-replies"))
    async with running(config):
        await asyncio.sleep(0)  # the relay's task has started
        assert loop.get_exception_handler() is not before
    assert loop.get_exception_handler() is before
