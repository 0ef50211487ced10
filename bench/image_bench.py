"""What the image costs: `python3 dev.py image` cold (no cached base) and warm, the image's size,
and how long its Deployment container takes from `buildah run` to Ready and to relaying.

    .venv/bin/python -m bench.image_bench [--cold] [--rounds 3] [--events 1000]

As root, with buildah and mmdebstrap (`python3 dev.py image` installs them), against the
machine's Postgres (127.0.0.1:5432) and NATS (127.0.0.1:4222). `--cold` first removes the base
and the image, so the build starts with mmdebstrap. Each round renders the chart with the
example config (as tests/integration/deploy/test_image.py does), runs the migration Job's
container, appends the events, then starts the Deployment's container and times: the first
200 from the readiness probe's path, the first message stored, the last one, and the exit after
SIGTERM. A fresh database and stream per round, dropped at the end. docs/deploy.md has results.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import dev
from bench.report import mean_of, say
from tests.integration.deploy.chart import (
    NAMESPACE,
    RELEASE,
    ROOT,
    example_config,
    helm_python,
    objects,
    pod_spec,
    render,
)
from tests.support import postgres
from tests.support.db import append_many, connect
from tests.support.delivery import book_lent
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.net import free_port
from tests.support.pod import Buildah, Pod, Running, port_of

NATS_URL = "nats://127.0.0.1:4222"
POLL = 0.05  # seconds between two looks at the probe or the stream


def build(cold: bool) -> float:
    """Seconds `python3 dev.py image` takes; cold: without the base and the image first."""
    if cold:
        for name in (dev.base_name(), dev.image_name()):
            subprocess.run(["buildah", "rmi", name], capture_output=True, check=False)
    started = time.monotonic()
    subprocess.run([sys.executable, str(ROOT / "dev.py"), "image"], check=True)
    return time.monotonic() - started


def ready(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def stored(stream: str) -> int:
    async with nats_connect(NATS_URL) as nc:
        info = await nc.jetstream().stream_info(stream)
    return int(info.state.messages)


async def one_round(chart: Any, events: int, where: Path) -> dict[str, float]:
    """One start of the Deployment's container, timed from `buildah run`."""
    dsn = postgres.create_database(postgres.MACHINE_DSN)
    stream = unique_name("image_bench")
    await create_stream(NATS_URL, stream, [f"{stream}.>"])
    working = Buildah(dev.image_name())
    try:
        postgres.run_sql_file(dsn)
        values = {
            "relay": {"config": example_config(NATS_URL, stream, free_port())},
            "secret": {"values": {"DATABASE_URL": dsn}},
            "migrations": {"job": {"enabled": True}},
        }
        objs = objects(render(chart, values))
        job = Pod(
            objs["Job", f"{RELEASE}-migrate"]["spec"]["template"]["spec"], objs, "m", NAMESPACE
        )
        started = time.monotonic()
        command = working.command(job, job.container("migrate"), where / "job")
        await asyncio.to_thread(subprocess.run, command, check=True)
        migrated = time.monotonic() - started
        async with connect(dsn) as conn:
            await append_many(
                conn, [book_lent(f"book-{i % 50}", i // 50 + 1) for i in range(events)]
            )
        pod = Pod(pod_spec(objs), objs, f"{RELEASE}-bench", NAMESPACE)
        relay = pod.container("relay")
        port, path = port_of(relay, "readinessProbe")
        running = Running(working.command(pod, relay, where / "pod"), where / "relay.log")
        times: dict[str, float] = {"migrate_job": migrated}
        try:
            while "ready" not in times or "all_relayed" not in times:
                now = time.monotonic() - running.started
                if "ready" not in times and ready(port, path):
                    times["ready"] = now
                count = await stored(stream)
                if count and "first_relayed" not in times:
                    times["first_relayed"] = now
                if count >= events:
                    times["all_relayed"] = now
                if now > 120 or running.process.poll() is not None:
                    raise RuntimeError(f"no start within 120 s: {running.log.read_text()}")
                await asyncio.sleep(POLL)
            stopping = time.monotonic()
            running.terminate()
            code = running.wait(pod.spec["terminationGracePeriodSeconds"])
            times["exit_after_sigterm"] = time.monotonic() - stopping
            if code != 0:
                raise RuntimeError(f"exit code {code}: {running.log.read_text()}")
        finally:
            running.kill()
        return times
    finally:
        working.remove()
        await delete_stream(NATS_URL, stream)
        postgres.drop_database(postgres.MACHINE_DSN, dsn)


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold", action="store_true", help="remove the base and image first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=1000)
    args = parser.parse_args(argv)
    os.environ.setdefault("STORAGE_DRIVER", dev.STORAGE_DRIVER)
    if helm_python is None:
        say("helm-python-sdk is missing: .venv/bin/pip install -e '.[test]'")
        return 1
    if args.cold:
        cold = await asyncio.to_thread(build, True)
        say(f"cold build (mmdebstrap, then buildah bud): {cold:.0f} s")
    warm = await asyncio.to_thread(build, False)
    say(f"warm build (cached base and layers): {warm:.1f} s")
    size = dev.output(["buildah", "images", "--format", "{{.Size}}", dev.image_name()])
    say(f"image {dev.image_name()}: {size}")
    rounds: list[dict[str, float]] = []
    with helm_python.Chart.load(ROOT / "helm" / "outbox-relay") as chart:
        for n in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="image-bench-") as tmp:
                times = await one_round(chart, args.events, Path(tmp))
            say(f"round {n + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
            rounds.append(times)
    for key in rounds[0]:
        say(f"mean {key}: {mean_of([r[key] for r in rounds]):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
