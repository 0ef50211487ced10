"""Several messages per event, `when` and JSON Schemas, end to end on real brokers and Postgres.

v1 and v2 of one event go side by side, each in per-aggregate order; a condition skips
what it rejects; a body against its schema is parked with reason `schema`, alone, and
published by `relay retry-parked` once the schema is fixed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from relay.config import RelayConfig, load_config
from relay.postgres.store import Store
from relay.runtime.runner import Relay
from tests.support.db import NewEvent, append_many, connect
from tests.support.jetstream import (
    CAPPED,
    STREAM_REFUSED,
    Received,
    create_stream,
    delete_stream,
    fetch_all,
    unique_name,
)
from tests.support.kafka_server import TansuServer, consume, create_topic, headers, unique_topic
from tests.support.relay_process import run_cli
from tests.support.scenario import (
    config_dict,
    eventually,
    load_and_migrate,
    running,
    save,
    status,
)

V1: dict[str, Any] = {
    "type": "library.book-lent.v1",
    "destination": "{subject}.v1",
    "payload": {"bookId": "aggregate_id", "memberId": "data.memberId", "version": "version"},
}
V2: dict[str, Any] = {
    "type": "library.book-lent.v2",
    "destination": "{subject}.v2",
    "payload": {
        "bookId": "aggregate_id",
        "member": "{id: data.memberId || data.member.id}",
        "version": "version",
    },
}
SCHEMA: dict[str, Any] = {
    "$id": "https://schemas.example.com/library/book-lent.v2.json",
    "type": "object",
    "required": ["bookId", "member", "version"],
    "properties": {
        "member": {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}
    },
}


def lending(books: int, versions: int) -> list[NewEvent]:
    """Loans of several books, interleaved; some stored in the old shape, some in the new."""
    return [
        NewEvent(
            "book",
            f"b{b}",
            v,
            "BookLent",
            {"memberId": f"m{b}-{v}"} if v % 2 else {"member": {"id": f"m{b}-{v}"}},
        )
        for v in range(1, versions + 1)
        for b in range(books)
    ]


def in_order(ids: list[str], suffix: str) -> dict[str, list[int]]:
    """Each aggregate's versions in the order received, from ids `book/b1@2<suffix>`."""
    seen: dict[str, list[int]] = defaultdict(list)
    for id_ in ids:
        book, version = id_.removeprefix("book/").removesuffix(suffix).split("@")
        seen[book].append(int(version))
    return dict(seen)


async def test_v1_and_v2_side_by_side_in_order_on_nats(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("rules")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    data = config_dict(events_table, nats_url, subject, messages={"BookLent": [V1, V2]})
    config = await load_and_migrate(tmp_path, data)
    events = lending(books=3, versions=4)
    try:
        async with connect(events_table) as conn:
            await append_many(conn, events)
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=2 * len(events))
        v1 = [m for m in received if m.subject == f"{subject}.v1"]
        v2 = [m for m in received if m.subject == f"{subject}.v2"]
        assert len(v1) == len(v2) == len(events)
        for messages, type_ in ((v1, V1["type"]), (v2, V2["type"])):
            ids = [m.headers["ce-id"] for m in messages]
            assert len(set(ids)) == len(ids)
            assert {m.headers["ce-type"] for m in messages} == {type_}
            assert all(v == [1, 2, 3, 4] for v in in_order(ids, f"/{type_}").values())
        # One v2 rule reads both stored shapes.
        assert {m.json()["member"]["id"] for m in v2} == {
            e.payload.get("memberId") or e.payload["member"]["id"] for e in events
        }
    finally:
        await delete_stream(nats_url, subject)


async def test_v1_and_v2_side_by_side_in_order_on_kafka(
    tansu: TansuServer, events_table: str, tmp_path: Path
) -> None:
    topic = unique_topic("rules")
    for version in ("v1", "v2"):
        await create_topic(tansu.bootstrap, f"{topic}.{version}", partitions=3)
    config = await load_and_migrate(
        tmp_path,
        {
            "database": {"url": events_table},
            "source": {"poll_interval": "100ms"},
            "brokers": {
                "kafka": {
                    "type": "kafka",
                    "bootstrap_servers": [tansu.bootstrap],
                    "enable_idempotence": False,
                    "ack_timeout": "2s",
                }
            },
            "outboxes": {
                "loans": {
                    "broker": "kafka",
                    "messages": {
                        "BookLent": [
                            {**V1, "destination": f"{topic}.v1"},
                            {**V2, "destination": f"{topic}.v2", "schema": SCHEMA},
                        ]
                    },
                    "retry": {"initial": "50ms", "max": "300ms"},
                }
            },
            "logging": {"level": "warning", "format": "json"},
        },
    )
    events = lending(books=4, versions=3)
    async with connect(events_table) as conn:
        await append_many(conn, events)
    async with running(config):
        v1 = await consume(tansu.bootstrap, f"{topic}.v1", expected=len(events), timeout=60)
        v2 = await consume(tansu.bootstrap, f"{topic}.v2", expected=len(events), timeout=60)
    for records, type_ in ((v1, V1["type"]), (v2, V2["type"])):
        ids = [headers(r)["ce_id"] for r in records]  # partition after partition
        assert len(ids) == len(set(ids)) == len(events)
        assert all(v == [1, 2, 3] for v in in_order(ids, f"/{type_}").values())
        assert all(
            r.key.decode() == ids[i].split("/")[1].split("@")[0] for i, r in enumerate(records)
        )
    assert {headers(r).get("ce_type") for r in v2} == {V2["type"]}
    # The schema's $id travels as the CloudEvents dataschema; v1 has no schema, so none.
    assert {headers(r).get("ce_dataschema") for r in v2} == {SCHEMA["$id"]}
    assert {headers(r).get("ce_dataschema") for r in v1} == {None}


@pytest.mark.parametrize("condition", [True, False], ids=["when-on", "when-off"])
async def test_when_publishes_to_the_second_subject_only_what_it_accepts(
    condition: bool, events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("when")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    priority = {
        **V1,
        "destination": "{subject}.priority",
        "id": "{aggregate_type}/{aggregate_id}@{version}/priority",
    }
    if condition:
        priority["when"] = "data.priority == 'high'"
    data = config_dict(events_table, nats_url, subject, messages={"BookLent": [V1, priority]})
    config = await load_and_migrate(tmp_path, data)
    levels = ["high", "low", None, "high"]
    try:
        async with connect(events_table) as conn:
            await append_many(
                conn,
                [
                    NewEvent("book", "b1", v, "BookLent", {"memberId": "m", "priority": level})
                    for v, level in enumerate(levels, start=1)
                ],
            )
        expected_priority = [1, 4] if condition else [1, 2, 3, 4]
        async with running(config) as relay:
            received = await fetch_all(
                nats_url, subject, expected=len(levels) + len(expected_priority)
            )
            await eventually(lambda: (relay.states["loans"].checkpoint or 0) > 0)
            skipped = relay.metrics.registry.get_sample_value(
                "relay_messages_skipped_total",
                {"outbox": "loans", "type": V1["type"], "reason": "when"},
            )
        by_subject: dict[str, list[int]] = defaultdict(list)
        for message in received:
            by_subject[message.subject.rsplit(".", 1)[1]].append(message.json()["version"])
        assert by_subject == {"v1": [1, 2, 3, 4], "priority": expected_priority}
        assert skipped == (2 if condition else None)
    finally:
        await delete_stream(nats_url, subject)


async def parked_rows(dsn: str) -> list[Any]:
    async with connect(dsn) as conn:
        return await Store("relay").parked(conn, "loans")


def ids_of(received: list[Received], version: str) -> list[str]:
    return [m.headers["ce-id"] for m in received if m.subject.endswith(f".{version}")]


async def test_a_schema_violation_is_parked_alone_then_published_once_the_schema_is_fixed(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    subject = unique_name("schema")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    # Too strict: only members whose id starts with m2.
    member = {"properties": {"id": {"type": "string", "pattern": "^m2"}}}
    strict = {**SCHEMA, "properties": {"member": member}}
    (tmp_path / "schemas").mkdir()
    schema_file = tmp_path / "schemas" / "book-lent.v2.json"
    schema_file.write_text(json.dumps(strict))
    v2 = {**V2, "schema": "schemas/book-lent.v2.json"}
    data = config_dict(events_table, nats_url, subject, messages={"BookLent": [V1, v2]})
    path = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(path)]).returncode == 0
    config = load_config(path)
    try:
        async with connect(events_table) as conn:
            poison, later = await append_many(
                conn,
                [
                    NewEvent("book", "b1", 1, "BookLent", {"memberId": "m1"}),
                    NewEvent("book", "b2", 1, "BookLent", {"member": {"id": "m2", "since": 1}}),
                ],
            )
        async with running(config) as relay:
            received = await fetch_all(nats_url, subject, expected=3)
            await eventually(lambda: _count(events_table, 1))
            await past_the_parked_event(relay, subject, later, received)
        (row,) = await parked_rows(events_table)
        assert (row.position, row.reason, row.rule) == (poison, "schema", V2["type"])
        assert "$.member.id: 'm1' does not match '^m2'" in row.error
        assert "outboxes.loans.messages.BookLent.1" in row.error and "book/b1@1" in row.error

        # The schema was too strict: fixed in the file, then the parked message retried.
        schema_file.write_text(json.dumps(SCHEMA))
        retried = run_cli(["retry-parked", "loans", "--all", "--config", str(path), "--json"])
        assert retried.returncode == 0, retried.stderr
        assert await parked_rows(events_table) == []
        received = await fetch_all(nats_url, subject, expected=4)
        assert ids_of(received, "v2") == [
            "book/b2@1/library.book-lent.v2",
            "book/b1@1/library.book-lent.v2",  # after its successor: the parking exception
        ]
        assert len(ids_of(received, "v1")) == 2  # only the parked rule's message was re-sent
        assert received[-1].json() == {"bookId": "b1", "member": {"id": "m1"}, "version": 1}
        assert received[-1].headers["ce-dataschema"] == SCHEMA["$id"]
    finally:
        await delete_stream(nats_url, subject)


async def past_the_parked_event(
    relay: Relay, subject: str, later: int, received: list[Received]
) -> None:
    """b1's v2 parked: the relay moved on to b2, and b1's v1 went out once, not at each retry."""
    await eventually(lambda: relay.states["loans"].checkpoint == later)
    published = relay.metrics.registry.get_sample_value(
        "relay_messages_published_total", {"outbox": "loans", "destination": f"{subject}.v1"}
    )
    assert published == 2
    assert ids_of(received, "v1") == [
        "book/b1@1/library.book-lent.v1",
        "book/b2@1/library.book-lent.v1",
    ]
    assert ids_of(received, "v2") == ["book/b2@1/library.book-lent.v2"]


async def _count(dsn: str, expected: int) -> bool:
    return len(await parked_rows(dsn)) == expected


async def test_a_rejected_rule_blocks_later_events_then_is_parked_alone(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """v2 carries the whole stored payload, too large for the stream (its answer, so retried
    `park_after` times): v1 of the event goes once. One event a batch: JetStream would store
    a later event sent in the same batch as the refused message (docs/delivery.md)."""
    subject = unique_name("block")
    await create_stream(nats_url, subject, [f"{subject}.>"], max_msg_size=CAPPED)
    whole = {**V2, "payload": "data"}
    retry = {"initial": "100ms", "max": "100ms", "jitter": 0}
    data = config_dict(
        events_table,
        nats_url,
        subject,
        messages={"BookLent": [V1, whole]},
        park_after=5,
        retry=retry,
        batch={"max_messages": 1},
    )
    config: RelayConfig = await load_and_migrate(tmp_path, data)
    try:
        async with connect(events_table) as conn:
            poison, later = await append_many(
                conn,
                [
                    NewEvent(
                        "book", "b1", 1, "BookLent", {"memberId": "m", "x": "y" * STREAM_REFUSED}
                    ),
                    NewEvent("book", "b2", 1, "BookLent", {"memberId": "m"}),
                ],
            )
        async with running(config) as relay:
            await eventually(
                lambda: "loans" in relay.states and relay.states["loans"].attempts >= 2
            )
            blocked = await fetch_all(nats_url, subject)
            assert ids_of(blocked, "v1") == ["book/b1@1/library.book-lent.v1"]
            assert ids_of(blocked, "v2") == []  # the later event waits behind the failure
            assert (await status(config))[0]["checkpoint"] < poison
            received = await fetch_all(nats_url, subject, expected=3)
            await past_the_parked_event(relay, subject, later, received)
        (row,) = await parked_rows(events_table)
        assert (row.position, row.reason, row.rule) == (poison, "rejected", V2["type"])
        assert row.attempts == 5 and row.message_id == "book/b1@1/library.book-lent.v2"
    finally:
        await delete_stream(nats_url, subject)


def test_relay_run_refuses_a_missing_schema_file_naming_file_line_and_key(
    tmp_path: Path,
) -> None:
    data = config_dict(
        "postgresql://relay@db.internal/app",  # never reached: the config is refused first
        "nats://nats.internal:4222",
        "s",
        messages={"BookLent": [V1, {**V2, "schema": "schemas/missing.json"}]},
    )
    path = save(tmp_path, data)
    result = run_cli(["run", "--config", str(path)])
    assert result.returncode == 2
    line = next(
        i for i, text in enumerate(path.read_text().splitlines(), 1) if "missing.json" in text
    )
    assert f"{path}:{line}: outboxes.loans.messages.BookLent.1.schema: cannot read schema file" in (
        result.stderr
    )


async def test_relay_check_lists_each_violation_of_the_last_events(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Nothing published: what the last events would become, rule by rule, and why not."""
    strict = {
        **SCHEMA,
        "properties": {"member": {"required": ["id", "since"]}, "bookId": {"type": "integer"}},
    }
    when = {
        **V1,
        "type": "library.book-lent-priority.v1",
        "destination": "{subject}.priority",
        "id": "{aggregate_id}/p",
        "when": "data.urgent",
    }
    rules = [V1, {**V2, "schema": strict}, when]
    path = save(tmp_path, config_dict(events_table, nats_url, "s", messages={"BookLent": rules}))
    async with connect(events_table) as conn:
        await append_many(conn, [NewEvent("book", "b1", 1, "BookLent", {"memberId": "m1"})])
    result = run_cli(["check", "--last", "5", "--offline", "--config", str(path), "--json"])
    assert result.returncode == 0, result.stderr
    v1, v2, priority = json.loads(result.stdout)
    assert (v1["rule"], v1["id"]) == (V1["type"], "book/b1@1/library.book-lent.v1")
    assert v2["parked"] == "schema"
    assert v2["violations"] == [
        "$.bookId: 'b1' is not of type 'integer'",
        "$.member: 'since' is a required property",
    ]
    assert priority["skipped"] == "its condition is false: when: data.urgent"
    text = run_cli(["check", "--last", "5", "--offline", "--config", str(path)])
    assert "would be parked (schema), 2 violation(s):" in text.stdout
    assert "    $.member: 'since' is a required property" in text.stdout
