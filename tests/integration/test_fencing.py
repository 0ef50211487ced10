"""Fencing at the SQL level: only the lock holder, at its epoch, moving forwards, may write."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from relay.core.delivery import RetryCount
from relay.errors import FencedError
from relay.postgres.lease import lock_key
from relay.postgres.store import Store
from tests.support.db import connect
from tests.support.jetstream import unique_name
from tests.support.scenario import config_dict, load_and_migrate


async def test_checkpoint_writes_are_fenced(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    await load_and_migrate(tmp_path, config_dict(events_table, nats_url, unique_name("f")))
    store, key = Store("relay"), lock_key("relay", "loans")
    async with connect(events_table) as a, connect(events_table) as b:
        assert await a.fetchval("SELECT pg_try_advisory_lock($1)", key)
        first = await store.claim(a, "loans", "replica-a", 0, key)
        await store.advance(a, first, 5)

        with pytest.raises(FencedError, match="backwards"):
            await store.advance(a, first, 3)
        with pytest.raises(FencedError):  # right epoch, but this connection has no lock
            await store.advance(b, first, 10)
        with pytest.raises(FencedError, match="without holding its lease"):
            await store.claim(b, "loans", "replica-b", 0, key)

        # The lease moves to b, which claims the next epoch.
        assert await a.fetchval("SELECT pg_advisory_unlock($1)", key)
        assert await b.fetchval("SELECT pg_try_advisory_lock($1)", key)
        second = await store.claim(b, "loans", "replica-b", 0, key)
        assert second.epoch == first.epoch + 1
        assert second.position == 5
        with pytest.raises(FencedError):  # a zombie: no lock and a stale epoch
            await store.advance(a, first, 20)

        # Even holding the lock again, a stale epoch is refused.
        assert await b.fetchval("SELECT pg_advisory_unlock($1)", key)
        assert await a.fetchval("SELECT pg_try_advisory_lock($1)", key)
        with pytest.raises(FencedError):
            await store.advance(a, first, 20)
        with pytest.raises(FencedError):
            await store.report(a, first, "retrying", 1, "x")

        row = await a.fetchrow("SELECT position, epoch, holder FROM relay.checkpoints")
        assert (row["position"], row["epoch"], row["holder"]) == (5, second.epoch, "replica-b")
        await a.execute("SELECT pg_advisory_unlock_all()")


def test_lock_key_is_stable_and_namespaced() -> None:
    assert lock_key("relay", "loans") == lock_key("relay", "loans")
    assert lock_key("relay", "loans") != lock_key("billing", "loans")
    assert lock_key("relay", "loans") != lock_key("relay", "fines")
    # The documented formula; changing it would let two relay versions hold one outbox at once.
    digest = hashlib.sha256(b"relay/loans-outbox").digest()
    assert lock_key("relay", "loans-outbox") == int.from_bytes(digest[:8], "big", signed=True)
    assert -(2**63) <= lock_key("x", "y") < 2**63


async def test_the_checkpoint_moving_up_to_a_failing_message_keeps_its_count(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """After a replay, the events before the message being retried go through again: the
    count recorded for it stays (a new holder goes on with it) until the checkpoint passes it."""
    await load_and_migrate(tmp_path, config_dict(events_table, nats_url, unique_name("f")))
    store, key = Store("relay"), lock_key("relay", "loans")
    async with connect(events_table) as conn:
        assert await conn.fetchval("SELECT pg_try_advisory_lock($1)", key)
        claim = await store.claim(conn, "loans", "replica-a", 0, key)
        retry = RetryCount(position=8, attempts=7, rejections=6)
        await store.report(conn, claim, "retrying", retry.attempts, "too large", retry=retry)
        await store.advance(conn, claim, 7)
        again = await store.claim(conn, "loans", "replica-a", 0, key)
        assert (again.retry, again.position) == (retry, 7)
        await store.advance(conn, again, 8)
        last = await store.claim(conn, "loans", "replica-a", 0, key)
        assert last.retry is None
        await conn.execute("SELECT pg_advisory_unlock_all()")
