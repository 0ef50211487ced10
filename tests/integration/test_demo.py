"""`relay demo` end to end: embedded services, the story, and a clean machine afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest


def run_demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def status_table(out: str) -> dict[str, str]:
    """The demo's last step: the table `relay status` prints, header and the outbox's row."""
    table = re.search(
        r"^\$ relay status --config \S+\n  (NAME .*)\n  (loans-outbox .*)$", out, re.M
    )
    assert table is not None, out
    header, row = table.group(1).split(), table.group(2).split()
    assert len(header) == len(row), table.group(0)
    return dict(zip(header, row, strict=True))


@pytest.mark.integration  # it starts an embedded Postgres and NATS itself
def test_demo_on_embedded_services_tells_the_whole_story() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL")}
    result = run_demo(env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "Postgres: embedded; NATS JetStream: embedded" in out
    assert "replica-a holds the lease; replica-b stands by." in out
    assert "3 loans -> 3 messages" in out
    assert "replica-a exited 0; replica-b took the lease" in out
    assert "3 commands succeeded while the broker was down" in out
    assert "state=retrying" in out
    ids = re.findall(r"^  #\d+\s+(book/\S+)", out, flags=re.M)
    assert len(ids) == 8 and len(set(ids)) == 8, out
    status = status_table(out)
    assert status["STATE"] == "relaying" and status["HOLDER"].startswith("relay:replica-b:"), out
    assert (status["LAG_EVENTS"], status["PARKED"], status["LAST_ERROR"]) == ("0", "0", "-")
    workdir = re.search(r"work dir (\S+)", out)
    assert workdir is not None and not Path(workdir.group(1)).exists()


async def test_demo_against_a_given_database_leaves_nothing_behind(database: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env["DATABASE_URL"] = database
    result = run_demo(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Postgres: given" in result.stdout
    conn = await asyncpg.connect(database)
    try:
        tables = await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'library_events_%'"
        )
        schemas = await conn.fetchval(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'relay_demo_%'"
        )
    finally:
        await conn.close()
    assert (tables, schemas) == (0, 0)
