"""/metrics, /healthz and /readyz of a real `relay run` process."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.db import append_many, connect
from tests.support.http import get, http_port
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.postgres import EVENTS_SQL, EmbeddedPostgres, run_sql_file
from tests.support.postgres import server as postgres_server
from tests.support.relay_process import run_cli
from tests.support.scenario import OVERSIZED_LOAN, config_dict, eventually, loans, save

ROOT = Path(__file__).resolve().parents[2]


def promtool() -> str:
    for candidate in (ROOT / ".venv" / "bin" / "promtool", Path("/usr/bin/promtool")):
        if candidate.exists():
            return str(candidate)
    pytest.fail("promtool not found: `python3 dev.py test` installs it from Debian's package")


async def test_metrics_pass_promtool_and_tell_the_story(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    stream = unique_name("metrics")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    config = save(tmp_path, config_dict(events_table, nats_url, stream))
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    try:
        async with connect(events_table) as conn:
            await append_many(conn, [*loans(20), OVERSIZED_LOAN])
        relay = relay_process(["run", "--config", str(config), "--http-port", "0"])
        port = await http_port(relay)
        await fetch_all(nats_url, stream, expected=20)

        async def parked_counted() -> bool:
            return 'relay_parked_messages{outbox="loans"} 1.0' in (await get(port, "/metrics"))[1]

        await eventually(parked_counted, timeout=20)
        status, text = await get(port, "/metrics")
        assert status == 200
        check = await asyncio.to_thread(
            subprocess.run,
            [promtool(), "check", "metrics"],
            input=text,
            text=True,
            capture_output=True,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        destination = f"{stream}.{{aggregate_type}}"
        assert samples[("relay_lease_held", (("outbox", "loans"),))] == 1
        assert (
            samples[
                (
                    "relay_messages_published_total",
                    (("destination", destination), ("outbox", "loans")),
                )
            ]
            == 20
        )
        assert samples[("relay_events_read_total", (("outbox", "loans"),))] == 21
        assert (
            samples[("relay_messages_parked_total", (("outbox", "loans"), ("reason", "rejected")))]
            == 1
        )
        # Over max_payload, found before sending: parked at its one attempt.
        assert (
            samples[("relay_publish_failures_total", (("outbox", "loans"), ("reason", "rejected")))]
            == 1
        )
        assert samples[("relay_end_to_end_latency_seconds_count", (("outbox", "loans"),))] == 20
        assert (
            samples[("relay_lease_transitions_total", (("event", "acquired"), ("outbox", "loans")))]
            == 1
        )
        assert ("relay_barrier_wait_seconds_count", (("outbox", "loans"),)) in samples
        assert ("relay_lag_seconds", (("outbox", "loans"),)) in samples
        assert any(name == "relay_build_info" for name, _ in samples)
        # The standard process and Python collectors: memory, CPU, file descriptors, GC.
        assert samples[("process_resident_memory_bytes", ())] > 10_000_000
        assert samples[("process_cpu_seconds_total", ())] > 0
        assert samples[("process_open_fds", ())] > 0
        assert samples[("python_gc_objects_collected_total", (("generation", "0"),))] >= 0
        assert "postgres://" not in text and "postgresql://" not in text
    finally:
        await delete_stream(nats_url, stream)


@pytest.fixture
def private_postgres() -> Iterator[EmbeddedPostgres]:
    server = postgres_server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_healthz_stays_up_while_postgres_is_down(
    private_postgres: EmbeddedPostgres, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    dsn = private_postgres.dsn
    run_sql_file(dsn, EVENTS_SQL)
    config = save(tmp_path, config_dict(dsn, nats_url, unique_name("health")))
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    relay = relay_process(["run", "--config", str(config)])
    port = await http_port(relay)

    async def ready() -> bool:
        return (await get(port, "/readyz"))[0] == 200

    await eventually(ready, timeout=20)
    assert (await get(port, "/healthz"))[0] == 200

    await asyncio.to_thread(private_postgres.halt)

    async def not_ready() -> bool:
        return (await get(port, "/readyz"))[0] == 503

    await eventually(not_ready, timeout=40)
    for _ in range(5):  # a database outage never fails liveness
        status, body = await get(port, "/healthz")
        assert status == 200, body
        await asyncio.sleep(0.3)
    assert relay.returncode is None

    await asyncio.to_thread(private_postgres.resume)
    await eventually(ready, timeout=40)
    relay.terminate()
    assert await relay.wait_async(15) == 0


async def test_half_sent_requests_are_closed_and_cannot_lock_out_a_scrape(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    """200 clients each send one line of a request and wait: a scraper gone wrong.

    The relay closes every one of them (the oldest at once past http.max_connections, the
    rest after http.request_timeout), keeps its descriptors bounded meanwhile, and still
    answers a normal scrape and the probes.
    """
    data = config_dict(events_table, nats_url, unique_name("slow"))
    data["http"] |= {"request_timeout": "1s", "max_connections": 64}
    config = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    relay = relay_process(["run", "--config", str(config)])
    port = await http_port(relay)
    before = open_fds(await scrape(port))

    async def half_sent() -> asyncio.StreamReader:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line that ends it
        await writer.drain()
        connections.append(writer)
        return reader

    async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
        with contextlib.suppress(ConnectionError):
            return await reader.read()  # b"" at the server's FIN
        return b""

    connections: list[asyncio.StreamWriter] = []
    try:
        readers = [await half_sent() for _ in range(200)]
        waiting = [asyncio.ensure_future(closed_by_server(r)) for r in readers]
        # Normal requests get through while the half-sent ones are still arriving or open.
        during = open_fds(await scrape(port))
        assert during <= before + 64 + 8, f"{during} descriptors open, {before} before"
        assert (await get(port, "/healthz"))[0] == 200
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*waiting)
        assert answers == [b""] * 200, "a half-sent request got an answer"
        assert (await get(port, "/readyz"))[0] == 200
        assert relay.returncode is None
    finally:
        for writer in connections:
            writer.close()


async def scrape(port: int) -> str:
    status, text = await get(port, "/metrics")
    assert status == 200, text
    return text


def open_fds(text: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "process_open_fds":
            return float(family.samples[0].value)
    raise AssertionError("/metrics serves no process_open_fds")
