"""A release that installs: `python -m build` gives an sdist and a wheel, and the wheel,
installed into a clean virtualenv away from the source tree, runs the example config.

The build works on a copy of the project's files (what `git ls-files` lists, as a fresh clone
has them), so that nothing in this tree (an egg-info, a build/ folder, the dev .venv) can
leak into the packages. `python -m build` makes the sdist and then the wheel from the sdist,
so the wheel proves the sdist carries what a build needs. The clean venv has no PYTHONPATH,
no editable install and a cwd outside the tree; pip installs the wheel's `nats` extra
constrained by requirements.lock, as an operator following docs/deploy.md would.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relay.runtime.status_page import FILES
from tests.support.db import append, connect
from tests.support.delivery import wait_for_count
from tests.support.jetstream import create_stream, fetch_all
from tests.support.nats_server import NatsServer

ROOT = Path(__file__).resolve().parents[2]
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
DIST = f"outbox_relay-{VERSION}"
EXAMPLE_CONFIG = ROOT / "config" / "relay.example.yaml"
LOCK = ROOT / "requirements.lock"
# What the sdist may hold at its top level: the package, its metadata, and the files a build
# or a reader needs. Tests, benches, docs, the chart and dev tooling stay in the repository.
SDIST_TOP = {
    "PKG-INFO",
    "pyproject.toml",
    "setup.cfg",
    "MANIFEST.in",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "relay",
    "outbox_relay.egg-info",
}
# The status page's files: package data, not modules (runtime/status_page.py serves them).
PAGE = {f"relay/runtime/page/{name}" for name, _ in FILES.values()}
# The statements of the relay's own tables (postgres/queries/own_tables.py reads them), and
# its metric families (core/metrics.py makes them).
STATEMENTS = "relay/postgres/queries/own_tables.sql"
FAMILIES = "relay/core/metrics.toml"
SDIST_NEEDS = {
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "relay/py.typed",
    STATEMENTS,
    FAMILIES,
    *PAGE,
}
# A line of the build's output that says something is wrong or about to break. pip's own
# notes about this machine's extra package index are not the build's business.
BUILD_WARNING = re.compile(r"warning|deprecat|!!", re.I)
HOST_PIP_NOTE = re.compile(r"^WARNING: Location 'file:.*' is ignored")


@dataclass(frozen=True)
class Release:
    sdist: Path
    wheel: Path
    output: str  # what `python -m build` printed


def clean_env(**extra: str) -> dict[str, str]:
    """The environment with nothing of the dev venv or the source tree in it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RELAY_CONFIG"}
        and not k.startswith("RELAY_")
    }
    dev_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != dev_bin)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # setuptools warns that it cannot byte-compile
    return {**env, **extra}


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run a command to its end; fail with its output unless it exits 0."""
    done = subprocess.run(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output}"
    return output


def project_files(target: Path) -> None:
    """Copy what a fresh clone holds (tracked files, and new ones not ignored) to `target`."""
    listed = run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        env=clean_env(),
    )
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet staged is still listed
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    source = tmp_path_factory.mktemp("source")
    project_files(source)
    out = tmp_path_factory.mktemp("dist")
    output = run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)], out, clean_env()
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Release(sdist, wheel, output)


@pytest.fixture(scope="module")
def installed(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh venv holding the wheel with the `nats` extra, and only that."""
    venv = tmp_path_factory.mktemp("venv")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    run([sys.executable, "-m", "venv", str(venv)], elsewhere, clean_env())
    python = str(venv / "bin" / "python")
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--no-compile",  # no .pyc of every dependency up front: the imports compile their own
    ]
    run([*pip, "-c", str(LOCK), f"{release.wheel}[nats]"], elsewhere, clean_env())
    return venv / "bin"


def test_the_build_names_the_version_and_warns_of_nothing(release: Release) -> None:
    assert release.sdist.name == f"{DIST}.tar.gz"
    assert release.wheel.name == f"{DIST}-py3-none-any.whl"
    warnings = [
        line
        for line in release.output.splitlines()
        if BUILD_WARNING.search(line) and not HOST_PIP_NOTE.match(line)
    ]
    assert warnings == [], "\n".join(warnings)


def test_the_wheel_carries_the_typed_package_and_its_license_only(release: Release) -> None:
    with zipfile.ZipFile(release.wheel) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"{DIST}.dist-info/METADATA").decode()
    assert "relay/py.typed" in names
    assert set(names) >= PAGE, f"the status page's files are missing: {PAGE - set(names)}"
    assert "relay/cli/main.py" in names and "relay/postgres/migrations.py" in names
    assert STATEMENTS in names, "the statements of the relay's own tables are missing"
    assert FAMILIES in names, "the relay's metric families are missing"
    assert f"{DIST}.dist-info/licenses/LICENSE" in names
    strays = [n for n in names if not n.startswith(("relay/", f"{DIST}.dist-info/"))]
    assert strays == [], "the wheel holds more than the package"
    assert not [n for n in names if "migrations/" in n or n.endswith(".pyc")]
    assert [n for n in names if n.endswith(".sql")] == [STATEMENTS]
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "\nProvides-Extra: nats\n" in metadata


def test_the_sdist_carries_what_a_build_needs_and_no_tests(release: Release) -> None:
    with tarfile.open(release.sdist) as sdist:
        names = [n.removeprefix(f"{DIST}/") for n in sdist.getnames() if n != DIST]
    assert set(names) >= SDIST_NEEDS, SDIST_NEEDS - set(names)
    top = {name.split("/", 1)[0] for name in names}
    assert top <= SDIST_TOP, f"unexpected in the sdist: {sorted(top - SDIST_TOP)}"
    junk = [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".log"))]
    assert junk == []


async def test_the_installed_wheel_migrates_checks_and_relays_the_example_config(
    installed: Path, events_table: str, nats_factory: Any, tmp_path: Path
) -> None:
    nats: NatsServer = nats_factory()
    await create_stream(nats.url, "LIBRARY", ["library.>"])
    config = tmp_path / "relay.yaml"
    shutil.copy(EXAMPLE_CONFIG, config)
    # The example names the machine's NATS; the test's own server stands in for it, and
    # port 0 keeps the relay's HTTP server off a port something else may hold.
    env = clean_env(
        DATABASE_URL=events_table,
        RELAY_BROKERS__NATS__SERVERS=f'["{nats.url}"]',
        RELAY_HTTP__PORT="0",
    )
    relay = str(installed / "relay")

    def cli(*args: str) -> str:
        return run([relay, *args, "--config", str(config)], tmp_path, env, timeout=60)

    where = run(
        [str(installed / "python"), "-c", "import relay; print(relay.__file__)"], tmp_path, env
    )
    assert Path(where.strip()).is_relative_to(installed.parent), f"relay imported from {where}"
    assert run([relay, "version"], tmp_path, env).strip() == VERSION

    async with connect(events_table) as conn:
        await append(conn, "book", "book-1", 1, "BookAdded", {"title": "Dune"})
        await append(conn, "book", "book-1", 2, "BookLent", {"loanId": "l-1", "memberId": "m-1"})
        await append(conn, "book", "book-1", 3, "BookReturned", {"loanId": "l-1", "late": False})
        await append(conn, "book", "book-2", 1, "BookLent", {"loanId": "l-2", "memberId": "m-2"})

    migrated = await asyncio.to_thread(cli, "migrate")
    assert "schema 'relay': applied migration(s)" in migrated
    checked = await asyncio.to_thread(cli, "check")
    assert "config OK: 1 outbox(es), 1 broker(s)" in checked
    assert "book/book-2@1" in checked and "library.book-lent.v1" in checked

    log = tmp_path / "relay-run.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            relay, "run", "--config", str(config), cwd=tmp_path, env=env, stdout=out, stderr=out
        )
    try:
        try:
            await wait_for_count(nats.url, "LIBRARY", lambda n: n >= 3, timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text(errors='replace')}") from None
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0, log.read_text(errors="replace")

    messages = await fetch_all(nats.url, "LIBRARY", expected=3)
    assert [(m.headers["ce-id"], m.headers["ce-type"]) for m in messages] == [
        ("book/book-1@2", "library.book-lent.v1"),
        ("book/book-1@3", "library.book-returned.v1"),
        ("book/book-2@1", "library.book-lent.v1"),
    ]
    assert messages[0].json() == {"bookId": "book-1", "loanId": "l-1", "memberId": "m-1"}
    assert messages[1].json() == {"bookId": "book-1", "loanId": "l-1", "late": False}
