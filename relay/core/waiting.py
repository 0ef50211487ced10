"""Waiting on events with a deadline: the one idiom every loop here uses to stay stoppable."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_any(*events: asyncio.Event, within: float) -> bool:
    """Wait until one of `events` is set or `within` seconds pass; True if one was set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        done, _ = await asyncio.wait(waits, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return bool(done)


async def sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` unless `stop` is set first; True if the sleep ran its course."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return not stop.is_set()
