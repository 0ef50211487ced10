"""Database-level settings an application sets for itself must not break the relay."""

from __future__ import annotations

from pathlib import Path

from tests.support.db import append, connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, load_and_migrate, running, save


async def test_a_tiny_database_statement_timeout_does_not_stop_the_relay(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """`ALTER DATABASE ... SET statement_timeout = '1ms'` is for the application's sessions."""
    subject = unique_name("timeouts")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    data = config_dict(events_table, nats_url, subject)
    config = await load_and_migrate(tmp_path, data)
    async with connect(events_table) as conn:
        name = await conn.fetchval("SELECT current_database()")
        await conn.execute(
            f"ALTER DATABASE \"{name}\" SET statement_timeout = '1ms';"
            f" ALTER DATABASE \"{name}\" SET idle_in_transaction_session_timeout = '50ms';"
            f" ALTER DATABASE \"{name}\" SET idle_session_timeout = '200ms'"
        )
        for version in range(1, 2001):  # enough rows that a read takes longer than 1 ms
            await append(conn, "book", f"b{version % 50}", version, "BookLent", {"loanId": "L"})
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=2000, timeout=60)
        assert len({m.headers["ce-id"] for m in received}) == 2000
        for command in (["status"], ["check"]):
            result = run_cli([*command, "--config", str(save(tmp_path, data))])
            assert result.returncode == 0, result.stderr
    finally:
        await delete_stream(nats_url, subject)
