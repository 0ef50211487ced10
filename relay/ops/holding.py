"""The steps of holding an outbox's lease, shared by a replica and by the CLI.

Both claim the outbox the same way (check the table, choose the start, take the
next epoch, fail what a previous holder left running), and both do their work
beside the lease watch, stopping the work at once if the lease cannot be proven.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from relay.postgres.claimed import ClaimedOutbox
from relay.postgres.command_queue import CommandQueue
from relay.postgres.lease import Lease
from relay.postgres.source import EventSource
from relay.postgres.store import Store

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Claimant:
    """What claiming an outbox needs: its name and start, and where its rows live."""

    outbox: str
    start: str
    source: EventSource
    store: Store
    commands: CommandQueue


async def claim(lease: Lease, claimant: Claimant) -> ClaimedOutbox:
    """Claim the outbox under `lease` (already held): the next epoch, fenced from here on."""
    c = claimant
    async with lease.statement() as conn:
        await c.source.check(conn)
        position, start_xmin = await c.source.start_point(conn, c.start)
        claimed = await c.store.claim(
            conn, c.outbox, lease.identity, position, lease.key, start_xmin=start_xmin
        )
        await c.commands.abandon_running(conn, c.outbox)
    return ClaimedOutbox(c.store, lease, claimed)


@dataclass(frozen=True, slots=True)
class Held(Generic[T]):
    """The work's result, or why the lease was lost first (then `result` is None)."""

    result: T | None
    lost: str | None


async def while_held(
    lease: Lease,
    epoch: int,
    work: Coroutine[Any, Any, T],
    on_lost: Callable[[], None] = lambda: None,
) -> Held[T]:
    """Run `work` beside the lease watch; cancel whichever finishes second.

    `on_lost` runs before the work is cancelled: a holder closes its sockets there, so
    that a statement stuck on a dead path fails at once instead of at the next keepalive.
    The work's own exceptions (FencedError, DatabaseError) propagate.
    """
    working = asyncio.create_task(work, name=f"work:{lease.outbox}")
    watching = asyncio.create_task(lease.watch(epoch), name=f"lease:{lease.outbox}")
    try:
        done, _ = await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
        if watching in done:
            on_lost()
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
            return Held(None, watching.result())
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        return Held(working.result(), None)
    finally:
        for task in (working, watching):
            task.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
