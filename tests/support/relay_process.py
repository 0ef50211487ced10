"""Running the relay CLI as a real subprocess, as production would.

Output goes to files (not pipes) so a chatty relay can never block on a full pipe, and so the
logs can be read while it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# How the relay is started: this checkout's, from the venv. A test may pass another prefix
# (the previous release's, see tests/support/previous_release.py).
CURRENT: tuple[str, ...] = (sys.executable, "-m", "relay")


def _command(args: Sequence[str], relay: Sequence[str] = CURRENT) -> list[str]:
    return [*relay, *args]


def _env(env: Mapping[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run_cli(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    relay: Sequence[str] = CURRENT,
) -> subprocess.CompletedProcess[str]:
    """Run a one-shot command such as `migrate`; output is captured, exit codes never raise."""
    return subprocess.run(
        _command(args, relay),
        env=_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class RelayProcess:
    """A running `python -m relay <args>`; stdout and stderr go to files in `log_dir`."""

    def __init__(
        self,
        args: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        relay: Sequence[str] = CURRENT,
    ) -> None:
        self.args = list(args)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = log_dir / "stdout.log"
        self.stderr_path = log_dir / "stderr.log"
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self._process = subprocess.Popen(
                _command(self.args, relay),
                env=_env(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, or None while running."""
        return self._process.poll()

    def terminate(self) -> None:
        self._send(signal.SIGTERM)

    def interrupt(self) -> None:
        self._send(signal.SIGINT)

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the process freezes, its sockets stay open and its kernel keeps ACKing."""
        self._send(signal.SIGSTOP)

    def resume(self) -> None:
        self._send(signal.SIGCONT)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for exit and return the exit code (raises subprocess.TimeoutExpired)."""
        return self._process.wait(timeout)

    async def wait_async(self, timeout: float = 30.0) -> int:  # noqa: ASYNC109
        """Like `wait`, without blocking the event loop."""
        async with asyncio.timeout(timeout):
            while (code := self._process.poll()) is None:  # noqa: ASYNC110 - no exit event
                await asyncio.sleep(0.05)
        return code

    def logs(self) -> list[dict[str, Any]]:
        """The JSON log records written to stderr so far; other lines are skipped."""
        records = []
        for line in self.stderr_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    async def wait_for_log(
        self,
        match: str | Callable[[dict[str, Any]], bool],
        timeout: float = 30.0,  # noqa: ASYNC109 - polls a file, not a future
    ) -> dict[str, Any]:
        """The first log record whose `event` equals `match` (or for which `match(record)`)."""

        def matches(record: dict[str, Any]) -> bool:
            return match(record) if callable(match) else record.get("event") == match

        try:
            async with asyncio.timeout(timeout):
                while True:
                    for record in self.logs():
                        if matches(record):
                            return record
                    if self._process.poll() is not None:
                        raise AssertionError(f"relay exited with {self._process.returncode}")
                    await asyncio.sleep(0.05)
        except (TimeoutError, AssertionError) as exc:
            raise AssertionError(f"no log matching {match!r}: {exc}\n{self.output()}") from exc

    def output(self) -> str:
        """Everything written to stdout and stderr so far."""
        out = self.stdout_path.read_text(errors="replace")
        err = self.stderr_path.read_text(errors="replace")
        return f"--- stdout ---\n{out}--- stderr ---\n{err}"

    def _send(self, signum: int) -> None:
        if self._process.poll() is None:
            self._process.send_signal(signum)
