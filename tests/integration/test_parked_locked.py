"""Someone holds `relay.parked` locked (a `LOCK TABLE` by hand, a backup tool, a migration
of another release): events that park nothing must still go out, and a new holder must
still take the lane. The holder read the parked count for its gauge once a second, on the
loop that delivers, and that read waited behind the lock: the lane stalled, at a handover
as at any time, with nothing to say why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.db import append, connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.scenario import config_dict, load_and_migrate, running

pytestmark = pytest.mark.timeout(120)


async def test_events_go_out_while_the_parked_table_is_locked(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("locked")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    try:
        async with connect(events_table) as locker, connect(events_table) as writer:
            await locker.execute("BEGIN")
            await locker.execute("LOCK TABLE relay.parked IN ACCESS EXCLUSIVE MODE")
            try:
                async with running(config):  # a first holder: its claim, then its loop
                    for n in range(3):
                        await append(writer, "book", f"b{n}", 1, "BookLent", {"loanId": "L"})
                        await asyncio.sleep(0.6)  # a duration: past the gauges' second
                    received = await fetch_all(nats_url, subject, expected=3, timeout=20)
                    assert len(received) == 3
            finally:
                await locker.execute("ROLLBACK")
    finally:
        await delete_stream(nats_url, subject)
