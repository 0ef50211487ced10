"""`relay repartition OUTBOX --partitions K`: change an outbox's lane count, safely.

It takes the lease of every old and new lane first, so no replica relays the outbox
meanwhile (a replica holding one makes it refuse, naming it); then the new lanes all
start at the lowest checkpoint of the old ones, in one transaction. Nothing is
skipped; what faster old lanes had published after that point is sent again with
the same ids, and the command says how many.
"""

from __future__ import annotations

from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.errors import UsageError
from relay.ops.identity import identity
from relay.postgres.database import Database
from relay.postgres.lease import Lease, LeaseSession
from relay.postgres.migrations import ensure_migrated
from relay.postgres.partitions import Partitions, Repartitioned


class RepartitionRefused(UsageError):
    """A replica holds one of the outbox's lanes, or the count makes no sense."""


async def repartition(config: RelayConfig, outbox: str, count: int) -> Repartitioned:
    config.outbox(outbox)  # unknown: a ConfigError
    if count < 1:
        raise RepartitionRefused("--partitions must be 1 or more")
    schema = config.database.schema_
    db = Database(config.database, identity())
    partitions = Partitions(schema)
    session = LeaseSession(db, config.lease, schema, db.identity)
    try:
        async with session.statement() as conn:
            await ensure_migrated(conn, schema)
            before = await partitions.recorded(conn, outbox) or 1
        names = sorted({lane.name for lane in lanes_of(outbox, before) + lanes_of(outbox, count)})
        leases = [Lease(session, name) for name in names]
        taken = set(await session.try_locks([lease.key for lease in leases], len(leases)))
        busy = [lease for lease in leases if lease.key not in taken]
        if busy:
            holder = await busy[0].holder()
            who = holder.identity if holder else "another session"
            raise RepartitionRefused(
                f"lane {busy[0].outbox} of outbox {outbox!r} is held by {who}: stop the"
                " outbox's replicas first (they refuse to start with a new count until this"
                " has run), then run the command again"
            )
        async with session.statement() as conn:
            return await partitions.repartition(
                conn,
                outbox=outbox,
                count=count,
                columns=config.source.columns,
                table=config.source.table,
            )
    finally:
        await session.close()
