"""Reading a relay process's HTTP endpoints (/metrics, /healthz, /readyz)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from tests.support.relay_process import RelayProcess


async def get(port: int, path: str) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read().decode()

    return await asyncio.to_thread(fetch)


async def http_port(process: RelayProcess) -> int:
    record = await process.wait_for_log("http listening")
    return int(record["port"])
