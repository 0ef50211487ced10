"""`relay audit` against Kinesis (a moto server): a loss the relay cannot see, found and put
back.

Kinesis deletes no record on request (only its retention removes them), so the loss is made
the one way an operator can: the outbox's checkpoint moved forward by hand past events the
relay never published. A real `relay run` relays the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.contract.brokers.kinesis import KinesisHarness, consumed
from tests.support.db import append_many, connect
from tests.support.operator_cli import relay_then_stop
from tests.support.relay_process import run_cli
from tests.support.scenario import LIBRARY_MESSAGES, config_dict, loans, migrate_cli, save
from tests.support.sqs_server import REGION


def kinesis_outbox(events_table: str, endpoint: str, stream: str, tmp_path: Path) -> Path:
    """A config relaying every loan to `stream` on Kinesis, migrated."""
    messages = {kind: {**rule, "destination": stream} for kind, rule in LIBRARY_MESSAGES.items()}
    data = config_dict(events_table, "nats://127.0.0.1:1", stream, messages=messages)
    data["brokers"] = {"kinesis": {"type": "kinesis", "region": REGION, "endpoint_url": endpoint}}
    data["outboxes"]["loans"]["broker"] = "kinesis"
    config = save(tmp_path, data)
    migrate_cli(config)
    return config


def audit(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`relay audit loans ARGS --json`: its exit code and its report."""
    result = run_cli(["audit", "loans", *args, "--config", str(config), "--json"])
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


async def test_events_a_moved_checkpoint_skipped_are_found_missing_and_repaired(
    events_table: str, sqs_endpoint: str, tmp_path: Path, relay_process: Any
) -> None:
    kinesis = KinesisHarness(sqs_endpoint, shards=2)
    await kinesis.prepare()
    try:
        config = kinesis_outbox(events_table, sqs_endpoint, kinesis.stream, tmp_path)
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
        assert report["duplicates"] == 0 and report["unexplained"] == 0

        code, report = audit(config, "--from-start", "--repair")
        assert code == 0, report
        assert report["repair"]["ok"] and len(report["repair"]["published"]) == 2
        after = report["after_repair"]
        assert after["missing_count"] == 0 and after["found"] == 14 and after["duplicates"] == 0
        stored = [consumed(r).id for r in await kinesis.records(expected=14)]
        assert sorted(stored) == sorted({*stored}) and len(stored) == 14  # each once
    finally:
        await kinesis.close()
