"""What the status page costs a replica: its CPU per event in a backlog drain with the page off,
and on with ten open tabs, taking turns in one run; and how long one read of the fleet takes.

    .venv/bin/python -m bench.status_page_bench --rounds 3 [--events 100000] [--viewers 10]

Each drain is relay_bench's relay phase (bench/measure.py, the relay in this process, its
CPU per event), on a fresh database and stream (bench/backlog.py), with the HTTP server on
127.0.0.1. With the page on, another process plays `--viewers` open tabs: each asks for
`/status.json` every 2 s, as the page does, so the replica serves them and samples the lag
as it would during an incident. The viewers' own CPU is theirs, not the relay's. Then
20 reads of the fleet (fleet/snapshot.py, what one refresh of the cache costs the
database) are timed on each drain's database with the page on, for one lane and for 17.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
import uuid
from statistics import mean, median
from typing import Any

from bench import backlog, measure
from bench.report import Results
from relay.config import RelayConfig
from relay.fleet.snapshot import snapshot
from relay.postgres.database import Database, KeptConnection
from relay.runtime.logs import configure

# One process of viewers: `--viewers` threads, each a tab asking every 2 s until killed.
VIEWERS = """
import sys, threading, time, urllib.request
url, count = sys.argv[1], int(sys.argv[2])
def tab():
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
        except OSError:
            pass
        time.sleep(2)
for _ in range(count):
    threading.Thread(target=tab, daemon=True).start()
threading.Event().wait()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def with_page(config: RelayConfig, port: int, page: bool) -> RelayConfig:
    http = config.http.model_copy(
        update={"enabled": True, "host": "127.0.0.1", "port": port, "status_page": page}
    )
    return config.model_copy(update={"http": http})


async def drain(events: int, page: bool, viewers: int) -> dict[str, Any]:
    """One drain; with the page on, `viewers` tabs open on it throughout."""
    options = backlog.RunOptions(events=events)
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = backlog.with_database(options.pg, name)
    port = free_port()
    tabs = None
    try:
        last = await backlog.set_up(options, dsn, name, Results(events=events, batch=500))
        config = with_page(backlog.bench_config(options, dsn, name), port, page)
        if page:
            url = f"http://127.0.0.1:{port}/status.json"
            tabs = await asyncio.create_subprocess_exec(
                sys.executable, "-c", VIEWERS, url, str(viewers)
            )
        run = await measure.relay_backlog(
            config, last, None, lambda: backlog.stored_messages(options.nats, name)
        )
        if run.throughput.stored != events:
            raise SystemExit(f"status_page_bench: {run.throughput.stored} stored, not {events}")
        read = await read_times(config, 20) if page else {}
        return {"cpu_us": run.throughput.cpu_us_per_msg, "rate": run.throughput.rate, **read}
    finally:
        if tabs is not None:
            tabs.kill()
            await tabs.wait()
        await backlog.cleanup(options, name)


async def read_times(config: RelayConfig, reads: int) -> dict[str, float]:
    """Milliseconds one read of the fleet takes (the median of `reads`): the bench's outbox
    alone, one lane; and with a second outbox of 16 partitions beside it, 17 lanes. On the
    page's kept connection, and (`_fresh`) on a connection of its own each time, as the
    page read before it kept one."""
    db = Database(config.database, "relay:bench:0")
    outbox = config.outboxes[backlog.OUTBOX]
    wide = {**config.outboxes, "wide": outbox.model_copy(update={"partitions": 16})}
    out = {}
    kept = KeptConnection(db, "status")
    try:
        for lanes, shaped in ((1, config), (17, config.model_copy(update={"outboxes": wide}))):
            times: dict[str, list[float]] = {"": [], "_fresh": []}
            for _ in range(reads):
                for kind, kept_times in times.items():
                    session = kept if not kind else KeptConnection(db, "status")
                    started = time.perf_counter()
                    await snapshot(session, shaped)
                    if kind:
                        await session.close()
                    kept_times.append((time.perf_counter() - started) * 1000)
            for kind, values in times.items():
                out[f"read_ms_{lanes}{kind}"] = median(values)
    finally:
        await kept.close()
    return out


async def main_async(args: argparse.Namespace) -> None:
    configure("warning", "json")
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    reads: dict[str, list[float]] = {
        key: [] for key in ("read_ms_1", "read_ms_1_fresh", "read_ms_17", "read_ms_17_fresh")
    }
    print("| round | page | CPU µs per event | events/s |\n|---|---|---|---|")
    for n in range(1, args.rounds + 1):
        for page in (False, True) if n % 2 else (True, False):
            result = await drain(args.events, page, args.viewers)
            label = "on" if page else "off"
            cpu[label].append(result["cpu_us"])
            for key, values in reads.items():
                if key in result:
                    values.append(result[key])
            print(f"| {n} | {label} | {result['cpu_us']:.1f} | {result['rate']:,.0f} |", flush=True)
    off, on = mean(cpu["off"]), mean(cpu["on"])
    ratio = on / off
    print(f"\noff: {off:.1f} µs per event; {args.viewers} viewers: {on:.1f}; on/off {ratio:.3f}")
    for key, values in reads.items():
        print(
            f"one read of the fleet, {key.removeprefix('read_ms_')} lane(s): {mean(values):.1f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3, help="drains with the page on, and off")
    parser.add_argument("--viewers", type=int, default=10, help="open tabs while it is on")
    args = parser.parse_args(argv)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
