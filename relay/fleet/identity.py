"""Who this process is, as Postgres sees it: `relay:<pod or host>:<pid>`."""

from __future__ import annotations

import os
import socket


def identity() -> str:
    """Unique per process (two replicas on one node differ), readable in pg_stat_activity."""
    host = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()
    # application_name holds 63 bytes; keep room for the `:<role>` suffix status relies on.
    return f"relay:{host[-40:]}:{os.getpid()}"
