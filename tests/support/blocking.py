"""Run a coroutine to completion from synchronous code.

Sync fixtures and helpers use this so they work for sync and async tests alike. The coroutine
runs on a private event loop in a short-lived thread, so it never touches (or warns about) the
loop pytest-asyncio gives the test, even when called while that loop is running.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on a fresh event loop in a helper thread and return its result."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            error.append(exc)

    thread = threading.Thread(target=target, name="run_sync")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
