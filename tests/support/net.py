"""Small socket utilities for starting local servers on free ports."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from relay.demo.embedded import free_port, port_open, wait_for_port

__all__ = ["free_port", "port_open", "steady_port", "wait_for_port"]

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def steady_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that stops and starts
    again on it: a port the OS handed out (`free_port`) can be handed to another socket
    bound to port 0 (a proxy's listener, a client) while its server is down, and the
    server then cannot start again."""
    try:
        lowest = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lowest = 32768
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(20000, lowest)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 20000 and {lowest}")
