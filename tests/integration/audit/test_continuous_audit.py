"""The continuous audit inside `relay run` (audit.enabled), against real Postgres and NATS.

A replica relays, then its audit reads the stream back once a window is `audit.delay` old:
a message deleted behind the relay's back is logged, counted by destination, shown by
`relay status`, and (with `audit.repair`) put back; a restart resumes at the recorded place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nats.js.api import StreamConfig

from tests.support.db import append_many, connect
from tests.support.http import get, http_port
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import delete_stream, fetch_all, unique_name
from tests.support.operator_cli import cli, relayed_up_to
from tests.support.scenario import eventually, loans, migrate_cli, write_config


async def audited_outbox(
    events_table: str, nats_url: str, tmp_path: Path, *, repair: bool = False
) -> tuple[Path, str]:
    """A stream that forgets re-sent ids at once (window 100 ms), and an outbox audited
    every 200 ms once a window is 3 s old."""
    stream = unique_name("audit")
    async with nats_connect(nats_url) as nc:
        await nc.jetstream().add_stream(
            StreamConfig(name=stream, subjects=[f"{stream}.>"], duplicate_window=0.1)
        )
    audit = {"enabled": True, "delay": "3s", "every": "200ms", "repair": repair}
    config = write_config(tmp_path, events_table, nats_url, stream, audit=audit)
    migrate_cli(config)
    return config, stream


def audit_row(config: Path) -> Any:
    return cli(config, "status")[0]["audit"]


async def lose(nats_url: str, stream: str, expected: int, indexes: list[int]) -> list[str]:
    """Delete these messages (by their order in the stream); their ids."""
    stored = await fetch_all(nats_url, stream, expected=expected)
    async with nats_connect(nats_url) as nc:
        for i in indexes:
            await nc.jetstream().delete_msg(stream, stored[i].seq)
    return [stored[i].headers["Nats-Msg-Id"] for i in indexes]


async def test_a_lost_message_is_logged_counted_and_shown_once(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await audited_outbox(events_table, nats_url, tmp_path)
    try:
        relay = relay_process(["run", "--config", str(config), "--http-port", "0"])
        port = await http_port(relay)
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(20))
        (lost,) = await lose(nats_url, stream, 20, [7])  # as soon as it is stored

        await eventually(lambda: (audit_row(config) or {}).get("position") == positions[-1])
        row = audit_row(config)
        assert row["missing"] == 1 and row["checked"] == 20 and row["last_error"] is None
        assert row["last_missing"][0]["id"] == lost
        assert row["last_missing"][0]["position"] == positions[7]
        said = [
            r for r in relay.logs() if r.get("event") == "audit: message missing from the broker"
        ]
        assert [(r["message_id"], r["position"]) for r in said] == [(lost, positions[7])]
        text = (await get(port, "/metrics"))[1]
        assert (
            'relay_audit_missing_total{destination="{subject}.{aggregate_type}"'.replace(
                "{subject}", stream
            )
            in text
            or "relay_audit_missing_total{destination=" in text
        )
        assert 'relay_audit_checked_total{outbox="loans"} 20.0' in text
        assert f'relay_audit_position{{outbox="loans"}} {float(positions[-1])}' in text
        status = cli(config, "status")
        assert status[0]["audit"]["missing"] == 1
        # Not repaired (audit.repair is off): still missing, and not counted again.
        assert len(await fetch_all(nats_url, stream, expected=19)) == 19
    finally:
        await delete_stream(nats_url, stream)


async def test_repair_puts_it_back_and_the_audit_moves_on_once_it_is_there(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await audited_outbox(events_table, nats_url, tmp_path, repair=True)
    try:
        relay = relay_process(["run", "--config", str(config)])
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(20))
        lost = await lose(nats_url, stream, 20, [3, 12])

        async def back() -> bool:
            ids = [m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)]
            return all(i in ids for i in lost)

        await eventually(back, timeout=30)
        await eventually(lambda: (audit_row(config) or {}).get("position") == positions[-1])
        row = audit_row(config)
        assert row["missing"] == 2  # each counted once, though audited again after the repair
        assert cli(config, "parked", "list", "loans") == []
        assert len(await fetch_all(nats_url, stream, expected=20)) == 20
        assert not [
            r
            for r in relay.logs()
            if r.get("level") == "error" and "audit" not in r.get("event", "")
        ]
    finally:
        await delete_stream(nats_url, stream)


async def test_a_restart_resumes_at_the_recorded_place(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    config, stream = await audited_outbox(events_table, nats_url, tmp_path)
    try:
        first = relay_process(["run", "--config", str(config)])
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
        await relayed_up_to(config, positions[-1])
        await eventually(lambda: (audit_row(config) or {}).get("position") == positions[-1])
        first.terminate()
        assert await first.wait_async(15) == 0

        second = relay_process(["run", "--config", str(config)])
        async with connect(events_table) as conn:
            later = await append_many(conn, loans(5, "dvd"))
        await relayed_up_to(config, later[-1])
        await eventually(lambda: (audit_row(config) or {}).get("position") == later[-1])
        row = audit_row(config)
        assert row["checked"] == 15 and row["missing"] == 0  # the first ten were not read again
        assert row["auditor"].endswith(f":{second.pid}")
    finally:
        await delete_stream(nats_url, stream)


async def test_a_repair_not_landed_yet_holds_the_audit_before_it(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A message parked as missing (its repair handed to retry-parked, which has not
    published it yet) holds the audit's place: had the audit moved past it, a repair that a
    duplicate window then dropped would never be seen again."""
    config, stream = await audited_outbox(events_table, nats_url, tmp_path)
    try:
        relay_process(["run", "--config", str(config)])
        async with connect(events_table) as conn:
            positions = await append_many(conn, loans(10))
            await conn.execute(
                "INSERT INTO relay.parked (outbox, position, event_type, aggregate_type,"
                " aggregate_id, version, reason, error, attempts, rule)"
                " VALUES ('loans', $1, 'BookLent', 'book', 'b4', 1, 'missing', 'audit', 0, '')",
                positions[4],
            )
        await relayed_up_to(config, positions[-1])
        await eventually(lambda: (audit_row(config) or {}).get("position") == positions[3])
        assert audit_row(config)["position"] == positions[3]  # and stays there
        cli(config, "parked", "drop", "--all", "--outbox", "loans", "--yes")
        await eventually(lambda: (audit_row(config) or {}).get("position") == positions[-1])
        assert audit_row(config)["missing"] == 0
    finally:
        await delete_stream(nats_url, stream)
