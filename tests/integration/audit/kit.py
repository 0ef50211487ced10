"""What the audit's tests share, whatever the broker: the command as an operator runs it, an
outbox on a broker of the test's, and the loss every broker allows (a checkpoint moved
forward by hand past events the relay never published)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.db import append_many, connect
from tests.support.relay_process import run_cli
from tests.support.scenario import LIBRARY_MESSAGES, config_dict, loans, migrate_cli, save


def audit(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """`relay audit loans ARGS --json`: its exit code (0 or 1) and its report."""
    result = run_cli(["audit", "loans", *args, "--config", str(config), "--json"])
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def outbox_to(
    events_table: str, tmp_path: Path, destination: str, name: str, broker: dict[str, Any]
) -> Path:
    """A config relaying every loan to `destination` through `broker` (named `name`),
    migrated."""
    messages = {
        kind: {**rule, "destination": destination} for kind, rule in LIBRARY_MESSAGES.items()
    }
    data = config_dict(events_table, "nats://127.0.0.1:1", destination, messages=messages)
    data["brokers"] = {name: broker}
    data["outboxes"]["loans"]["broker"] = name
    config = save(tmp_path, data)
    migrate_cli(config)
    return config


async def skipped_by_hand(events_table: str, count: int) -> list[int]:
    """`count` dvd loans appended, and the checkpoint moved past them: never published."""
    async with connect(events_table) as conn:
        skipped = await append_many(conn, loans(count, "dvd"))
        await conn.execute(
            "UPDATE relay.checkpoints SET position = $1 WHERE outbox = 'loans'", skipped[-1]
        )
    return skipped


def found_missing_then_repaired(config: Path, skipped: list[int], relayed: int) -> None:
    """The audit reports exactly the `skipped` events' messages missing (`relayed` found),
    then `--repair` puts them back and a second audit finds every one, once."""
    code, report = audit(config, "--from-start")
    assert code == 1
    assert report["expected"] == relayed + len(skipped) and report["found"] == relayed
    assert sorted(m["position"] for m in report["missing"]) == skipped
    assert {m["id"] for m in report["missing"]} == {f"dvd/d{i}@1" for i in range(len(skipped))}
    assert all(m["reason"] == "not found" for m in report["missing"])
    assert report["duplicates"] == 0 and report["order_breaks"] == 0

    code, report = audit(config, "--from-start", "--repair", "--timeout", "20")
    assert code == 0, report
    assert report["repair"]["ok"] and len(report["repair"]["published"]) == len(skipped)
    after = report["after_repair"]
    assert after["missing_count"] == 0 and after["duplicates"] == 0
    assert after["found"] == relayed + len(skipped)
