"""The previous release's code, taken from git, to run beside this checkout's.

Its commit is kept in one place, `release/previous` at the repository's root, and moves on
each release. Its `relay` package is unpacked with `git archive` into a folder of the test's
own and run by this venv's interpreter, since its dependencies are this release's
(`dependency_drift` says when that stops being true). The command that starts it checks, in
the process itself, that `relay` was imported from that folder and not from this checkout.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RELEASE_FILE = ROOT / "release" / "previous"

# -P: no current folder in sys.path (a test run from the checkout would import its `relay`).
# PYTHONPATH puts the old tree before site-packages, where this checkout is installed.
_GUARD = (
    "import sys, relay; tree = sys.argv.pop(1);"
    " relay.__file__.startswith(tree + '/') or sys.exit("
    "f'the previous release must import relay from {tree}, not {relay.__file__}');"
    " from relay.cli.main import main; main()"
)


class PreviousReleaseMissing(AssertionError):
    """The commit in `release/previous` cannot be had from this clone."""


def previous_commit() -> str:
    """The commit named in `release/previous`: its only line that is not a comment."""
    lines = [
        line.strip()
        for line in RELEASE_FILE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if len(lines) != 1 or len(lines[0]) != 40:
        raise PreviousReleaseMissing(
            f"{RELEASE_FILE} must hold one full commit hash (40 hex digits), not {lines!r}"
        )
    return lines[0]


def _git(*args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], stdout=stdout, check=False)


@dataclass(frozen=True)
class PreviousRelease:
    """The previous release unpacked in `tree`; `relay` is the command prefix that runs it."""

    commit: str
    tree: Path

    @property
    def relay(self) -> tuple[str, ...]:
        return (sys.executable, "-P", "-c", _GUARD, str(self.tree))

    @property
    def env(self) -> dict[str, str]:
        """The environment its processes need (merged into the test's by RelayProcess)."""
        return {"PYTHONPATH": str(self.tree)}

    def pyproject(self) -> dict[str, Any]:
        return tomllib.loads((self.tree / "pyproject.toml").read_text())


def unpack(destination: Path) -> PreviousRelease:
    """`git archive` the previous release's `relay` package and pyproject into `destination`.

    A clone without that commit (a shallow one) fails here, saying how to fix it: the
    upgrade tests are never skipped.
    """
    commit = previous_commit()
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise PreviousReleaseMissing(
            f"the previous release's commit {commit} (named in {RELEASE_FILE}) is not in this"
            f" clone of {ROOT}: fetch the whole history (`git fetch --unshallow`, or clone"
            " without --depth) so that the upgrade tests can run that release's code"
        )
    destination.mkdir(parents=True, exist_ok=True)
    archive = _git("archive", commit, "relay", "pyproject.toml")
    untar = subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=False)
    if archive.returncode != 0 or untar.returncode != 0:
        raise PreviousReleaseMissing(f"could not unpack {commit} into {destination}")
    return PreviousRelease(commit, destination)


def runtime_dependencies(pyproject: dict[str, Any]) -> dict[str, list[str]]:
    """What the relay needs to run: its dependencies and every extra but the tests' own."""
    project = pyproject["project"]
    extras = {k: v for k, v in project.get("optional-dependencies", {}).items() if k != "test"}
    return {"dependencies": project["dependencies"], **extras}


def dependency_drift(release: PreviousRelease) -> dict[str, tuple[list[str], list[str]]]:
    """Each runtime requirement list of the previous release that this venv does not meet
    as written: (old, new). Extras this release adds, and an `all` that names more of them,
    are no drift: the old code never imports them.

    Empty while the previous release can run on this venv; otherwise it needs a venv of
    its own, and the upgrade tests must learn to build one.
    """
    old = runtime_dependencies(release.pyproject())
    new = runtime_dependencies(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    return {
        key: (old[key], new.get(key, []))
        for key in sorted(old)
        if not _needs(old[key]) <= _needs(new.get(key, []))
    }


def _needs(requirements: list[str]) -> set[str]:
    """Requirements as written, with the project's own extras (`outbox-relay[a,b]`) one each."""
    found: set[str] = set()
    for requirement in requirements:
        name, _, extras = requirement.partition("[")
        if name.strip() == "outbox-relay" and extras:
            found |= {f"outbox-relay[{e.strip()}]" for e in extras.rstrip("]").split(",")}
        else:
            found.add(requirement)
    return found
