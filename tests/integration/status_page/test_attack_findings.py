"""Holes found by a black-box attack on the status page and the relay around it (docs and CLI
only, real replicas against the local Postgres and NATS). Each test fails on the branch it was
written against (`status-page`, 04c3079)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from tests.support import postgres
from tests.support.browser import chromium
from tests.support.db import append, connect
from tests.support.http import get, http_port
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.net import steady_port
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, eventually, save

pytestmark = pytest.mark.timeout(180)

# Far more attempts than a float's exponent allows for `initial * multiplier ** attempt`
# (2 ** 1024 overflows); with the defaults (100ms doubling to 30s) that many attempts is about
# eight and a half hours of a broker outage: a weekend without the webhook's endpoint.
ATTEMPTS = 1100
DIED = "task died, stopping the relay"
STALE = 8  # seconds: four refresh periods of the page


def attempts(process: RelayProcess) -> int:
    """The highest attempt (publish or reconnect) the replica logged."""
    return max((int(r.get("attempt", 0)) for r in process.logs()), default=0)


def status_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as answer:
        text: str = answer.read().decode()
        return text


async def test_a_long_broker_outage_does_not_stop_the_fleet(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A broker that stays unreachable is retried for ever, paced by `retry.max`
    (configuration.md): the replica keeps running, and the page keeps showing the lane as
    `retrying` with its last error. On the branch, attempt 1025 or so computes the backoff
    as `initial * multiplier ** attempt` before capping it at `max`: OverflowError, "task
    died, stopping the relay", exit 1. The attempt count lives in the relay's tables, so the
    standby that takes the lane over (and every restart) dies at its first retry: the whole
    fleet crash-loops until the broker comes back. The retry pace is shortened to 1 ms so
    that the test reaches that attempt in seconds; with the defaults it takes ~8.5 hours."""
    data = config_dict(events_table, nats_url, "unused")
    closed = steady_port()  # nothing listens: every publish is refused at once (transient)
    data["brokers"] = {
        "hook": {"type": "http", "url": f"http://127.0.0.1:{closed}/{{destination}}"}
    }
    data["outboxes"]["loans"].update(
        broker="hook", retry={"initial": "1ms", "max": "1ms", "multiplier": 2, "jitter": 0}
    )
    data["logging"]["level"] = "info"
    path = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(path)]).returncode == 0
    async with connect(events_table) as conn:
        await append(conn, "book", "b1", 1, "BookLent", {"loanId": "l1", "memberId": "m1"})

    replicas = [relay_process(["run", "--config", str(path)]) for _ in range(2)]
    port = await http_port(replicas[0])
    await eventually(
        lambda: (
            max(attempts(r) for r in replicas) >= ATTEMPTS
            or any(r.returncode is not None for r in replicas)
        ),
        timeout=120,
    )
    died = [r.returncode for r in replicas if r.returncode is not None]
    causes = [r.get("error") for p in replicas for r in p.logs() if r.get("event") == DIED]
    assert died == [], f"replicas exited with {died} after a broker outage: {causes}"
    code, _ = await get(port, "/healthz")
    assert code == 200
    assert max(attempts(r) for r in replicas) >= ATTEMPTS


async def test_a_long_database_outage_does_not_stop_the_replica(
    events_table: str,
    nats_url: str,
    tmp_path: Path,
    relay_process: Any,
    tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    """Database down: the replica reconnects with `database.retry`'s backoff for as long as
    it takes, `/healthz` stays 200 and the page says why its reads fail (operations.md). On
    the branch the same overflow kills it: after ~1025 reconnect attempts the `listener`
    task dies (OverflowError) and the replica exits 1, so a database outage of ~8.5 hours
    with the defaults turns into a restart loop. 1 ms backoff to get there in seconds."""
    pg = tcp_proxy(*postgres.address(events_table))
    dsn = postgres.with_address(events_table, pg.host, pg.port)
    stream = unique_name("attack-db")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    try:
        data = config_dict(dsn, nats_url, stream)
        data["database"]["retry"] = {"initial": "1ms", "max": "1ms", "jitter": 0}
        data["logging"]["level"] = "info"
        path = save(tmp_path, data)
        assert run_cli(["migrate", "--config", str(path)]).returncode == 0
        replica = relay_process(["run", "--config", str(path)])
        port = await http_port(replica)
        await eventually(lambda: json.loads(status_text(port))["taken_at"] is not None)
        pg.close()
        await eventually(
            lambda: attempts(replica) >= ATTEMPTS or replica.returncode is not None, timeout=120
        )
        died = [r.get("error") for r in replica.logs() if r.get("event") == DIED]
        assert replica.returncode is None, f"exited with {replica.returncode}: {died}"
        assert (await get(port, "/healthz"))[0] == 200
    finally:
        await delete_stream(nats_url, stream)


async def test_before_the_first_good_read_the_page_claims_nothing_about_the_fleet(
    nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """A replica that cannot reach the database (a NetworkPolicy, a wrong host, Postgres
    down during a restart) serves its page at once: what the operator sees there must be
    "no data yet" and the error, not facts. On the branch the page, with no read behind it,
    says "No outbox configured." (the replica's config has one), "No replica is alive."
    (the one answering is), "Nothing is parked." and "Parked (0; ...)": an operator who opens
    it during an incident reads that the fleet is empty and healthy. operations.md promises
    that when a read fails "the tables keep the last good read"; before the first one there
    is nothing to keep, and the tables should say they have no data."""
    closed = steady_port()  # nothing listens there: the database is unreachable from the start
    dsn = f"postgresql://postgres@127.0.0.1:{closed}/postgres"
    path = save(tmp_path, config_dict(dsn, nats_url, "unused"))
    replica = relay_process(["run", "--config", str(path)])
    port = await http_port(replica)
    await eventually(lambda: json.loads(status_text(port))["error"] is not None)
    with chromium() as driver:
        driver.get(f"http://127.0.0.1:{port}/")

        def text() -> str:
            shown: str = driver.find_element(By.TAG_NAME, "body").text
            return shown

        await eventually(lambda: "cannot reach the database" in text())
        shown = text()
        claims = [
            claim
            for claim in (
                "No outbox configured",
                "No replica is alive",
                "Nothing is parked",
                "Parked (0",
            )
            if claim in shown
        ]
        assert claims == [], f"with no read of the fleet yet, the page claims {claims}:\n{shown}"


async def test_the_age_of_the_data_keeps_growing_when_the_replica_is_gone(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """`kubectl port-forward` to one pod, and that pod dies: the page is left with its last
    answer. The line under the title says how old the data is ("database clock, Ns ago");
    during a database outage that age grows, as it should. When the replica that served the
    page is gone, it stays frozen at what it was at the last answer ("0s ago") however long
    ago that was, on the line the operator reads to judge whether the tables are current."""
    stream = unique_name("attack-age")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    try:
        path = save(tmp_path, config_dict(events_table, nats_url, stream))
        assert run_cli(["migrate", "--config", str(path)]).returncode == 0
        replica = relay_process(["run", "--config", str(path)])
        port = await http_port(replica)
        with chromium() as driver:
            driver.get(f"http://127.0.0.1:{port}/")

            def age() -> int | None:
                """The age the page gives its data, in seconds."""
                found = re.search(r"(\d+)s ago", driver.find_element(By.ID, "meta").text)
                return int(found.group(1)) if found else None

            await eventually(lambda: age() is not None, timeout=30)
            replica.kill()
            replica.wait()
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            await eventually(
                lambda: not driver.find_element(By.ID, "error").get_attribute("hidden")
            )
            # Wait until the data is clearly older than any age the page could have shown.
            await eventually(lambda: loop.time() - killed_at > STALE, timeout=STALE + 5)
            shown = age()
            assert shown is None or shown >= STALE, (
                f"{loop.time() - killed_at:.0f}s after the replica died the page still says"
                f" its data is {shown}s old: {driver.find_element(By.ID, 'meta').text}"
            )
    finally:
        await delete_stream(nats_url, stream)
