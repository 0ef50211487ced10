"""`relay audit` against a Kafka-protocol broker (tansu): records lost behind the relay's back,
found and repaired, and a replay told from a loss.

Kafka loses records by retention, `kafka-delete-records`, compaction, or a broker that loses
its log (an unreplicated disk, unclean leader election). tansu implements none of the first
three (DeleteRecords makes its memory storage panic, "not yet implemented", and close the
connection), so the loss here is the last one: the broker restarts with its memory storage
empty, the topic is made again, and the relay goes on. Every record stored before the
restart is gone, offsets start again at 0, and nothing tells the relay.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.audit.kit import audit
from tests.support.db import append_many, connect
from tests.support.kafka_server import (
    TansuServer,
    consume,
    create_topic,
    headers,
    relay_config,
    unique_topic,
)
from tests.support.operator_cli import cli, relay_then_stop
from tests.support.scenario import loans, migrate_cli, save


async def outbox_on_topic(
    tmp_path: Path, events_table: str, server: TansuServer
) -> tuple[Path, str]:
    """A topic of its own (three partitions) and a config relaying loans to it, migrated."""
    topic = unique_topic("audit")
    await create_topic(server.bootstrap, topic, partitions=3)
    config = save(tmp_path, relay_config(events_table, server.bootstrap, topic))
    migrate_cli(config)
    return config, topic


async def ce_ids(server: TansuServer, topic: str, expected: int) -> list[str]:
    return [headers(r)["ce_id"] for r in await consume(server.bootstrap, topic, expected)]


def missing(report: dict[str, Any]) -> set[tuple[int, str, str]]:
    return {(m["position"], m["id"], m["destination"]) for m in report["missing"]}


async def test_records_the_broker_lost_are_found_missing_and_repaired(
    events_table: str,
    tmp_path: Path,
    relay_process: Any,
    tansu_factory: Callable[..., TansuServer],
) -> None:
    server = tansu_factory()
    config, topic = await outbox_on_topic(tmp_path, events_table, server)
    async with connect(events_table) as conn:
        before = await append_many(conn, loans(20))
    await relay_then_stop(relay_process, config, before[-1])
    lost_ids = await ce_ids(server, topic, expected=20)
    assert len(lost_ids) == 20

    server.restart()  # memory storage: every record is gone
    await create_topic(server.bootstrap, topic, partitions=3)
    async with connect(events_table) as conn:
        after = await append_many(conn, loans(10, "dvd"))
    await relay_then_stop(relay_process, config, after[-1])
    assert len(await ce_ids(server, topic, expected=10)) == 10

    code, report = audit(config, "--from-start")
    assert code == 1
    assert missing(report) == {(p, f"book/b{i}@1", topic) for i, p in enumerate(before)}
    assert set(lost_ids) == {m["id"] for m in report["missing"]}
    # "not found", with "before the oldest message held" when the partitions' first records
    # tell which went out first; never expired: tansu tells no retention.
    assert all(m["reason"].startswith("not found") for m in report["missing"])
    assert report["expired_count"] == 0
    assert report["expected"] == 30 and report["found"] == 10
    assert report["duplicates"] == 0 and report["unexplained"] == 0

    code, report = audit(config, "--from-start", "--repair", "--timeout", "20")
    assert code == 0, report
    assert len(report["missing"]) == 20
    assert report["repair"]["ok"] and len(report["repair"]["published"]) == 20
    assert "duplicate_window" not in report["repair"]  # Kafka drops no re-sent id
    after_repair = report["after_repair"]
    assert after_repair["missing_count"] == 0 and after_repair["found"] == 30
    assert after_repair["duplicates"] == 0
    held = await ce_ids(server, topic, expected=30)
    assert sorted(held) == sorted([*lost_ids, *(f"dvd/d{i}@1" for i in range(10))])


async def test_a_replay_shows_as_records_stored_twice_never_missing(
    events_table: str,
    tmp_path: Path,
    relay_process: Any,
    tansu_factory: Callable[..., TansuServer],
) -> None:
    server = tansu_factory()
    config, topic = await outbox_on_topic(tmp_path, events_table, server)
    async with connect(events_table) as conn:
        positions = await append_many(conn, loans(12))
    await relay_then_stop(relay_process, config, positions[-1])
    assert cli(config, "replay", "loans", "--from", str(positions[4]))["ok"]
    await relay_then_stop(relay_process, config, positions[-1])
    assert len(await ce_ids(server, topic, expected=20)) == 20

    code, report = audit(config, "--from-start")
    assert code == 0, report
    assert report["duplicates"] == 8 and report["missing_count"] == 0
    assert report["found"] == 12 and report["unexplained"] == 0
