"""NATS JetStream servers for tests: probing the machine's and running private ones.

Private servers let a test stop, kill and restart the broker without disturbing other tests.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from relay.demo.embedded import EmbeddedNats

MACHINE_URL = "nats://127.0.0.1:4222"
SYSTEM_BINARY = Path("/usr/sbin/nats-server")


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


NatsServer = EmbeddedNats


class NatsServerWithAuth(EmbeddedNats):
    """A private server that only lets `user` in with `password`."""

    def __init__(self, store_dir: Path, user: str, password: str) -> None:
        super().__init__(store_dir)
        self.user = user
        self.password = password

    def command(self) -> list[str]:
        return [*super().command(), "--user", self.user, "--pass", self.password]
