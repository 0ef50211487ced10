"""Small socket utilities for starting local servers on free ports."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_port(
    host: str, port: int, timeout: float = 15.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Block until host:port accepts connections; fail early if `process` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port, timeout=0.2):
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before {host}:{port} opened"
            )
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not accept connections within {timeout}s")
