"""`relay audit` against Pub/Sub (the emulator): a loss the relay cannot see, found and put
back, through the audit's own subscription.

Pub/Sub deletes no message on request, so the loss is made the one way an operator can:
the outbox's checkpoint moved forward by hand past events the relay never published. A real
`relay run` relays the rest. The emulator has no Seek to a time: the reader keeps the
audit's subscription as it was with a snapshot instead (relay/brokers/pubsub_readback.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.integration.audit.kit import found_missing_then_repaired, outbox_to, skipped_by_hand
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
from tests.support.scenario import loans


async def test_events_a_moved_checkpoint_skipped_are_found_missing_and_repaired(
    events_table: str, pubsub_emulator: str, tmp_path: Path, relay_process: Any
) -> None:
    topic, consumers = unique_name("audit"), unique_name("consumers")
    audit_name = AUDIT_SUBSCRIPTION.format(topic=topic)
    await asyncio.to_thread(create_topic, pubsub_emulator, topic, consumers)
    await asyncio.to_thread(create_audit_subscription, pubsub_emulator, topic, audit_name)
    try:
        broker = {
            "type": "pubsub",
            "project": PROJECT,
            "emulator_host": pubsub_emulator,
            "audit_subscription": AUDIT_SUBSCRIPTION,
        }
        config = outbox_to(events_table, tmp_path, topic, "pubsub", broker)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(12))
        await relay_then_stop(relay_process, config, positions[-1])
        skipped = await skipped_by_hand(events_table, 2)

        found_missing_then_repaired(config, skipped, relayed=12)
    finally:
        await asyncio.to_thread(delete_subscription, pubsub_emulator, audit_name)
        await asyncio.to_thread(delete_topic, pubsub_emulator, topic, consumers)
