"""The CLI on a bad config file: exit code 2 and the key at fault (a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_config import GOOD, write


def test_cli_exits_2_on_bad_config(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("        destination:", "        destinaton:"))
    result = subprocess.run(
        [sys.executable, "-m", "relay", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "destinaton: unknown key" in result.stderr


def test_cli_exits_2_on_an_override_of_a_whole_section(tmp_path: Path) -> None:
    """`RELAY_OUTBOXES={}` used to pass as `config OK`: the file's outboxes stayed."""
    path = write(tmp_path, GOOD)
    env = {**os.environ, "RELAY_OUTBOXES": "{}", "RELAY_DATABASE": "null"}
    result = subprocess.run(
        [sys.executable, "-m", "relay", "check", "--offline", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "environment variable RELAY_OUTBOXES: outboxes: Dictionary" in result.stderr
    assert "environment variable RELAY_DATABASE: database: Input should be" in result.stderr
    assert "config OK" not in result.stdout
