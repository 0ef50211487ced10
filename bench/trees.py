"""Running one of this bench's functions against another tree's relay, in a child process.

A `--compare DIR` run measures the relay of DIR (a worktree of an older commit, say) with
this checkout's bench code, so that both sides are measured the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_CHILD = (
    "import sys, json, importlib.util as u; sys.path.insert(0, sys.argv[1]);"
    "s = u.spec_from_file_location('bench_here', sys.argv[2]); m = u.module_from_spec(s);"
    "s.loader.exec_module(m); import relay; assert relay.__file__.startswith(sys.argv[1]);"
    "print(json.dumps(getattr(m, sys.argv[3])(*map(int, sys.argv[4:]))))"
)


def call_in(tree: Path, bench_file: str, function: str, *args: int) -> Any:
    """`function(*args)` of the module at `bench_file`, with `relay` imported from `tree`;
    what it returns, through JSON."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tree), bench_file, function, *map(str, args)],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
