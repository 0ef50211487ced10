"""One contract, every broker: what a consumer receives, outages, and permanent rejections.

The relay runs for real (in this process) against real Postgres and the real
broker; only the broker's harness differs from one run to the next.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from relay.cli.check import run_check
from relay.config import RelayConfig
from tests.contract.harness import BrokerHarness, Consumed
from tests.support.db import NewEvent, append_many, connect
from tests.support.scenario import eventually, load_and_migrate, running, status

EVENT_TYPES: dict[str, dict[str, Any]] = {
    "BookLent": {
        "type": "library.book-lent.v1",
        "payload": {"bookId": "aggregate_id", "loanId": "data.loanId", "version": "version"},
    },
    "BookReturned": {
        "type": "library.book-returned.v1",
        "payload": "{bookId: aggregate_id, loanId: data.loanId, version: version}",
    },
}


def relay_config(dsn: str, broker: BrokerHarness) -> dict[str, Any]:
    messages = {
        event_type: {**rule, "destination": broker.destination()}
        for event_type, rule in EVENT_TYPES.items()
    }
    return {
        "database": {"url": dsn},
        "source": {"poll_interval": "100ms"},
        "brokers": {"under-test": broker.broker_config()},
        "outboxes": {
            "loans": {
                "broker": "under-test",
                "messages": messages,
                "retry": {"initial": "50ms", "max": "500ms"},
                "park_after": 3,
                "batch": {"max_messages": 25},
            }
        },
        "logging": {"level": "warning", "format": "json"},
        "http": {"port": 0, "host": "127.0.0.1"},
    }


def loans(books: int, versions: int, first_version: int = 1) -> list[NewEvent]:
    """Interleaved across books, so that per-key order is really tested."""
    return [
        NewEvent(
            "book",
            f"book-{b}",
            v,
            "BookLent" if v % 2 else "BookReturned",
            {"loanId": f"loan-{b}-{v}"},
        )
        for v in range(first_version, first_version + versions)
        for b in range(books)
    ]


async def refused_in_preview(config: RelayConfig, last: int) -> set[str]:
    """The ids of the messages `relay check --last` shows the broker's adapter refusing."""
    report = await run_check(config, last)
    assert not report.problems, report.problems
    return {row["id"] for row in report.rows if row.get("parked") == "rejected"}


def check_per_key_order(messages: list[Consumed]) -> None:
    """Each book's versions arrive in increasing order (first delivery of each id)."""
    seen: set[str] = set()
    by_book: dict[str, list[int]] = defaultdict(list)
    for message in messages:
        if message.id in seen:
            continue  # at least once: a re-delivery is allowed, a reordering is not
        seen.add(message.id)
        body = json.loads(message.body)
        by_book[body["bookId"]].append(body["version"])
    for book, versions in by_book.items():
        assert versions == sorted(versions), f"{book} out of order: {versions}"


async def test_consumer_gets_body_id_type_and_per_key_order(
    broker: BrokerHarness, events_table: str, tmp_path: Path
) -> None:
    config = await load_and_migrate(tmp_path, relay_config(events_table, broker))
    events = loans(books=6, versions=10)
    async with connect(events_table) as conn:
        await append_many(conn, events)
    async with running(config):
        received = await broker.consume(expected=len(events))
    ids = {m.id for m in received}
    assert ids == {f"book/{e.aggregate_id}@{e.version}" for e in events}
    for message in received:
        body = json.loads(message.body)
        book, version = message.id.removeprefix("book/").split("@")
        assert body["bookId"] == book and body["version"] == int(version)
        assert body["loanId"] == f"loan-{book.removeprefix('book-')}-{version}"
        expected_type = "library.book-lent.v1" if int(version) % 2 else "library.book-returned.v1"
        assert message.type == expected_type
        if message.key is not None:
            assert message.key == book
    check_per_key_order(received)


async def test_outage_is_retried_and_nothing_is_lost(
    broker: BrokerHarness, events_table: str, tmp_path: Path
) -> None:
    config = await load_and_migrate(tmp_path, relay_config(events_table, broker))
    before, during = loans(books=3, versions=4), loans(books=3, versions=4, first_version=5)
    async with connect(events_table) as conn, running(config) as relay:
        await append_many(conn, before)
        await broker.consume(expected=len(before))
        async with broker.outage():
            await append_many(conn, during)  # commands never wait on the broker

            async def retrying() -> bool:
                rows = await status(config)
                return rows[0]["state"] == "retrying" and relay.states["loans"].attempts >= 2

            await eventually(retrying, timeout=30)
        received = await broker.consume(expected=len(before) + len(during), timeout=60)
    assert {m.id for m in received} == {
        f"book/{e.aggregate_id}@{e.version}" for e in before + during
    }
    check_per_key_order(received)


async def test_permanent_rejection_is_parked_and_the_rest_flows(
    broker: BrokerHarness, events_table: str, tmp_path: Path
) -> None:
    config = await load_and_migrate(tmp_path, relay_config(events_table, broker))
    huge = "x" * broker.oversized()
    events = [
        NewEvent("book", "ok", 1, "BookLent", {"loanId": "first"}),
        NewEvent("book", "big", 1, "BookLent", {"loanId": huge}),
        NewEvent("book", "ok", 2, "BookReturned", {"loanId": "second"}),
    ]
    async with connect(events_table) as conn:
        positions = await append_many(conn, events)
    async with running(config):
        received = await broker.consume(expected=2)

        async def parked() -> bool:
            return bool((await status(config))[0]["parked"] == 1)

        await eventually(parked, timeout=30)
    assert [m.id for m in received] == ["book/ok@1", "book/ok@2"]
    async with connect(events_table) as conn:
        row = await conn.fetchrow("SELECT * FROM relay.parked")
    assert row["position"] == positions[1]
    assert row["reason"] == "rejected"
    assert row["message_id"] == "book/big@1"
    # Where the limit is known before sending, no retry can mend it: parked at its first
    # attempt; a refusal only the broker's answer gives is retried park_after (3) times.
    assert row["attempts"] == (1 if broker.limit_known_before_sending else 3)
    # `relay check --last` foretells it where the limit is known before sending; it never
    # shows as refused a message that went through.
    foretold = await refused_in_preview(config, len(events))
    assert foretold == ({"book/big@1"} if broker.limit_known_before_sending else set())


# Aggregate ids a user may choose that a client library could rewrite on the way (nats-py
# turns CR and LF into spaces and strips header values), so that two events share an id.
AWKWARD_IDS = ["alice\nsmith", "alice\r\nsmith", "alice smith ", "\talice smith", "alice smith"]


async def test_an_id_arrives_as_written_or_is_parked_never_altered(
    broker: BrokerHarness, events_table: str, tmp_path: Path
) -> None:
    config = await load_and_migrate(tmp_path, relay_config(events_table, broker))
    events = [NewEvent("book", i, 1, "BookLent", {"loanId": "L"}) for i in AWKWARD_IDS]
    async with connect(events_table) as conn:
        await append_many(conn, events)
        async with running(config):

            async def settled() -> bool:  # each event published or parked
                return bool((await status(config))[0]["lag_events"] == 0)

            await eventually(settled, timeout=30)
            parked = {r["message_id"] for r in await conn.fetch("SELECT * FROM relay.parked")}
            received = await broker.consume(expected=len(events) - len(parked))
    written = {f"book/{i}@1" for i in AWKWARD_IDS}
    ids = [m.id for m in received]
    assert set(ids) <= written, f"ids altered on the way: {set(ids) - written}"
    assert set(ids) | parked == written, "an event neither arrived nor was parked"
    assert "book/alice smith@1" in ids  # never dropped as the duplicate of another id
    # What `relay check --last` shows as refused is exactly what the relay parked.
    assert await refused_in_preview(config, len(events)) == parked
    for message in received:
        assert broker.cloudevent(message).get_id() == message.id
