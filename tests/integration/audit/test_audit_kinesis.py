"""`relay audit` against Kinesis (a moto server): a loss the relay cannot see, found and put
back.

Kinesis deletes no record on request (only its retention removes them), so the loss is made
the one way an operator can: the outbox's checkpoint moved forward by hand past events the
relay never published. A real `relay run` relays the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.contract.brokers.kinesis import KinesisHarness, consumed
from tests.integration.audit.kit import found_missing_then_repaired, outbox_to, skipped_by_hand
from tests.support.db import append_many, connect
from tests.support.operator_cli import relay_then_stop
from tests.support.scenario import loans
from tests.support.sqs_server import REGION


async def test_events_a_moved_checkpoint_skipped_are_found_missing_and_repaired(
    events_table: str, sqs_endpoint: str, tmp_path: Path, relay_process: Any
) -> None:
    kinesis = KinesisHarness(sqs_endpoint, shards=2)
    await kinesis.prepare()
    try:
        broker = {"type": "kinesis", "region": REGION, "endpoint_url": sqs_endpoint}
        config = outbox_to(events_table, tmp_path, kinesis.stream, "kinesis", broker)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])
        skipped = await skipped_by_hand(events_table, 2)

        found_missing_then_repaired(config, skipped, relayed=12)
        stored = [consumed(r).id for r in await kinesis.records(expected=14)]
        assert sorted(stored) == sorted({*stored}) and len(stored) == 14  # each once
    finally:
        await kinesis.close()
