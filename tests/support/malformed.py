"""Running the relay over rows it must park as malformed, and reading what it parked."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from relay.config import RelayConfig
from relay.postgres.store import Store
from tests.support.db import connect
from tests.support.jetstream import Received, fetch_all
from tests.support.scenario import eventually, running, status


async def relay_until_parked(
    config: RelayConfig, nats_url: str, stream: str, published: int, parked: int
) -> tuple[list[Received], int]:
    """Run the relay until `published` messages are in the stream and `parked` rows parked;
    the messages and the lane's checkpoint then."""
    async with running(config):
        received = await fetch_all(nats_url, stream, expected=published)

        async def all_parked() -> bool:
            return bool((await status(config))[0]["parked"] == parked)

        await eventually(all_parked)
        checkpoint = int((await status(config))[0]["checkpoint"])
    return received, checkpoint


async def assert_parked_as_malformed(dsn: str, faults: dict[Any, str]) -> None:
    """Exactly the aggregates of `faults` are parked, each as malformed, its error holding
    the fault's words, and no message built (nothing was sent)."""
    async with connect(dsn) as conn:
        parked = [asdict(p) for p in await Store("relay").parked(conn, "loans")]
    by_id = {p["aggregate_id"]: p for p in parked}
    assert set(by_id) == set(faults)
    for aggregate_id, fault in faults.items():
        assert by_id[aggregate_id]["reason"] == "malformed"
        assert fault in by_id[aggregate_id]["error"], by_id[aggregate_id]["error"]
        assert by_id[aggregate_id]["message_id"] is None
