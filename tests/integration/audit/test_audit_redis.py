"""`relay audit` against a real Redis: entries lost behind the relay's back, found and repaired.

Each test relays loans to a stream of its own with a real `relay run`, then loses entries the
way they get lost on Redis (XDEL by a consumer or an operator, MAXLEN trimming), and runs
`relay audit` as an operator would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.audit.kit import audit
from tests.support.db import append_many, connect
from tests.support.operator_cli import relay_then_stop
from tests.support.redis_server import delete_stream, read_stream, redis_client, unique_stream
from tests.support.scenario import loans, migrate_cli, save


def outbox_on_stream(
    tmp_path: Path, events_table: str, redis_url: str, stream: str, **broker: Any
) -> Path:
    """A config relaying BookLent events to `stream`, with broker options (`dedup_window`,
    `maxlen`), migrated."""
    data = {
        "database": {"url": events_table, "retry": {"initial": "20ms", "max": "200ms"}},
        "source": {"poll_interval": "100ms"},
        "brokers": {
            "redis": {
                "type": "redis",
                "url": redis_url,
                "ack_timeout": "2s",
                "connect_timeout": "1s",
                **broker,
            }
        },
        "outboxes": {
            "loans": {
                "broker": "redis",
                "messages": {"BookLent": {"type": "library.book-lent.v1", "destination": stream}},
                "retry": {"initial": "20ms", "max": "200ms"},
                "park_after": 3,
            }
        },
        "http": {"enabled": False},
        "logging": {"level": "info", "format": "json"},
    }
    config = save(tmp_path, data)
    migrate_cli(config)
    return config


def ce_ids(entries: list[tuple[str, dict[str, bytes]]]) -> list[str]:
    return [fields["ce_id"].decode() for _, fields in entries]


def missing(report: dict[str, Any]) -> set[tuple[int, str, str]]:
    return {(m["position"], m["id"], m["destination"]) for m in report["missing"]}


async def test_entries_deleted_from_the_stream_are_found_missing_and_repaired(
    events_table: str, redis_url: str, tmp_path: Path, relay_process: Any
) -> None:
    stream = unique_stream("audit")
    # A short window: the relay's id set forgets a lost entry's id soon, so that a repair
    # can store it again.
    config = outbox_on_stream(tmp_path, events_table, redis_url, stream, dedup_window="1s")
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(30))
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await read_stream(redis_url, stream)
        assert len(stored) == 30
        gone = (3, 17, 29)
        async with redis_client(redis_url) as client:
            assert await client.xdel(stream, *(stored[i][0] for i in gone)) == 3
        lost = {(positions[i], ce_ids(stored)[i], stream) for i in gone}

        code, report = audit(config, "--from-start")
        assert code == 1
        assert missing(report) == lost
        assert all(m["reason"] == "not found" for m in report["missing"])
        assert report["expected"] == 30 and report["found"] == 27
        assert report["duplicates"] == 0 and report["unexplained"] == 0

        code, report = audit(config, "--from-start", "--repair", "--timeout", "20")
        assert code == 0, report
        assert missing(report) == lost
        assert report["repair"]["ok"] and len(report["repair"]["published"]) == 3
        after = report["after_repair"]
        assert after["missing_count"] == 0 and after["found"] == 30 and after["duplicates"] == 0
        now = ce_ids(await read_stream(redis_url, stream))
        assert sorted(now) == sorted(ce_ids(stored))  # each once: nothing else was sent
    finally:
        await delete_stream(redis_url, stream)


async def test_a_repair_the_id_set_drops_is_reported_not_landed(
    events_table: str, redis_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """The relay's id set remembers a deleted entry's id for `dedup_window` (2 minutes by
    default): a re-send is acknowledged as a duplicate and not stored. The audit must not call
    that repaired, and says how long to wait."""
    stream = unique_stream("audit")
    config = outbox_on_stream(tmp_path, events_table, redis_url, stream)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
        await relay_then_stop(relay_process, config, positions[-1])
        stored = await read_stream(redis_url, stream)
        async with redis_client(redis_url) as client:
            assert await client.xdel(stream, stored[4][0]) == 1

        code, report = audit(config, "--from-start", "--repair", "--timeout", "2")
        assert code == 1
        assert report["repair"]["duplicate_window"] == 120
        assert "duplicate window" in report["repair"]["note"]
        assert [m["id"] for m in report["after_repair"]["missing"]] == [ce_ids(stored)[4]]
        assert len(await read_stream(redis_url, stream)) == 9  # the re-send was dropped
    finally:
        await delete_stream(redis_url, stream)


async def test_entries_maxlen_trimmed_are_named_as_discarded_by_it(
    events_table: str, redis_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """`maxlen: 50` trims with XADD MAXLEN ~ 50: Redis drops whole nodes of the stream, so
    more than 50 stay; every entry it dropped is missing, and the reason names the limit."""
    stream = unique_stream("audit")
    config = outbox_on_stream(tmp_path, events_table, redis_url, stream, maxlen=50)
    try:
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(250))
        await relay_then_stop(relay_process, config, positions[-1])
        held = set(ce_ids(await read_stream(redis_url, stream)))
        assert 50 <= len(held) < 250

        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["found"] == len(held)
        assert {m["id"] for m in report["missing"]} == {f"book/b{i}@1" for i in range(250)} - held
        assert max(m["position"] for m in report["missing"]) < min(
            p for i, p in enumerate(positions) if f"book/b{i}@1" in held
        )
        assert all(
            m["reason"].startswith("discarded: before the oldest message held, by maxlen ~50")
            for m in report["missing"]
        )
    finally:
        await delete_stream(redis_url, stream)
