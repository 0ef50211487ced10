"""The steps of holding an outbox's lease, shared by a replica and by the CLI.

Both claim a lane the same way (check the table, choose the start, then in one
transaction: check the lane's count against the outbox's partition set, take the
next epoch; then fail what a previous holder left running, and the outbox's commands
that no holder will ever carry out), and both do their work beside the lease watch,
stopping the work at once if the lease cannot be proven.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import asyncpg

from relay.config.broker_identity import same_broker
from relay.core.lanes import Lane
from relay.postgres.claimed import ClaimedOutbox
from relay.postgres.command_queue import CommandQueue
from relay.postgres.lease import Lease
from relay.postgres.partitions import Partitions
from relay.postgres.source import EventSource
from relay.postgres.store import Claim, Store
from relay.runtime.commands import fail_stuck

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Claimant:
    """What claiming a lane needs: which lane of how many, its start, where its rows live."""

    lane: Lane
    start: str
    source: EventSource
    store: Store
    commands: CommandQueue
    partitions: Partitions
    broker: str | None = None  # the outbox's broker identity, recorded with its checkpoint
    replica: bool = True  # False for the CLI's claim, which leaves an operator's pin in place


async def claim(lease: Lease, claimant: Claimant, reader: asyncpg.Connection) -> ClaimedOutbox:
    """Claim the lane under `lease` (already held): the next epoch, fenced from here on.

    The table's checks and the start point are reads: they go on `reader`, so that the
    lease connection, which every lane of the replica shares, carries only what needs the
    lock (the epoch, the commands left running) and is free for the lease proofs. A lane
    of another count than the outbox's partition set is refused in the claim's own
    transaction (PartitionsChanged), and nothing is written; so is a replica's claim that
    waited its bound for a row another session holds locked (RowLocked).
    """
    c = claimant
    await c.source.check(reader)
    position, start_xmin = await c.source.start_point(reader, c.start)
    async with lease.claiming(c.lane.outbox, bounded=c.replica) as conn:
        record = await c.partitions.admit(
            conn,
            c.lane.outbox,
            c.lane.count,
            start=position,
            start_xmin=start_xmin,
            by=lease.identity,
            replica=c.replica,
        )
        assert record.start_position is not None  # admit records the first claim's start
        claimed = await c.store.claim(
            conn,
            c.lane.name,
            lease.identity,
            record.start_position,
            lease.key,
            start_xmin=record.start_xmin,
            broker=c.broker,
        )
        lease.claimed(claimed.epoch)  # proven just now: the session's proofs cover it
    async with lease.statement() as conn:
        await c.commands.abandon_running(conn, c.lane.name)
    done = ClaimedOutbox(c.store, lease, claimed)
    namespace, by = lease.config.namespace, lease.identity
    await fail_stuck(c.commands, done, reader, c.lane, namespace=namespace, by=by)
    return done


def warn_if_broker_changed(log: Any, outbox: str, claim: Claim) -> None:
    """Say so when the checkpoint was last written for another broker.

    The outbox carries on from its checkpoint: what came before it went to the old broker
    only, and nothing else would tell the operator.
    """
    was, now = claim.recorded_broker, claim.broker
    if was is None or now is None or same_broker(was, now):
        return
    log.warning(
        "the outbox's broker changed since its checkpoint was last written: it carries on"
        " from the checkpoint, and the events before it went to the old broker only. If the"
        f" new broker needs them, run `relay replay {outbox} --from-start` (or --from,"
        " --from-time), or relay them with a new outbox (start: beginning) for the new broker",
        recorded_broker=was,
        broker=now,
        checkpoint=claim.position,
    )


def warn_if_skip_unreadable(log: Any, claim: Claim) -> None:
    """Say so when the lane's skip (what a repartition's old lanes had published) is in a
    shape this release cannot read, a newer release's: it is read as none, so those events
    go out again (duplicates; consumers drop them by id), never lost."""
    if claim.skip_unreadable:
        log.warning(
            "the checkpoint's skip was written by a newer release and this one cannot read it:"
            " the events it covers that an old lane had published go out again (same ids)",
            checkpoint=claim.position,
        )


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
