"""Malformed rows are parked, named by their column; nothing malformed is published.

A NULL payload, a NULL aggregate id, `NaN` or an overflowing number in a text
payload, or text that is not JSON at all: each used to crash the relay in a
loop, fail while being parked, or go out as invalid JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relay.config import RelayConfig
from tests.support.db import connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.malformed import assert_parked_as_malformed, relay_until_parked
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, save, status

# A lax table, as some applications have: text payloads and nullable columns.
LAX_TABLE = """
CREATE TABLE events (
  position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  aggregate_type text, aggregate_id text, version bigint, type text NOT NULL,
  payload text, metadata text, created_at timestamptz NOT NULL DEFAULT now()
)
"""
GOOD = '{"loanId": "L", "memberId": "m"}'
ROWS: list[tuple[str | None, str | None, int | None, str | None, str | None]] = [
    # aggregate_type, aggregate_id, version, payload, metadata
    ("book", "good-1", 1, GOOD, "{}"),
    ("book", "null-payload", 1, None, "{}"),
    ("book", None, 1, GOOD, "{}"),
    ("book", "nan", 1, '{"loanId": NaN}', "{}"),
    ("book", "infinite", 1, '{"loanId": 1e999}', "{}"),
    ("book", "not-json", 1, "loan L, member m", "{}"),
    ("book", "bad-metadata", 1, GOOD, "{'trace': 1}"),
    ("book", "null-version", None, GOOD, "{}"),
    ("book", "good-2", 1, GOOD, None),
]
# What each malformed row is parked for: the column at fault, in the error.
FAULTS = {
    "null-payload": "column 'payload' is NULL",
    None: "column 'aggregate_id' is NULL",
    "nan": "column 'payload' is not valid JSON",
    "infinite": "column 'payload' is not valid JSON",
    "not-json": "column 'payload' is not valid JSON",
    "bad-metadata": "column 'metadata' is not valid JSON",
    "null-version": "column 'version' is NULL",
}


async def _fill(dsn: str) -> None:
    async with connect(dsn) as conn:
        await conn.execute(LAX_TABLE)
        for aggregate_type, aggregate_id, version, payload, metadata in ROWS:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
                " metadata) VALUES ($1, $2, $3, 'BookLent', $4, $5)",
                aggregate_type,
                aggregate_id,
                version,
                payload,
                metadata,
            )


async def test_malformed_rows_are_parked_by_column_and_the_rest_flows(
    database: str, nats_url: str, stream: str, tmp_path: Path
) -> None:
    subject = stream
    await _fill(database)
    config = await load_and_migrate(tmp_path, _reading_metadata(database, nats_url, subject))
    received, checkpoint = await relay_until_parked(config, nats_url, subject, 2, len(FAULTS))
    assert checkpoint == len(ROWS)
    assert [m.headers["ce-id"] for m in received] == ["book/good-1@1", "book/good-2@1"]
    for message in received:  # strictly valid JSON, nothing like NaN went out
        json.loads(message.data, parse_constant=_refuse)
    await assert_parked_as_malformed(database, FAULTS)


async def test_bad_metadata_is_not_a_fault_for_an_outbox_that_never_reads_it(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """Metadata is decoded only where an expression reads it; elsewhere it cannot hurt."""
    subject = unique_name("malformed")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    await _fill(database)
    data = config_dict(database, nats_url, subject, park_after=1)
    data["outboxes"]["loans"]["messages"]["BookLent"]["payload"] = {"loanId": "data.loanId"}
    config = await load_and_migrate(tmp_path, data)
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=3)
            await eventually(lambda: _all_parked(config, len(FAULTS) - 1))
        assert [m.headers["ce-id"] for m in received] == [
            "book/good-1@1",
            "book/bad-metadata@1",
            "book/good-2@1",
        ]
        preview = run_cli(["check", "--config", str(tmp_path / "relay.yaml"), "--last", "9"])
        assert "column 'metadata'" not in preview.stdout, preview.stdout
        assert "book/bad-metadata@1 BookLent" in preview.stdout, preview.stdout
    finally:
        await delete_stream(nats_url, subject)


async def _all_parked(config: RelayConfig, count: int) -> bool:
    return bool((await status(config))[0]["parked"] == count)


def _reading_metadata(dsn: str, nats_url: str, subject: str) -> dict[str, Any]:
    """A config whose payload reads the metadata, so that bad metadata is a fault."""
    data = config_dict(dsn, nats_url, subject, park_after=1)
    data["outboxes"]["loans"]["messages"]["BookLent"]["payload"] = {
        "loanId": "data.loanId",
        "trace": "metadata.trace",
    }
    return data


async def test_relay_check_shows_malformed_rows_as_they_would_be_handled(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    await _fill(database)
    config = save(tmp_path, _reading_metadata(database, nats_url, "anything"))
    result = run_cli(["check", "--config", str(config), "--last", str(len(ROWS))])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for fault in FAULTS.values():
        assert f"would be parked (malformed): {fault}" in result.stdout, result.stdout
    rows = json.loads(run_cli(["check", "--config", str(config), "--last", "9", "--json"]).stdout)
    assert sum(1 for r in rows if r.get("parked") == "malformed") == len(FAULTS)


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} published")


async def test_null_names_are_warned_of_and_parked_or_skipped_as_documented(
    private_database: str, nats_url: str, tmp_path: Path
) -> None:
    """A row with a NULL type is no outbox's event; one with a NULL aggregate type is parked
    by an outbox that maps its type for every aggregate, and never read by one that lists
    `aggregates`. Both were taken out of the reads without a word: `relay check` and the
    relay's start now warn of a table that allows it, with the statement that forbids it."""
    dsn, subject, books = private_database, unique_name("malformed"), unique_name("malformed")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    await create_stream(nats_url, books, [f"{books}.>"])  # one id a stream: see check --history
    async with connect(dsn) as conn:
        await conn.execute(LAX_TABLE.replace("type text NOT NULL", "type text"))
        for aggregate_type, aggregate_id, type_ in [
            ("book", "untyped", None),
            (None, "no-aggregate", "BookLent"),
            ("book", "good", "BookLent"),
        ]:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
                " metadata) VALUES ($1, $2, 1, $3, $4, '{}')",
                aggregate_type,
                aggregate_id,
                type_,
                GOOD,
            )
    data = config_dict(dsn, nats_url, subject, park_after=1)
    data["outboxes"]["books"] = {**data["outboxes"]["loans"], "aggregates": ["book"]}
    rule = data["outboxes"]["books"]["messages"]["BookLent"]
    data["outboxes"]["books"]["messages"] = {"BookLent": {**rule, "destination": f"{books}.books"}}
    config = await load_and_migrate(tmp_path, data)
    checked = run_cli(["check", "--config", str(tmp_path / "relay.yaml")])
    for column in ("type", "aggregate_type"):
        assert f"source.columns.{column}: column '{column}' of table 'events' allows NULL" in (
            checked.stdout + checked.stderr
        ), checked.stdout + checked.stderr
    assert "SET NOT NULL" in checked.stdout + checked.stderr
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)
            received += await fetch_all(nats_url, books, expected=1)
            await eventually(lambda: _parked_in(config, {"loans": 1, "books": 0}))
        assert [m.headers["ce-id"] for m in received] == ["book/good@1", "book/good@1"]
        await assert_parked_as_malformed(dsn, {"no-aggregate": "column 'aggregate_type' is NULL"})
    finally:
        await delete_stream(nats_url, subject)
        await delete_stream(nats_url, books)


async def _parked_in(config: RelayConfig, counts: dict[str, int]) -> bool:
    rows = await status(config)
    found = {row["name"]: row["parked"] for row in rows}
    return all(row["checkpoint"] == 3 for row in rows) and found == counts
