"""Watching split outboxes as an operator does: `relay status --json`, and what a consumer got.

Shared by the partition and transition tests. A user checks every committed event, each
aggregate's first deliveries in version order, and how many messages were sent twice
(the streams here keep re-sent copies: their duplicate window is JetStream's shortest).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.delivery import Delivery, Writer, analyse
from tests.support.jetstream import fetch_all
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import LIBRARY_MESSAGES, eventually

Rows = list[dict[str, Any]]
# Loans of every aggregate on one subject; leases that move quickly (a standby tries every
# 300 ms) within the relay's rules.
MESSAGES = {"BookLent": {**LIBRARY_MESSAGES["BookLent"], "destination": "{subject}.loans"}}
LEASE = {"retry_interval": "300ms", "check_interval": "500ms", "check_timeout": "500ms"}


async def status(config: Path) -> Rows:
    """`relay status --json`, run in a thread so that the writers keep writing meanwhile."""
    result = await asyncio.to_thread(run_cli, ["status", "--json", "--config", str(config)])
    assert result.returncode == 0, result.stderr
    rows: Rows = json.loads(result.stdout)
    return rows


def shape(rows: Rows) -> list[int]:
    """How many lanes each replica holds, largest first; [] while one is unheld."""
    if any(row["holder"] is None for row in rows):
        return []
    return sorted(Counter(row["holder"] for row in rows).values(), reverse=True)


def held_by(rows: Rows, replica: RelayProcess) -> list[str]:
    """The lanes this replica holds, by `relay status`."""
    return [
        row["name"] for row in rows if row["holder"] and row["holder"].endswith(f":{replica.pid}")
    ]


async def until(config: Path, predicate: Callable[[Rows], bool], timeout: float = 30) -> None:  # noqa: ASYNC109
    """Wait until `relay status` shows what `predicate` looks for."""

    async def shows() -> bool:
        return predicate(await status(config))

    await eventually(shows, timeout=timeout)


def report(label: str, delivery: Delivery) -> int:
    resent = sum(n - 1 for n in delivery.duplicates.values())
    print(f"{label}: {len(delivery.ids)} stored, {len(delivery.counts)} distinct, {resent} re-sent")
    return resent


async def relayed_more(config: Path, writer: Writer, events: int = 30) -> None:
    """Let the writer append `events` more, then wait until every lane's checkpoint has
    passed them: a while under load, counted in events relayed rather than in seconds."""
    start = len(writer.appended)
    await eventually(lambda: len(writer.appended) >= start + events, timeout=30)
    mark = max(writer.appended)
    await until(config, lambda rows: all((row["checkpoint"] or 0) >= mark for row in rows))


async def delivered(
    nats_url: str, stream: str, expected: set[str], keep: Callable[[str], bool] = lambda _: True
) -> Delivery:
    """Wait for every expected id (re-sent copies count once), then judge; `keep` picks the
    messages of one outbox when several share the stream."""

    async def judged() -> Delivery:
        messages = await fetch_all(nats_url, stream)
        return analyse([m for m in messages if keep(m.headers.get("Nats-Msg-Id", ""))])

    async def complete() -> bool:
        return not (await judged()).missing(expected)

    with contextlib.suppress(AssertionError):  # judged below, with what is missing named
        await eventually(complete, timeout=60, interval=0.2)
    delivery = await judged()
    missing = delivery.missing(expected)
    assert missing == [], f"every committed event is delivered: {len(missing)} missing"
    assert delivery.unexpected(expected) == []
    assert delivery.order_violations == [], "each aggregate's first deliveries in order"
    return delivery


async def delivered_all(nats_url: str, stream: str, writer: Writer) -> Delivery:
    """Every event the writer committed, judged."""
    return await delivered(nats_url, stream, set(writer.appended.values()))
