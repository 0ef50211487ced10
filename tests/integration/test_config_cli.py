"""The CLI on a bad config file: exit code 2 and the key at fault (a process of its own)."""

from __future__ import annotations

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
