"""Changing an outbox's partition count: by `relay repartition`, or by its replicas.

Either way the change runs under the lease of every old and new lane, so no replica
relays the outbox meanwhile, and in one transaction (postgres/partitions.py): the new
lanes start where the slowest old one stood and skip what the faster ones had already
published, so nothing is lost and nothing is sent twice.

- `relay repartition OUTBOX --partitions K` (`repartition`) refuses while a replica holds
  a lane, naming it. The count it sets is pinned: replicas configured with another count
  wait instead of changing it back, until one with this count claims a lane.
- A replica whose config says another count changes the outbox over itself
  (`change_over`, from replica.py) once every live replica that runs it agrees.
"""

from __future__ import annotations

import asyncio

from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.errors import UsageError
from relay.fleet.identity import identity
from relay.postgres.database import Database
from relay.postgres.lease import Lease, LeaseConnection
from relay.postgres.migrations import ensure_migrated
from relay.postgres.partitions import Partitions, PartitionsChanged, Repartitioned


class RepartitionRefused(UsageError):
    """A replica holds one of the outbox's lanes, or the count makes no sense."""


def _change_lock(session: LeaseConnection, outbox: str) -> Lease:
    """The outbox's change lock: whoever changes its count holds it first, alone, so that
    of two replicas (or a replica and the CLI) trying at once, one gets every lane rather
    than each a part, and the count it read under it stays the count."""
    return Lease(session, f"{outbox}#partitions")  # `#` is in no outbox's name


def _lanes(session: LeaseConnection, outbox: str, before: int, after: int) -> list[Lease]:
    """The lock of every lane of both counts."""
    names = sorted({lane.name for lane in lanes_of(outbox, before) + lanes_of(outbox, after)})
    return [Lease(session, name) for name in names]


async def _every_lane(
    session: LeaseConnection, outbox: str, before: int, after: int
) -> tuple[list[Lease], list[Lease]]:
    """The lock of every lane of both counts, in one statement: (taken, busy)."""
    leases = _lanes(session, outbox, before, after)
    taken = set(await session.try_locks([lease.key for lease in leases], len(leases)))
    return [le for le in leases if le.key in taken], [le for le in leases if le.key not in taken]


async def end_silent_holders(
    session: LeaseConnection, outbox: str, before: int, after: int
) -> bool:
    """End the session of every holder, silent for `takeover_after`, of a lock a change of
    count from `before` to `after` needs: the change lock and every lane of both counts, as
    a standby ends a lane's silent holder. True if one was ended.

    The change lock's holder is a replica or a `relay repartition` part way through; one
    cut off behind a proxy, which keeps its session open, held it for good, and no replica
    relayed the outbox until someone ended that session by hand.
    """
    leases = [_change_lock(session, outbox), *_lanes(session, outbox, before, after)]
    holders = await session.holders([le.key for le in leases], [le.outbox for le in leases])
    ended = False
    for lease in leases:
        holder = holders.get(lease.key)
        if holder is not None:
            ended |= await lease.take_over_if_silent(holder) is not None
    return ended


async def change_over(
    session: LeaseConnection,
    config: RelayConfig,
    outbox: str,
    count: int,
    *,
    by: str,
    expect: int,
) -> Repartitioned | None:
    """A replica's change of count; None if a lane is still held (try again later) or
    another change came first. Every lock it took is let go again, with NOTIFY."""
    change = _change_lock(session, outbox)
    if not await change.try_acquire():
        return None
    taken, busy = await _every_lane(session, outbox, expect, count)
    taken.append(change)
    try:
        if busy:
            return None
        async with session.statement() as conn:
            return await Partitions(config.database.schema_).repartition(
                conn,
                outbox=outbox,
                count=count,
                columns=config.source.columns,
                table=config.source.table,
                by=by,
                pinned=False,
                expect=expect,
            )
    except PartitionsChanged:
        return None
    finally:
        for lease in taken:
            await lease.release()


_ATTEMPTS = 3  # after ending a silent holder, a `relay repartition` tries again
_FREED = 0.5  # seconds: an ended session frees its locks as its backend exits


class _Busy(Exception):
    """Not an error: a lock to wait for, or to take over."""

    def __init__(self, lease: Lease, what: str, before: int) -> None:
        self.lease, self.what, self.before = lease, what, before


async def repartition(config: RelayConfig, outbox: str, count: int) -> Repartitioned:
    """`relay repartition`: change the count now, with the outbox's replicas stopped.

    A lock it needs held by a session silent for `takeover_after` (a repartition or a
    replica cut off part way through, its session kept open by a proxy) is taken over, as a
    standby takes over a lane; a live holder is named instead.
    """
    configured = config.outbox(outbox).partitions  # unknown: a ConfigError
    if count < 1:
        raise RepartitionRefused("--partitions must be 1 or more")
    db = Database.of(config, identity())
    for attempt in range(1, _ATTEMPTS + 1):
        session = LeaseConnection(db, config.lease, config.database.schema_, db.identity)
        try:
            try:
                return await _repartition(session, config, outbox, count, configured)
            except _Busy as busy:
                ended = attempt < _ATTEMPTS and await end_silent_holders(
                    session, outbox, busy.before, count
                )
                if not ended:
                    raise await _refused(busy.lease, busy.what) from None
        finally:
            await session.close()
        await asyncio.sleep(_FREED)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _repartition(
    session: LeaseConnection, config: RelayConfig, outbox: str, count: int, configured: int
) -> Repartitioned:
    """One attempt, on a session of its own: _Busy if a lock it needs is held."""
    schema = config.database.schema_
    partitions = Partitions(schema)
    async with session.statement() as conn:
        await ensure_migrated(conn, schema)
    change = _change_lock(session, outbox)
    if not await change.try_acquire():
        async with session.statement() as conn:  # the count now, to judge the holders by
            before = await partitions.count(conn, outbox, configured)
        raise _Busy(change, f"a change of outbox {outbox!r}'s partitions", before)
    async with session.statement() as conn:  # under the change lock: it stays the count
        before = await partitions.count(conn, outbox, configured)
    _, busy = await _every_lane(session, outbox, before, count)
    if busy:
        raise _Busy(busy[0], f"lane {busy[0].outbox} of outbox {outbox!r}", before)
    async with session.statement() as conn:
        return await partitions.repartition(
            conn,
            outbox=outbox,
            count=count,
            columns=config.source.columns,
            table=config.source.table,
            by=f"relay repartition ({session.identity})",
            pinned=True,
            expect=before,
        )


async def _refused(busy: Lease, what: str) -> RepartitionRefused:
    holder = await busy.holder()
    who = holder.identity if holder else "another session"
    return RepartitionRefused(
        f"{what} is held by {who}: stop the outbox's replicas first (a replica with another"
        " count waits until this has run), then run the command again"
    )
