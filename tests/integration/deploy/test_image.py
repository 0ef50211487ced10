"""The image, built by `python3 dev.py image` (buildah on a Debian base made by mmdebstrap) and
run the way the chart's Deployment and migration Job run it, against the machine's Postgres and
NATS: the Job's container migrates; the relay's container takes the lease, relays the events,
answers its probes on the manifest's port and paths, and exits 0 on SIGTERM within the grace
period, having written nothing outside /tmp. See docs/deploy.md for what this cannot check.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import canonicalize_name

import dev
from tests.integration.deploy.chart import (
    NAMESPACE,
    OUTBOX,
    RELEASE,
    ROOT,
    VERSION,
    example_config,
    image_distributions,
    locked_versions,
    objects,
    pod_spec,
    render,
)
from tests.support.db import append_many, connect
from tests.support.delivery import book_lent, event_id
from tests.support.http import get
from tests.support.jetstream import fetch_all
from tests.support.net import free_port
from tests.support.pod import Buildah, Pod, Running, port_of, snapshot

# A cold build (mmdebstrap, then pip) took about 4 minutes here; warm, seconds. The first test
# to run builds the image, so each may take that long.
BUILD_TIMEOUT = 1500
pytestmark = [pytest.mark.integration, pytest.mark.timeout(BUILD_TIMEOUT + 300)]


@pytest.fixture(scope="module", autouse=True)
def storage_driver() -> Iterator[None]:
    """The tests' buildah commands use the storage `dev.py image` builds into."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STORAGE_DRIVER", os.environ.get("STORAGE_DRIVER", dev.STORAGE_DRIVER))
        yield


@pytest.fixture(scope="module")
def image() -> str:
    """`python3 dev.py image`, as an operator runs it: the image's name, or its failure."""
    command = [sys.executable, str(ROOT / "dev.py"), "image"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"python3 dev.py image failed (exit {result.returncode}):\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    return result.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class Release:
    """The chart rendered with its default values, the example config and the Secret's
    DATABASE_URL (`plain`); the same with the migration Job instead of the init container
    (`with_job`); and the database and stream they point at."""

    plain: dict[tuple[str, str], dict[str, Any]]
    with_job: dict[tuple[str, str], dict[str, Any]]
    dsn: str
    nats_url: str
    stream: str


@pytest.fixture
def release(chart: Any, events_table: str, nats_url: str, stream: str) -> Release:
    values: dict[str, Any] = {
        "relay": {"config": example_config(nats_url, stream, free_port())},
        "secret": {"values": {"DATABASE_URL": events_table}},
    }
    with_job = {**values, "migrations": {"job": {"enabled": True}}}
    return Release(
        objects(render(chart, values)),
        objects(render(chart, with_job)),
        events_table,
        nats_url,
        stream,
    )


@pytest.fixture
def working(image: str, release: Release) -> Iterator[Buildah]:
    """A working container from the image the Deployment names (a pod's fresh filesystem)."""
    named = pod_spec(release.plain)["containers"][0]["image"]
    assert f"localhost/{named}" == image, "dev.py image builds the chart's default image"
    container = Buildah(named)
    try:
        yield container
    finally:
        container.remove()


async def test_the_image_runs_as_the_chart_deploys_it(
    release: Release, working: Buildah, tmp_path: Path
) -> None:
    before = snapshot(working.root)
    await run_the_migration_job(release, working, tmp_path / "job")
    async with connect(release.dsn) as conn:
        assert await conn.fetchval("SELECT to_regclass('relay.checkpoints')") is not None
        events = [book_lent("book-1", 1), book_lent("book-2", 1), book_lent("book-1", 2)]
        await append_many(conn, events)

    pod = Pod(pod_spec(release.plain), release.plain, f"{RELEASE}-5d8f7c9b4-q2w8z", NAMESPACE)
    relay = pod.container("relay")
    running = Running(working.command(pod, relay, tmp_path / "pod"), tmp_path / "relay.log")
    try:
        await answers(running, *port_of(relay, "readinessProbe"))
        await answers(running, *port_of(relay, "livenessProbe"))
        stored = await fetch_all(release.nats_url, release.stream, expected=3, timeout=60)
        ids = [event_id("book-1", 1), event_id("book-2", 1), event_id("book-1", 2)]
        assert [m.headers["Nats-Msg-Id"] for m in stored] == ids
        async with connect(release.dsn) as conn:
            holder = await conn.fetchval(
                "SELECT holder FROM relay.checkpoints WHERE outbox = $1", OUTBOX
            )
        assert holder and pod.name in holder, f"the lease is held by {holder!r}"
        running.terminate()
        code = await asyncio.to_thread(running.wait, pod.spec["terminationGracePeriodSeconds"])
    finally:
        running.kill()
    assert code == 0, running.log.read_text()
    after = snapshot(working.root)
    written = (before.keys() ^ after.keys()) | changed(before, after)
    # Kubernetes mounts the root filesystem read-only; buildah cannot, so compare it instead:
    # only the mount points the runtime made for the volumes may have changed.
    assert written - mount_points(relay) == set(), "written outside /tmp"


async def run_the_migration_job(release: Release, working: Buildah, where: Path) -> None:
    """The migration Job's container, to its end, within the Job's activeDeadlineSeconds."""
    job = release.with_job["Job", f"{RELEASE}-migrate"]["spec"]
    pod = Pod(job["template"]["spec"], release.with_job, f"{RELEASE}-migrate-7x2kq", NAMESPACE)
    command = working.command(pod, pod.container("migrate"), where)
    deadline = job["activeDeadlineSeconds"]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=deadline, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def mount_points(container: dict[str, Any]) -> set[str]:
    """The volumes' mount paths and the folders that hold them, as paths in a snapshot."""
    points: set[str] = set()
    for mount in container["volumeMounts"]:
        path = Path(mount["mountPath"].lstrip("/"))
        points |= {str(p) for p in (path, *path.parents) if p != Path(".")}
    return points


def changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {path for path in before.keys() & after.keys() if before[path] != after[path]}


async def answers(running: Running, port: int, path: str, timeout: float = 120) -> None:  # noqa: ASYNC109
    """Wait until GET path on port answers 200, as the kubelet's probe would."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = None
    while loop.time() < deadline:
        assert running.process.poll() is None, running.log.read_text()
        try:
            status, _ = await get(port, path)
        except OSError as exc:
            last = exc
        else:
            if status == 200:
                return
            last = status
        await asyncio.sleep(0.2)
    pytest.fail(f"GET {path} on port {port}: {last} after {timeout} s\n{running.log.read_text()}")


def test_the_image_holds_the_runtime_only(image: str) -> None:
    """The relay's dependencies at the lock's versions, tini, the base: no test tool, no
    compiler; and the version pyproject.toml gives, in its label and from `relay version`."""
    container = Buildah(image)
    base = Buildah(dev.base_name())
    try:
        labels = container.config()["Labels"]
        assert labels["org.opencontainers.image.version"] == VERSION
        version = subprocess.run(
            [*container.run_as("10001:10001"), "relay", "version"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert version.returncode == 0, version.stderr
        assert VERSION in version.stdout.split()
        installed = venv_distributions(container.root)
        lock = locked_versions()
        expected = {name: lock[name] for name in image_distributions()}
        # Besides: the relay, and what `python3 -m venv` puts in every virtualenv.
        assert installed.keys() == expected.keys() | {"outbox-relay", "pip", "setuptools"}
        assert {n: v for n, v in installed.items() if n in expected} == expected
        assert installed["outbox-relay"] == VERSION
        added = debian_packages(container.root) - debian_packages(base.root)
        assert added == {"tini"}, "the runtime stage adds tini to the base and nothing else"
        assert not debian_packages(container.root) & {"gcc", "make", "python3-dev", "git"}
        leftovers = [*container.root.glob("var/lib/apt/lists/*_Packages")]
        leftovers += container.root.glob("var/cache/apt/*.bin")
        assert leftovers == [], "apt's package lists and caches are removed"
    finally:
        container.remove()
        base.remove()


def venv_distributions(root: Path) -> dict[str, str]:
    """{canonical name: version} of the image's virtualenv, from its *.dist-info folders."""
    (site,) = root.glob("opt/relay/venv/lib/python3*/site-packages")
    found: dict[str, str] = {}
    for info in site.glob("*.dist-info"):
        name, version = info.name.removesuffix(".dist-info").split("-", 1)
        found[canonicalize_name(name)] = version
    return found


def debian_packages(root: Path) -> set[str]:
    """The packages dpkg lists as installed in a root filesystem."""
    status = (root / "var" / "lib" / "dpkg" / "status").read_text(encoding="utf-8")
    return {
        block.split("\n", 1)[0].removeprefix("Package: ")
        for block in status.split("\n\n")
        if block.startswith("Package: ") and "Status: install ok installed" in block
    }
