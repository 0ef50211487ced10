"""A payload or metadata nested deeply is parked, naming its column and depth; the relay goes on.

One valid jsonb payload nested 1,500 levels deep used to end `relay run` with a RecursionError
while decoding: nothing was parked, the next holder died the same way, and the outbox was
blocked for ever; `relay check` died too. orjson reads 1,024 levels, and so does the relay:
as deep as that is published (the body written exactly), deeper is malformed.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from relay.postgres.store import Store
from tests.support.db import connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import (
    config_dict,
    eventually,
    load_and_migrate,
    migrate_cli,
    running,
    save,
    status,
)

TABLES = {
    # jsonb refuses about 13,000 levels (PostgreSQL's max_stack_depth, 2 MB by default).
    "jsonb": """
        CREATE TABLE events (
          position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
          aggregate_type text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL,
          type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
          created_at timestamptz NOT NULL DEFAULT now()
        )""",
    # A text column holds any depth.
    "text": """
        CREATE TABLE events (
          position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
          aggregate_type text NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL,
          type text NOT NULL, payload text NOT NULL, metadata text NOT NULL DEFAULT '{}',
          created_at timestamptz NOT NULL DEFAULT now()
        )""",
}
DEPTHS = {"jsonb": [900, 1000, 1024, 1025, 1500, 10_000], "text": [1024, 1025, 1500, 100_000]}
METADATA = '{"tenant":"north"}'


def nested(depth: int, kind: str, leaf: str = "1") -> str:
    """`depth` levels of objects or arrays around `leaf`, written compactly."""
    if kind == "object":
        return '{"a":' * depth + leaf + "}" * depth
    return "[" * depth + leaf + "]" * depth


def rows(table: str) -> list[tuple[str, str, str]]:
    """(aggregate id, payload, metadata): good ones around deep payloads, then deep metadata
    (the tenant at the top, the rest of its depth below it)."""
    out = [("good-1", '{"loanId":"L1"}', METADATA)]
    for depth in DEPTHS[table]:
        for kind in ("object", "array"):
            out.append((f"payload-{kind}-{depth}", nested(depth, kind), METADATA))
    for depth in DEPTHS[table][-4:]:
        inner = nested(depth - 1, "array")
        out.append((f"metadata-{depth}", '{"loanId":"L2"}', f'{{"tenant":"north","deep":{inner}}}'))
    out.append(("good-2", '{"loanId":"L3"}', METADATA))
    return out


async def _fill(dsn: str, table: str) -> list[tuple[str, str, str]]:
    written = rows(table)
    async with connect(dsn) as conn:
        await conn.execute(TABLES[table])
        for aggregate_id, payload, metadata in written:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
                f" metadata) VALUES ('book', $1, 1, 'Deep', $2::{table}, $3::{table})",
                aggregate_id,
                payload,
                metadata,
            )
    return written


def _config(dsn: str, nats_url: str, subject: str) -> dict[str, Any]:
    """The whole payload as the body (so that it is written out again, however deep) and
    a key from the metadata (so that the metadata is read)."""
    rule = {
        "type": "library.deep.v1",
        "destination": "{subject}.{aggregate_type}",
        "payload": "data",
        "key": "{metadata.tenant}",
    }
    return config_dict(dsn, nats_url, subject, messages={"Deep": rule}, park_after=1)


def _too_deep(aggregate_id: str) -> int | None:
    """The depth of a row the relay parks, else None."""
    column, depth = _column_and_depth(aggregate_id)
    return depth if column and depth > 1024 else None


def _column_and_depth(aggregate_id: str) -> tuple[str | None, int]:
    if aggregate_id.startswith("good"):
        return None, 1
    column, *_, depth = aggregate_id.split("-")
    return column, int(depth)


@pytest.mark.parametrize("table", list(TABLES))
async def test_deep_rows_are_parked_with_column_and_depth_and_the_rest_flows(
    database: str, nats_url: str, tmp_path: Path, table: str
) -> None:
    subject = unique_name("deep")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    written = await _fill(database, table)
    parked_ids = {a for a, _, _ in written if _too_deep(a)}
    published = [(a, p) for a, p, _ in written if a not in parked_ids]
    config = await load_and_migrate(tmp_path, _config(database, nats_url, subject))
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=len(published), timeout=30)

            async def all_settled() -> bool:
                row = (await status(config))[0]
                return bool(row["checkpoint"] == len(written) and row["parked"] == len(parked_ids))

            await eventually(all_settled, timeout=30)
        # In order, each body exactly the payload (as compact JSON), however deep.
        assert [m.headers["ce-id"] for m in received] == [f"book/{a}@1" for a, _ in published]
        assert [m.data for m in received] == [p.encode() for _, p in published]
        async with connect(database) as conn:
            parked = [asdict(p) for p in await Store("relay").parked(conn, "loans")]
        by_id = {p["aggregate_id"]: p for p in parked}
        assert set(by_id) == parked_ids
        for aggregate_id, row in by_id.items():
            column, depth = _column_and_depth(aggregate_id)
            assert row["reason"] == "malformed"
            assert (
                f"column {column!r} is JSON nested {depth} levels deep,"
                " deeper than the 1024 the relay reads" in row["error"]
            ), row["error"]
            assert row["message_id"] is None

        # `relay check` shows them as they were handled, and does not crash.
        path = tmp_path / "relay.yaml"
        result = run_cli(["check", "--config", str(path), "--last", str(len(written))])
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        for aggregate_id in parked_ids:
            column, depth = _column_and_depth(aggregate_id)
            expected = (
                f" book/{aggregate_id}@1 Deep [loans]: would be parked (malformed):"
                f" column {column!r} is JSON nested {depth} levels deep"
            )
            assert expected in result.stdout, result.stdout
        result = run_cli(["check", "--config", str(path), "--last", str(len(written)), "--json"])
        assert result.returncode == 0, result.stderr
        previews = json.loads(result.stdout)
        assert sum(1 for r in previews if r.get("parked") == "malformed") == len(parked_ids)
        assert [r["body"] for r in previews if "body" in r] == [p for _, p in published]
    finally:
        await delete_stream(nats_url, subject)


async def test_relay_run_parks_a_payload_1500_levels_deep_and_goes_on(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Any
) -> None:
    """The issue as reported: the example table, the default rules, one hostile event."""
    async with connect(events_table) as conn:
        for aggregate_id, payload in [
            ("b1", '{"loanId": "L1"}'),
            ("hostile", nested(1500, "object")),
            ("b2", '{"loanId": "L2"}'),
        ]:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
                " VALUES ('book', $1, 1, 'BookLent', $2::jsonb)",
                aggregate_id,
                payload,
            )
    path = save(tmp_path, config_dict(events_table, nats_url, stream, park_after=1))
    migrate_cli(path)
    relay: RelayProcess = relay_process(["run", "--config", str(path)])
    parked = await relay.wait_for_log("message parked")
    assert "column 'payload' is JSON nested 1500 levels deep" in parked["error"], parked
    received = await fetch_all(nats_url, stream, expected=2)
    assert [m.headers["ce-id"] for m in received] == ["book/b1@1", "book/b2@1"]
    assert relay.returncode is None, relay.output()
    relay.terminate()
    assert await relay.wait_async(15) == 0, relay.output()
    assert "RecursionError" not in relay.output()
