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


async def _every_lane(
    session: LeaseConnection, outbox: str, before: int, after: int
) -> tuple[list[Lease], list[Lease]]:
    """The lock of every lane of both counts, in one statement: (taken, busy)."""
    names = sorted({lane.name for lane in lanes_of(outbox, before) + lanes_of(outbox, after)})
    leases = [Lease(session, name) for name in names]
    taken = set(await session.try_locks([lease.key for lease in leases], len(leases)))
    return [le for le in leases if le.key in taken], [le for le in leases if le.key not in taken]


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


async def repartition(config: RelayConfig, outbox: str, count: int) -> Repartitioned:
    """`relay repartition`: change the count now, with the outbox's replicas stopped."""
    configured = config.outbox(outbox).partitions  # unknown: a ConfigError
    if count < 1:
        raise RepartitionRefused("--partitions must be 1 or more")
    schema = config.database.schema_
    db = Database.of(config, identity())
    partitions = Partitions(schema)
    session = LeaseConnection(db, config.lease, schema, db.identity)
    try:
        async with session.statement() as conn:
            await ensure_migrated(conn, schema)
        change = _change_lock(session, outbox)
        if not await change.try_acquire():
            raise await _refused(change, f"a change of outbox {outbox!r}'s partitions")
        async with session.statement() as conn:  # under the change lock: it stays the count
            before = await partitions.count(conn, outbox, configured)
        _, busy = await _every_lane(session, outbox, before, count)
        if busy:
            raise await _refused(busy[0], f"lane {busy[0].outbox} of outbox {outbox!r}")
        async with session.statement() as conn:
            return await partitions.repartition(
                conn,
                outbox=outbox,
                count=count,
                columns=config.source.columns,
                table=config.source.table,
                by=f"relay repartition ({db.identity})",
                pinned=True,
                expect=before,
            )
    finally:
        await session.close()


async def _refused(busy: Lease, what: str) -> RepartitionRefused:
    holder = await busy.holder()
    who = holder.identity if holder else "another session"
    return RepartitionRefused(
        f"{what} is held by {who}: stop the outbox's replicas first (a replica with another"
        " count waits until this has run), then run the command again"
    )
