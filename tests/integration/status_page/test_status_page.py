"""The status page of real `relay run` replicas, read in a real headless Chromium.

What an operator on call checks: the page loads with nothing going wrong and nothing fetched
from outside the pod; its numbers are those of `relay status --json`; it follows the fleet
without a reload (a new checkpoint, a parked message, a holder killed with -9 and its lane
taken by the other replica); and event data that looks like markup stays text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from relay import __version__
from relay.runtime.status_page import page_file
from tests.support import postgres
from tests.support.browser import chromium, console_errors, requested_urls
from tests.support.db import append, append_many, connect
from tests.support.http import get, http_port
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import LIBRARY_MESSAGES, config_dict, eventually, loans, save

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[3]
SCREENSHOT = ROOT / "docs" / "images" / "status-page.png"
# A rule that fails at run time for a text amount: the event is parked with reason `mapping`.
FINES = {
    **LIBRARY_MESSAGES,
    "FineCharged": {
        "type": "library.fine-charged.v1",
        "destination": "{subject}.fines",
        "payload": {"amount": "abs(data.amount)"},
    },
}
SCRIPT = "<script>window.pwned = 1</script>"
HOSTILE_TYPE = '<img src=x onerror="window.pwned = 2">\'"'
HOSTILE_ID = f"{SCRIPT}\"'&amp;"
LONG_ID = "L" * 3000  # one unbroken word, far wider than any screen


def status_json(path: Path) -> list[dict[str, Any]]:
    result = run_cli(["status", "--json", "--config", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return rows


# One table as the page shows it now, read in one go (the page redraws its rows every few
# seconds, so elements found one call earlier may be gone): key -> field -> text.
READ_TABLE = """
const [table, key] = arguments;
const out = {};
for (const tr of document.querySelectorAll(`#${table} tbody tr`)) {
  if (!tr.hasAttribute(key)) continue;
  const cells = {};
  for (const td of tr.querySelectorAll("td")) cells[td.dataset.field] = td.textContent;
  out[tr.getAttribute(key)] = cells;
}
return out;
"""


def table(driver: webdriver.Chrome, name: str, key: str) -> dict[str, dict[str, str]]:
    rows: dict[str, dict[str, str]] = driver.execute_script(READ_TABLE, name, key)
    return rows


def lane_cells(driver: webdriver.Chrome, lane: str) -> dict[str, str]:
    """The page's row for `lane`: field -> the text shown."""
    return table(driver, "lanes", "data-lane").get(lane, {})


def parked_row(driver: webdriver.Chrome, position: int) -> dict[str, str]:
    """The parked message at `position` as the page shows it."""
    rows = table(driver, "parked", "data-parked").values()
    return next((r for r in rows if r.get("position") == str(position)), {})


def shown(value: object) -> str:
    return "" if value is None else str(value)


def assert_only_local(driver: webdriver.Chrome, port: int) -> None:
    urls = requested_urls(driver)
    assert urls, "the performance log recorded no request at all"
    here = f"http://127.0.0.1:{port}/"
    strays = [u for u in urls if not u.startswith(here)]
    assert strays == [], f"requests left 127.0.0.1:{port}: {strays}"
    assert console_errors(driver) == []


@contextlib.asynccontextmanager
async def library(
    dsn: str, nats_url: str, tmp_path: Path, *, audit: bool = False, **http: Any
) -> AsyncIterator[Path]:
    """A migrated config relaying the library (and its fines) to a stream of its own; with
    `audit`, audited continuously."""
    stream = unique_name("status-page")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    data = config_dict(dsn, nats_url, stream, messages=FINES)
    data["http"].update(http)
    if audit:
        data["outboxes"]["loans"]["audit"] = {"enabled": True, "delay": "1s", "every": "200ms"}
    path = save(tmp_path, data, f"relay-{stream}.yaml")
    assert run_cli(["migrate", "--config", str(path)]).returncode == 0
    try:
        yield path
    finally:
        await delete_stream(nats_url, stream)


async def start(relay_process: Any, path: Path, count: int) -> list[tuple[RelayProcess, int]]:
    replicas = [relay_process(["run", "--config", str(path)]) for _ in range(count)]
    return [(r, await http_port(r)) for r in replicas]


async def test_the_page_follows_the_fleet_as_relay_status_sees_it(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    async with library(events_table, nats_url, tmp_path, audit=True) as path:
        async with connect(events_table) as conn:
            await append_many(conn, loans(20))
        replicas = await start(relay_process, path, 2)

        def holder() -> str | None:
            holder_: str | None = status_json(path)[0]["holder"]
            return holder_

        await eventually(lambda: status_json(path)[0]["lag_events"] == 0, timeout=30)
        held_by = holder()
        assert held_by is not None
        # The page is read on the standby: it shows the whole fleet, and outlives the holder.
        (doomed, _), (survivor, port) = sorted(
            replicas, key=lambda r: not held_by.endswith(f":{r[0].pid}")
        )
        assert held_by.endswith(f":{doomed.pid}"), (held_by, doomed.pid)
        with chromium() as driver:
            driver.get(f"http://127.0.0.1:{port}/")
            driver.execute_script("window.marker = 'no reload'")

            # Its numbers are relay status --json's, field for field, once the fleet is still.
            row = status_json(path)[0]
            await eventually(
                lambda: lane_cells(driver, "loans").get("checkpoint") == shown(row["checkpoint"])
            )
            cells = lane_cells(driver, "loans")
            for field in ("state", "holder", "epoch", "checkpoint", "head", "lag_events", "parked"):
                assert cells[field] == shown(row[field]), (field, cells, row)
            assert float(cells["lag_seconds"]) == row["lag_seconds"]
            replicas_shown = table(driver, "replicas", "data-replica")
            assert len(replicas_shown) == 2, replicas_shown
            for identity, cells in replicas_shown.items():
                assert cells["version"] == __version__
                assert cells["holds"] == ("loans" if identity == held_by else ""), cells
            assert "database clock" in driver.find_element(By.ID, "meta").text
            assert_only_local(driver, port)

            # New events: the new checkpoint shows without a reload.
            async with connect(events_table) as conn:
                await append_many(conn, loans(5, "dvd"))
                head = await conn.fetchval("SELECT max(position) FROM events")
            await eventually(lambda: lane_cells(driver, "loans").get("checkpoint") == str(head))

            # The continuous audit's row follows, as relay status shows it.
            def audited() -> dict[str, str]:
                return table(driver, "audits", "data-outbox").get("loans", {})

            await eventually(lambda: audited().get("position") == str(head), timeout=30)
            audit = status_json(path)[0]["audit"]
            assert audit["position"] == head and audit["missing"] == 0
            assert audited()["missing"] == "0" and audited()["checked"] == shown(audit["checked"])

            # A parked message appears, with its reason.
            async with connect(events_table) as conn:
                poison = await append(conn, "book", "b1", 9, "FineCharged", {"amount": "three"})
            await eventually(lambda: bool(parked_row(driver, poison)), timeout=30)
            parked = parked_row(driver, poison)
            assert parked["reason"] == "mapping"
            assert "outboxes.loans.messages.FineCharged" in parked["error"]
            assert lane_cells(driver, "loans")["parked"] == "1"

            # The holder is killed: the page shows the lane moving to the survivor.
            doomed.kill()
            await eventually(
                lambda: lane_cells(driver, "loans").get("holder", "").endswith(f":{survivor.pid}"),
                timeout=30,
            )
            assert lane_cells(driver, "loans")["state"] in ("caught up", "relaying")
            # Its heartbeat row lasts until it goes stale; its session is gone at once.
            gone = held_by

            def doomed_shown_gone() -> bool:
                row = table(driver, "replicas", "data-replica").get(gone)
                return row is None or row["connected"] != "connected"

            await eventually(doomed_shown_gone, timeout=30)
            # The lag chart has this replica's samples by now.
            await eventually(
                lambda: bool(
                    driver.find_elements(
                        By.CSS_SELECTOR, "#charts figure[data-outbox='loans'] polyline"
                    )
                )
            )
            assert driver.execute_script("return window.marker") == "no reload"
            assert_only_local(driver, port)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            driver.save_screenshot(str(SCREENSHOT))


async def test_hostile_strings_are_shown_as_text(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    async with library(events_table, nats_url, tmp_path) as path:
        blocker = await asyncpg.connect(events_table, server_settings={"application_name": SCRIPT})
        try:
            async with connect(events_table) as conn:
                first = await append(
                    conn, HOSTILE_TYPE, HOSTILE_ID, 1, "FineCharged", {"amount": "x"}
                )
                second = await append(conn, "book", LONG_ID, 1, "FineCharged", {"amount": "y"})
            ((_, port),) = await start(relay_process, path, 1)
            # Both parked before the open transaction below holds the barrier (and the lane).
            await eventually(lambda: status_json(path)[0]["parked"] == 2, timeout=30)
            tx = blocker.transaction()
            await tx.start()
            await append(blocker, "book", "held", 1, "BookLent", {"loanId": "l"})
            with chromium() as driver:
                driver.get(f"http://127.0.0.1:{port}/")
                await eventually(lambda: bool(parked_row(driver, second)), timeout=30)
                hostile = parked_row(driver, first)
                assert hostile["event"] == f"{HOSTILE_TYPE}/{HOSTILE_ID}@1"
                assert HOSTILE_ID in hostile["error"]
                # Cut short (`relay parked show` has it whole), and said so.
                assert parked_row(driver, second)["event"] == f"book/{LONG_ID[:2000]}…@1"

                def blocking_shown() -> bool:
                    rows = table(driver, "blocking", "data-lane")
                    return [r["application_name"] for r in rows.values()] == [SCRIPT]

                await eventually(blocking_shown, timeout=30)
                # Shown, never run or parsed: no injected element, no script ran, and the long
                # word wraps instead of widening the page.
                assert driver.execute_script("return window.pwned") is None
                assert driver.find_elements(By.CSS_SELECTOR, "main img, main script") == []
                width = driver.execute_script(
                    "return [document.documentElement.scrollWidth, window.innerWidth]"
                )
                assert width[0] <= width[1], f"the page is wider than the window: {width}"
                assert_only_local(driver, port)
            await tx.rollback()

            # /status.json says the same under its documented schema.
            code, text = await get(port, "/status.json")
            assert code == 200
            body = json.loads(text)
            jsonschema.validate(body, json.loads(page_file("status.schema.json")))
            assert {p["event"] for p in body["parked"]} == {
                f"{HOSTILE_TYPE}/{HOSTILE_ID}@1",
                f"book/{LONG_ID[:2000]}…@1",
            }
        finally:
            await blocker.close()


async def test_viewers_share_one_read_and_the_page_can_be_turned_off(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    async with (
        library(events_table, nats_url, tmp_path) as on,
        library(events_table, nats_url, tmp_path, status_page=False) as off,
    ):
        ((_, port),) = await start(relay_process, on, 1)
        await eventually(lambda: status_json(on)[0]["holder"] is not None, timeout=30)
        # Twenty viewers at once: one read of the fleet answers them all.
        answers = await asyncio.gather(*(get(port, "/status.json") for _ in range(20)))
        assert {code for code, _ in answers} == {200}
        assert len({json.loads(text)["taken_at"] for _, text in answers}) == 1
        code, page = await get(port, "/")
        assert code == 200 and "/status.js" in page

        ((_, port_off),) = await start(relay_process, off, 1)
        for route in ("/", "/status.json", "/status.js"):
            assert (await get(port_off, route))[0] == 404, route
        assert (await get(port_off, "/metrics"))[0] == 200


async def test_a_database_outage_keeps_the_last_good_read_and_says_why(
    events_table: str,
    nats_url: str,
    tmp_path: Path,
    relay_process: Any,
    tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    pg = tcp_proxy(*postgres.address(events_table))
    dsn = postgres.with_address(events_table, pg.host, pg.port)
    async with library(dsn, nats_url, tmp_path) as path:
        ((_, port),) = await start(relay_process, path, 1)
        await eventually(lambda: status_json(path)[0]["holder"] is not None, timeout=30)
        with chromium() as driver:
            driver.get(f"http://127.0.0.1:{port}/")
            await eventually(lambda: bool(lane_cells(driver, "loans").get("holder")))
            good = json.loads((await get(port, "/status.json"))[1])
            pg.close()  # the database is gone, for the replica and its page

            def banner() -> str:
                text: str = driver.execute_script(
                    "const e = document.getElementById('error');"
                    " return e.hidden ? '' : e.textContent"
                )
                return text

            await eventually(lambda: "database" in banner(), timeout=30)
            assert banner().startswith("The last read of the fleet failed: ")
            assert "the tables show the last good read" in banner()
            assert lane_cells(driver, "loans")["state"]  # still there, as last read
            body = json.loads((await get(port, "/status.json"))[1])
            assert body["error"] and body["lanes"] and body["taken_at"] >= good["taken_at"]
            assert "Data from" in driver.find_element(By.ID, "meta").text
            assert_only_local(driver, port)


async def test_the_page_reads_the_fleet_on_one_kept_connection(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """Each read of the fleet (once a second while viewed, every 5 s for the lag samples)
    opened and closed a connection of its own: a backend's start-up per read. One session,
    `<identity>:status`, now serves them all, and is there between reads."""

    async def status_sessions() -> list[int]:
        async with connect(events_table) as conn:
            pids: list[int] = [
                r["pid"]
                for r in await conn.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE '%:status'"
                )
            ]
        return pids

    async with library(events_table, nats_url, tmp_path) as path:
        ((_, port),) = await start(relay_process, path, 1)
        await eventually(lambda: status_json(path)[0]["holder"] is not None, timeout=30)
        first: str = json.loads((await get(port, "/status.json"))[1])["taken_at"]
        sessions = await status_sessions()
        assert len(sessions) == 1, sessions

        async def read_again() -> bool:
            taken_at: str = json.loads((await get(port, "/status.json"))[1])["taken_at"]
            return taken_at != first

        await eventually(read_again, timeout=10)
        assert await status_sessions() == sessions
