"""Which replicas are alive, from Postgres: one heartbeat row each, tied to its lease session.

A replica counts while its row is fresh (by the database clock) and the session that
wrote it still exists: a killed replica drops out the moment Postgres closes its
session, a paused one once its row is older than `takeover_after`. Rows are per lease
namespace, so two deployments sharing a database do not share their fair share.

Each row also says which outboxes the replica runs, with which partition count, and how
many more lanes it may take (`lease.max_per_replica`): an outbox's lanes are shared among
the replicas that run it with its count, never with one that runs other outboxes only or
another count, and a replica at its cap leaves the rest to those with room.

A fresh row whose session is gone (the replica is reconnecting: its sessions were ended,
or the database restarted) still speaks for its configured counts until it goes stale:
changing an outbox's count waits for it, where sharing lanes does not.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import asyncpg

from relay.postgres.queries import statements


@dataclass(frozen=True, slots=True)
class Member:
    """A live replica, by its heartbeat."""

    identity: str
    outboxes: Mapping[str, int]  # outbox -> the partition count its config gives it
    room: int | None  # more lanes it may take, of any outbox; None: no cap
    connected: bool = True  # the session that wrote its row is still there
    version: str | None = None  # its release (None: one before replicas said it)
    # Outboxes its row names in a way this release cannot read (a newer release's shape:
    # `outboxes` above holds only the counts it can); "*" when the whole of it is so.
    unreadable: frozenset[str] = frozenset()

    def speaks_for(self, outbox: str) -> bool:
        """Whether its row says something of `outbox` that this release cannot read."""
        return bool(self.unreadable) and (outbox in self.unreadable or "*" in self.unreadable)


def change_coming(
    outbox: str, recorded: int, pinned: bool, members: Iterable[Member]
) -> int | None:
    """The count the fleet changes the outbox over to by itself, if a change is coming.

    One change is coming when every live replica that runs the outbox says one count, other
    than the `recorded` one, and no operator's `relay repartition` pinned it. Every fresh
    row speaks, connected or not: a replica reconnecting after its sessions were cut must
    not be taken for gone, or one stray replica of another count that reconnected first
    would change the fleet's outbox over. The replicas act on it (they change over); the
    CLI waits for it (a command it carried out on an old lane would be redone on the new).
    """
    counts = {m.outboxes[outbox] for m in members if outbox in m.outboxes}
    if pinned or len(counts) != 1 or recorded < 1 or any(m.speaks_for(outbox) for m in members):
        # A record or a replica whose word this release cannot read (a newer release's)
        # may say another count: nothing is changed over it.
        return None
    (count,) = counts
    return None if count == recorded else count


def _member(row: asyncpg.Record) -> Member:
    counts, unreadable = outboxes_of(row["outboxes"])
    return Member(
        row["identity"], counts, row["room"], row["connected"], row["version"], unreadable
    )


def outboxes_of(text: str) -> tuple[dict[str, int], frozenset[str]]:
    """A row's outboxes and counts (`{"loans": 3}`), and what it says that this release
    cannot read: a newer release may write another shape (docs/upgrading.md). That replica
    shares no lane of those outboxes with this one, and no count of them is changed while
    it is live (`change_coming`)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        return {}, frozenset({"*"})
    counts = {
        name: count
        for name, count in value.items()
        if type(count) is int and count >= 1  # not a bool, a float or an object
    }
    return counts, frozenset(value) - frozenset(counts)


async def live_members(
    conn: asyncpg.Connection, schema: str, namespace: str, stale_after: float
) -> list[Member]:
    """Every replica of the namespace whose row is fresh, for `relay status` and the CLI."""
    members = statements("membership", schema)["members"]
    rows = await conn.fetch(members, namespace, "", stale_after)
    return sorted((_member(r) for r in rows), key=lambda m: m.identity)


class Membership:
    def __init__(
        self,
        schema: str,
        namespace: str,
        identity: str,
        outboxes: Mapping[str, int],
        room: Callable[[], int | None] = lambda: None,
        *,
        version: str | None = None,
    ) -> None:
        self.queries = statements("membership", schema)
        self.namespace = namespace
        self.identity = identity
        self.outboxes = dict(outboxes)
        self.room = room
        self.version = version
        self.left = False  # once leaving, a late pass must not say it is alive again

    @property
    def me(self) -> Member:
        return Member(self.identity, self.outboxes, self.room(), version=self.version)

    async def beat(self, conn: asyncpg.Connection, stale_after: float) -> list[Member]:
        """Say this replica is alive (on its lease session); return the fresh rows, its own
        included (`connected` says which are live for sharing lanes)."""
        args = (self.namespace, self.identity, stale_after)
        if self.left:
            rows = await conn.fetch(self.queries["members"], *args)
        else:
            outboxes = json.dumps(self.outboxes)
            rows = await conn.fetch(
                self.queries["beat"], *args, outboxes, self.room(), self.version
            )
        return [self.me, *(_member(r) for r in rows)]

    async def leave(self, conn: asyncpg.Connection) -> None:
        """A graceful stop: the others may take this replica's share at once."""
        self.left = True
        await conn.execute(self.queries["leave"], self.identity)
