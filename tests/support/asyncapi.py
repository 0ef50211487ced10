"""The official AsyncAPI parser (`@asyncapi/parser`, JavaScript), installed and run by the tests.

The versions are pinned by tests/support/asyncapi_parser/package-lock.json and installed
with `npm ci` into .cache/node/asyncapi (ignored by git) the first time a test needs them,
and again only when the lock changes. Nothing is installed by hand, and nothing is skipped:
without Node.js the tests fail and say how to get it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "asyncapi_parser"
INSTALL = ROOT / ".cache" / "node" / "asyncapi"
MIN_NODE = 18  # @asyncapi/parser 3 needs it; the machines run Node.js 20

NO_NODE = (
    "Node.js {need} with npm is needed to validate the AsyncAPI document with the official "
    "parser (@asyncapi/parser); found {found}. Install it, for example "
    "`apt-get install nodejs npm` on Debian 12 or newer, or from https://nodejs.org/, "
    "and run the tests again: they install the parser themselves."
)

ERROR, WARNING, INFORMATION, HINT = 0, 1, 2, 3


class NodeMissing(RuntimeError):
    """Node.js or npm is absent or too old; the message says how to get them."""


def _node() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        missing = " and ".join(n for n, p in (("node", node), ("npm", npm)) if p is None)
        raise NodeMissing(NO_NODE.format(need=f"{MIN_NODE}+", found=f"no {missing} on PATH"))
    version = subprocess.run(
        [node, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE:
        raise NodeMissing(NO_NODE.format(need=f"{MIN_NODE}+", found=f"node {version}"))
    return node


def install_parser() -> Path:
    """Install the pinned parser once (per lock file); return the validator script's path."""
    _node()  # fail first, and clearly, without Node.js
    wanted = hashlib.sha256(
        (SOURCE / "package.json").read_bytes() + (SOURCE / "package-lock.json").read_bytes()
    ).hexdigest()
    INSTALL.mkdir(parents=True, exist_ok=True)
    stamp = INSTALL / ".installed"
    with (INSTALL.parent / "asyncapi.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run in this tree may be installing
        if not stamp.exists() or stamp.read_text().strip() != wanted:
            for name in ("package.json", "package-lock.json"):
                shutil.copy(SOURCE / name, INSTALL / name)
            command = ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"]
            done = subprocess.run(
                command, cwd=INSTALL, capture_output=True, text=True, timeout=600, check=False
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"`{' '.join(command)}` in {INSTALL} failed ({done.returncode}); it needs "
                    f"the npm registry:\n{done.stdout}\n{done.stderr}"
                )
            stamp.write_text(wanted + "\n")
    # The script runs from the install, so that Node finds the parser in its node_modules.
    script = INSTALL / "validate.mjs"
    shutil.copy(SOURCE / "validate.mjs", script)
    return script


def diagnostics(script: Path, files: Sequence[Path]) -> list[dict[str, Any]]:
    """What the parser says about each file: severity, code, message and path."""
    done = subprocess.run(
        [_node(), str(script), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the AsyncAPI parser failed ({done.returncode}):\n{done.stderr}")
    found: list[dict[str, Any]] = json.loads(done.stdout)
    return found


def problems(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Errors and warnings. (Information, such as "3.1.0 exists" for our 3.0.0, is not.)"""
    return [d for d in found if d["severity"] <= WARNING]
