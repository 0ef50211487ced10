"""`relay audit` against Pub/Sub (the emulator): a loss the relay cannot see, found and put
back, through the audit's own subscription.

Pub/Sub deletes no message on request, so the loss is made the one way an operator can:
the outbox's checkpoint moved forward by hand past events the relay never published. A real
`relay run` relays the rest. The emulator has no Seek to a time: the reader keeps the
audit's subscription as it was with a snapshot instead (relay/brokers/pubsub_readback.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.support.db import append_many, connect
from tests.support.operator_cli import relay_then_stop
from tests.support.pubsub_server import (
    AUDIT_SUBSCRIPTION,
    PROJECT,
    create_audit_subscription,
    create_topic,
    delete_subscription,
    delete_topic,
    unique_name,
)
from tests.support.relay_process import run_cli
from tests.support.scenario import LIBRARY_MESSAGES, config_dict, loans, migrate_cli, save


def pubsub_outbox(
    events_table: str, emulator: str, topic: str, tmp_path: Path, **broker: Any
) -> Path:
    """A config relaying every loan to `topic`, the audit reading `<topic>-audit`, migrated."""
    messages = {kind: {**rule, "destination": topic} for kind, rule in LIBRARY_MESSAGES.items()}
    data = config_dict(events_table, "nats://127.0.0.1:1", topic, messages=messages)
    data["brokers"] = {
        "pubsub": {
            "type": "pubsub",
            "project": PROJECT,
            "emulator_host": emulator,
            "audit_subscription": AUDIT_SUBSCRIPTION,
            **broker,
        }
    }
    data["outboxes"]["loans"]["broker"] = "pubsub"
    config = save(tmp_path, data)
    migrate_cli(config)
    return config


def audit(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`relay audit loans ARGS --json`: its exit code and its report."""
    result = run_cli(["audit", "loans", *args, "--config", str(config), "--json"])
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


async def test_events_a_moved_checkpoint_skipped_are_found_missing_and_repaired(
    events_table: str, pubsub_emulator: str, tmp_path: Path, relay_process: Any
) -> None:
    topic, consumers = unique_name("audit"), unique_name("consumers")
    audit_name = AUDIT_SUBSCRIPTION.format(topic=topic)
    await asyncio.to_thread(create_topic, pubsub_emulator, topic, consumers)
    await asyncio.to_thread(create_audit_subscription, pubsub_emulator, topic, audit_name)
    try:
        config = pubsub_outbox(events_table, pubsub_emulator, topic, tmp_path)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])
        async with connect(events_table) as conn:  # never relayed: the checkpoint jumps them
            skipped = await append_many(conn, loans(2, "dvd"))
            await conn.execute(
                "UPDATE relay.checkpoints SET position = $1 WHERE outbox = 'loans'", skipped[-1]
            )

        code, report = audit(config, "--from-start")
        assert code == 1
        assert report["expected"] == 14 and report["found"] == 12
        assert sorted(m["position"] for m in report["missing"]) == skipped
        assert {m["id"] for m in report["missing"]} == {"dvd/d0@1", "dvd/d1@1"}
        assert all(m["reason"] == "not found" for m in report["missing"])
        assert report["duplicates"] == 0 and report["order_breaks"] == 0

        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert report["repair"]["ok"] and len(report["repair"]["published"]) == 2
        after = report["after_repair"]
        assert after["missing_count"] == 0 and after["found"] == 14 and after["duplicates"] == 0
    finally:
        await asyncio.to_thread(delete_subscription, pubsub_emulator, audit_name)
        await asyncio.to_thread(delete_topic, pubsub_emulator, topic, consumers)


def test_without_an_audit_subscription_the_audit_says_what_to_configure(
    tmp_path: Path,
) -> None:
    """Refused before anything is reached: nothing listens at these addresses."""
    data = config_dict("postgresql://relay@127.0.0.1:1/relay", "nats://127.0.0.1:1", "loans")
    data["brokers"] = {
        "pubsub": {"type": "pubsub", "project": PROJECT, "emulator_host": "127.0.0.1:1"}
    }
    data["outboxes"]["loans"]["broker"] = "pubsub"
    config = save(tmp_path, data)
    result = run_cli(["audit", "loans", "--from-start", "--config", str(config), "--json"])
    assert result.returncode == 2, result.stderr
    assert "broker 'pubsub' (pubsub) cannot be read back" in result.stderr
    assert "brokers.pubsub.audit_subscription" in result.stderr
