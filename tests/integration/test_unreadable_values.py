"""Values PostgreSQL holds but the relay cannot read are parked, named by their column.

A `created_at` of `infinity`, `-infinity` or a year outside 1 to 9999 (which Python's
datetime cannot hold), and a `numeric` version that is not a whole number or is beyond
bigint: each used to stop the relay at every start (the read, or the lag's subtraction,
failed), or to publish a rounded version that another event's id already had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.db import connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.malformed import assert_parked_as_malformed, relay_until_parked
from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, save, status

# A table such as some applications have: a numeric version.
NUMERIC_VERSION_TABLE = """
CREATE TABLE events (
  position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  aggregate_type text NOT NULL, aggregate_id text NOT NULL, version numeric NOT NULL,
  type text NOT NULL, payload jsonb NOT NULL, metadata jsonb NOT NULL DEFAULT '{}',
  created_at timestamptz NOT NULL DEFAULT now()
)
"""
NOW = "now"
ROWS: list[tuple[str, str, str]] = [
    # aggregate_id, version, created_at (as PostgreSQL reads them)
    ("good-1", "1", NOW),
    ("infinite", "1", "infinity"),
    ("minus-infinite", "1", "-infinity"),
    ("before-christ", "1", "0001-01-01 BC"),
    ("year-10000", "1", "10000-01-01 00:00:00+00"),
    ("huge-version", "100000000000000000000", NOW),
    ("half-version", "1.5", NOW),
    ("nan-version", "NaN", NOW),
    ("long-version", "1" + "0" * 200, NOW),
    ("good-2", "2", NOW),
]
# What each is parked for: the column, and the value as PostgreSQL writes it (times in the
# session's time zone, UTC here).
RANGE = "out of the range the relay reads (the years 1 to 9999)"
FAULTS = {
    "infinite": f"column 'created_at' is infinity, {RANGE}",
    "minus-infinite": f"column 'created_at' is -infinity, {RANGE}",
    "before-christ": f"column 'created_at' is 0001-01-01 00:00:00+00 BC, {RANGE}",
    "year-10000": f"column 'created_at' is 10000-01-01 00:00:00+00, {RANGE}",
    "huge-version": "column 'version' is 100000000000000000000, out of the range of bigint",
    "half-version": "column 'version' is 1.5, not a whole number",
    "nan-version": "column 'version' is NaN, out of the range of bigint",
    "long-version": f"column 'version' is 1{'0' * 79}... (201 characters), out of the range",
}


async def _fill(dsn: str, rows: list[tuple[str, str, str]]) -> None:
    async with connect(dsn) as conn:
        await conn.execute(NUMERIC_VERSION_TABLE)
        for aggregate_id, version, created_at in rows:
            await conn.execute(
                "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
                " created_at) VALUES ('book', $1, $2::text::numeric, 'BookLent', $3::jsonb,"
                " $4::text::timestamptz)",
                aggregate_id,
                version,
                '{"loanId": "L", "memberId": "m"}',
                created_at,
            )


def _config(dsn: str, nats_url: str, subject: str) -> dict[str, Any]:
    data = config_dict(dsn, nats_url, subject, park_after=1)
    # The time goes out in the body, so that a created_at the relay misread would show.
    rule = data["outboxes"]["loans"]["messages"]["BookLent"]
    rule["payload"] = {**rule["payload"], "at": "created_at"}
    return data


async def test_unreadable_values_are_parked_by_column_and_the_rest_flows(
    database: str, nats_url: str, stream: str, tmp_path: Path
) -> None:
    subject = stream
    await _fill(database, ROWS)
    config = await load_and_migrate(tmp_path, _config(database, nats_url, subject))
    received, checkpoint = await relay_until_parked(config, nats_url, subject, 2, len(FAULTS))
    assert checkpoint == len(ROWS)
    assert [m.headers["ce-id"] for m in received] == ["book/good-1@1", "book/good-2@2"]
    await assert_parked_as_malformed(database, FAULTS)


async def test_relay_check_shows_them_as_run_would_park_them(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    await _fill(database, ROWS)
    config = save(tmp_path, _config(database, nats_url, "anything"))
    result = run_cli(["check", "--config", str(config), "--last", str(len(ROWS))])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for fault in FAULTS.values():
        assert f"would be parked (malformed): {fault}" in result.stdout, result.stdout
    assert "book/good-1@1 BookLent" in result.stdout, result.stdout
    assert "book/good-2@2 BookLent" in result.stdout, result.stdout


async def test_status_and_the_lag_survive_an_infinite_time_next_in_line(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """The lag is the age of the next event: an infinite one cannot be subtracted from now.
    `relay status` and the relay's own lag gauge read it before anything is published."""
    subject = unique_name("unreadable")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    await _fill(database, [("infinite", "1", "infinity"), ("good", "1", NOW)])
    config = await load_and_migrate(tmp_path, _config(database, nats_url, subject))
    path = tmp_path / "relay.yaml"
    try:
        before = run_cli(["status", "--config", str(path)])
        assert before.returncode == 0, before.stdout + before.stderr
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=1)
            await eventually(lambda: _parked(config, 1))
            during = run_cli(["status", "--config", str(path)])
            assert during.returncode == 0, during.stdout + during.stderr
        assert [m.headers["ce-id"] for m in received] == ["book/good@1"]
    finally:
        await delete_stream(nats_url, subject)


async def _parked(config: Any, count: int) -> bool:
    return bool((await status(config))[0]["parked"] == count)


async def test_a_timestamp_without_time_zone_at_the_edge_of_the_range(
    database: str, nats_url: str, tmp_path: Path
) -> None:
    """A `timestamp` is read in the session's time zone (UTC here) and goes out with its
    offset: the first day of year 1 is a time the relay reads and publishes; infinity is
    parked as for a timestamptz. (A zone that moves such a time out of the years 1 to 9999
    parks it: test_reading.py.)"""
    subject = unique_name("unreadable")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    async with connect(database) as conn:
        await conn.execute(NUMERIC_VERSION_TABLE.replace("timestamptz", "timestamp"))
        await conn.execute(
            "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload,"
            " created_at) SELECT 'book', id, 1, 'BookLent', '{\"loanId\": \"L\"}', at::timestamp"
            " FROM (VALUES ('first', '0001-01-01 00:00:00'), ('infinite', 'infinity'),"
            " ('last', '9999-12-31 23:59:59.999999')) AS v(id, at)"
        )
    config = await load_and_migrate(tmp_path, _config(database, nats_url, subject))
    try:
        async with running(config):
            received = await fetch_all(nats_url, subject, expected=2)
            await eventually(lambda: _parked(config, 1))
        assert [m.headers["ce-id"] for m in received] == ["book/first@1", "book/last@1"]
        assert [json.loads(m.data)["at"] for m in received] == [
            "0001-01-01T00:00:00+00:00",
            "9999-12-31T23:59:59.999999+00:00",
        ]
    finally:
        await delete_stream(nats_url, subject)
