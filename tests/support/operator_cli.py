"""An operator at the command line: the relay's one-shot commands run as subprocesses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.db import NewEvent, append_many, connect
from tests.support.jetstream import create_stream, unique_name
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import eventually, migrate_cli, write_config


def cli(config: Path, *args: str) -> Any:
    """Run `relay ARGS --config F --json`; return the parsed output (exit code 0 required)."""
    result = run_cli([*args, "--config", str(config), "--json"])
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stderr}"
    return json.loads(result.stdout)


async def setup_outbox(
    events_table: str, nats_url: str, tmp_path: Path, **options: Any
) -> tuple[Path, str]:
    """A stream of its own, a config relaying to it (outbox options given), migrated."""
    stream = unique_name("ops")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    config = write_config(tmp_path, events_table, nats_url, stream, **options)
    migrate_cli(config)
    return config, stream


def holds(process: RelayProcess) -> bool:
    return any(r.get("event") == "lease acquired: relaying" for r in process.logs())


async def relayed_up_to(config: Path, position: int) -> None:
    """Until the (single-lane) outbox's checkpoint is `position`."""

    async def caught_up() -> bool:
        return bool(cli(config, "status")[0]["checkpoint"] == position)

    await eventually(caught_up, timeout=30)


async def relay_then_stop(relay_process: Any, config: Path, position: int) -> None:
    """Run one replica until it has relayed up to `position`, then stop it gracefully."""
    relay = relay_process(["run", "--config", str(config)])
    await relayed_up_to(config, position)
    relay.terminate()
    assert await relay.wait_async(15) == 0


async def park_huge_loans(
    events_table: str, relay_process: Any, config: Path, count: int
) -> list[int]:
    """`count` loans too large for NATS (b0@1, b1@1, ...), parked by a replica then stopped."""
    huge = "x" * (2 * 1024 * 1024)  # above NATS's default 1 MB max_payload
    loans = [NewEvent("book", f"b{i}", 1, "BookLent", {"loanId": huge}) for i in range(count)]
    async with connect(events_table) as conn:
        positions = await append_many(conn, loans)
    await relay_then_stop(relay_process, config, positions[-1])
    return positions
