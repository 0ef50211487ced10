"""The partition set: how many lanes each outbox runs with, as recorded, and changing it.

One row of `relay.outboxes` per outbox is the only source of truth. Every claim of a
lane checks it in the claim's own transaction (`admit`): a claimant whose count is not
the recorded one is refused and creates nothing, so two counts never relay an outbox
side by side. The row also records where a new lane starts, decided once for the outbox
at its first claim (`start: end` then covers every lane, however late it is first
claimed), and whether the count was set by an operator's `relay repartition`.

A change of count (`repartition`) runs under the lock of every lane involved, old and
new, so no lane is held meanwhile. The new lanes start where the slowest old lane stood
(a lane that never ran counts from where it would have started), and skip, until they
pass the fastest one, every event an old lane had already published: nothing is
skipped that was not sent, and nothing is sent twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import asyncpg

from relay.config import ColumnsConfig
from relay.core.lanes import Lane, lanes_of
from relay.errors import RelayError
from relay.postgres.queries import lane_at, move_parked, published, statements
from relay.postgres.skipping import Layer, Skip, skip_of, stacked

# In the outcome of an operator's command that a change of partitions ended.
PARTITIONS_CHANGED = "partitions_changed"


class UnreadablePartitions(RelayError):
    """The outbox's record holds a count this release cannot run (a newer release's)."""


class PartitionsChanged(RelayError):
    """A claimant's partition count is not the one recorded for the outbox."""

    def __init__(self, message: str, recorded: int, configured: int) -> None:
        super().__init__(message)
        self.recorded = recorded
        self.configured = configured


@dataclass(frozen=True, slots=True)
class PartitionSet:
    """An outbox's row of `relay.outboxes`."""

    outbox: str
    partitions: int
    start_position: int | None  # where a lane that never ran starts; None before any claim
    start_xmin: int | None  # `start: end` not settled yet (see EventSource.start_point)
    pinned: bool  # set by `relay repartition`: replicas never change it back on their own
    changed_by: str | None
    written: str | None = None  # the count as written, when it is none this release can run

    @property
    def unreadable(self) -> str | None:
        """Why this release cannot run the outbox by this record, None when it can. A newer
        release may write a count this one does not know (docs/upgrading.md): this replica
        then holds none of the outbox's lanes and never changes the record over."""
        if self.written is None:
            return None
        return (
            f"the outbox's partition set (relay.outboxes) holds {self.written} partitions, a"
            " count this release cannot run (written by a newer release?): this replica"
            " relays none of its lanes until the record holds a count of 1 or more"
        )


@dataclass(frozen=True, slots=True)
class Repartitioned:
    outbox: str
    before: int
    after: int
    start: int  # where every new lane starts
    resent: int  # events already published that go out again (none: see `skipped`)
    parked_moved: int
    skipped: int = 0  # events after `start` an old lane had published: the new lanes skip them


def mismatch(outbox: str, recorded: PartitionSet, configured: int, who: str | None = None) -> str:
    """Why a replica configured with `configured` partitions does not relay the outbox
    (`who`: that replica, when it is not the one saying it)."""
    if recorded.unreadable:
        return recorded.unreadable
    said = (
        f"{who} is configured with {configured}"
        if who
        else f"outboxes.{outbox}.partitions is {configured}"
    )
    base = f"{said}, but the outbox runs with {recorded.partitions} partition(s)"
    if recorded.pinned:
        return (
            f"{base}, set by `relay repartition`: set partitions to {recorded.partitions}, or"
            f" run `relay repartition {outbox} --partitions {configured}` once the replicas"
            f" running it with {recorded.partitions} have stopped"
        )
    return (
        f"{base}: the replicas change it over by themselves once every live replica running"
        f" it says {configured} (or run `relay repartition {outbox} --partitions {configured}`"
        " with its replicas stopped)"
    )


def _record(row: asyncpg.Record) -> PartitionSet:
    count = row["partitions"]
    runnable = isinstance(count, int) and count >= 1
    return PartitionSet(
        row["outbox"],
        count if runnable else 0,
        row["start_position"],
        row["start_xmin"],
        bool(row["pinned"]),
        row["changed_by"],
        None if runnable else ("NULL" if count is None else str(count)),
    )


class Partitions:
    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.queries = statements("partitions", schema)

    async def read(self, conn: asyncpg.Connection, outbox: str) -> PartitionSet | None:
        """The outbox's record; None before its first claim."""
        row = await conn.fetchrow(self.queries["read"], outbox)
        return None if row is None else _record(row)

    async def count(self, conn: asyncpg.Connection, outbox: str, configured: int) -> int:
        """The count the outbox runs with; the configured one before its first claim.
        UnreadablePartitions when the record holds a count this release cannot run."""
        record = await self.read(conn, outbox)
        if record is not None and record.unreadable:
            raise UnreadablePartitions(f"outbox {outbox!r}: {record.unreadable}")
        return configured if record is None else record.partitions

    async def hold(self, conn: asyncpg.Connection, lane: Lane) -> None:
        """In the caller's transaction: refuse (PartitionsChanged) a lane of another count
        than the outbox runs with, and keep the count from changing until the transaction
        ends (a change takes the record FOR UPDATE first). No record yet: any count."""
        recorded = await conn.fetchval(self.queries["hold"], lane.outbox)
        if recorded is not None and recorded < 1:
            raise UnreadablePartitions(
                f"outbox {lane.outbox!r} runs with a partition set this release cannot read"
                f" ({recorded} partitions): the command was not queued"
            )
        if recorded is not None and recorded != lane.count:
            raise PartitionsChanged(
                f"outbox {lane.outbox!r} runs with {recorded} partition(s) now, not"
                f" {lane.count}: the command was not queued",
                recorded,
                lane.count,
            )

    async def admit(
        self,
        conn: asyncpg.Connection,
        outbox: str,
        count: int,
        *,
        start: int,
        start_xmin: int | None,
        by: str,
        replica: bool,
    ) -> PartitionSet:
        """Check a claimant's count inside its claim's transaction; the first one records it.

        Raises PartitionsChanged (the caller's transaction then creates nothing) when the
        recorded count is another. Only a `replica`'s claim ends an operator's pin: the
        CLI claims a lane only to carry a command out, and were that to end the pin, a
        replica still configured with the old count would change the outbox back at once.
        """
        row = await conn.fetchrow(
            self.queries["admit"], outbox, count, start, start_xmin, by, replica
        )
        record = _record(row)
        if record.partitions != count:
            raise PartitionsChanged(mismatch(outbox, record, count), record.partitions, count)
        return record

    async def settle_start(self, conn: asyncpg.Connection, outbox: str, position: int) -> None:
        """`start: end`, once the first claim's barrier passed: where every new lane starts."""
        await conn.execute(self.queries["settle_start"], outbox, position)

    async def repartition(
        self,
        conn: asyncpg.Connection,
        *,
        outbox: str,
        count: int,
        columns: ColumnsConfig,
        table: str,
        by: str,
        pinned: bool,
        expect: int | None = None,
    ) -> Repartitioned:
        """Rewrite the outbox's lanes in one transaction; the caller holds every lane's lock.

        `expect`: the count the caller saw; if another change came first, nothing is done
        (PartitionsChanged).
        """
        async with conn.transaction():
            record = await conn.fetchrow(self.queries["lock"], outbox)
            current = None if record is None else _record(record)
            if current is not None and current.unreadable:  # a newer release's: left alone
                raise UnreadablePartitions(f"outbox {outbox!r}: {current.unreadable}")
            # No record: the outbox never ran, so any count is its count, with no lane yet.
            before = (expect or 1) if current is None else current.partitions
            if expect is not None and before != expect:
                raise PartitionsChanged(
                    f"outbox {outbox!r} went to {before} partition(s) meanwhile", before, expect
                )
            if count == before:  # nothing to do: leave checkpoints, epochs and states alone
                return Repartitioned(outbox, before, count, 0, 0, 0)
            rows = await conn.fetch(self.queries["lanes"], outbox)
            old = lanes_of(outbox, before)
            moved = 0
            if rows or (current is not None and current.start_position is not None):
                start, skipped, moved = await self._rewrite(
                    conn, outbox, count, current, old, rows, columns, table
                )
            else:  # never claimed: no lane has anything to carry over
                start, skipped = 0, 0
            # A command for an old lane can no longer be carried out there: the CLI that
            # waits for it reads this outcome and carries it out on the new lanes.
            await conn.execute(
                self.queries["end_commands"],
                outbox,
                json.dumps(
                    {
                        "error": f"the outbox's partitions changed to {count}",
                        PARTITIONS_CHANGED: True,
                    }
                ),
            )
            await conn.execute(self.queries["set_count"], outbox, count, pinned, by)
        return Repartitioned(outbox, before, count, start, 0, moved, skipped)

    async def _rewrite(  # noqa: PLR0917 - one transaction's state
        self,
        conn: asyncpg.Connection,
        outbox: str,
        count: int,
        current: PartitionSet | None,
        old: list[Lane],
        rows: list[asyncpg.Record],
        columns: ColumnsConfig,
        table: str,
    ) -> tuple[int, int, int]:
        """Replace every lane row of the outbox (orphans of another count too); returns where
        the new lanes start, how many events they skip, and how many parked rows moved."""
        by_name = {r["outbox"]: r for r in rows}
        # A lane that never ran starts where the outbox's lanes start; before any record
        # (rows an older relay wrote), from the beginning: a duplicate, never a loss.
        never_ran = (
            0 if current is None or current.start_position is None else current.start_position
        )
        positions = [
            int(by_name[lane.name]["position"]) if lane.name in by_name else never_ran
            for lane in old
        ]
        start = min(positions)
        unsettled = [r["start_xmin"] for r in rows if r["start_xmin"] is not None]
        if current is not None and current.start_xmin is not None:
            unsettled.append(current.start_xmin)
        xmin = unsettled[0] if unsettled else None
        epoch = max((int(r["epoch"]) for r in rows), default=0) + 1  # never back, per name
        broker = next((r["broker"] for r in rows if r["broker"] is not None), None)
        # A skip this release cannot read (a newer one's) is carried as none: sent again.
        older = [skip_of(by_name[lane.name]["skip"])[0] for lane in old if lane.name in by_name]
        skip = stacked(Layer(len(old), tuple(positions)), older, start)
        skipped = 0 if skip is None else await self._published(conn, skip, start, columns, table)
        await conn.execute(self.queries["drop_lanes"], outbox)
        await conn.executemany(
            self.queries["new_lane"],
            [
                (lane.name, start, epoch, xmin, broker, None if skip is None else skip.as_json())
                for lane in lanes_of(outbox, count)
            ],
        )
        retried = [by_name[lane.name] for lane in old if lane.name in by_name]
        await self._carry_retries(conn, outbox, count, retried, columns, table)
        moved = await self._move_parked(conn, outbox, count)
        return start, skipped, moved

    async def _carry_retries(  # noqa: PLR0917
        self,
        conn: asyncpg.Connection,
        outbox: str,
        count: int,
        rows: list[asyncpg.Record],
        columns: ColumnsConfig,
        table: str,
    ) -> None:
        """A message an old lane was retrying keeps its count of failures in the new lane
        that owns its aggregate now, so that `park_after` counts across the change. (Two in
        one new lane: the first it will meet keeps its count.)"""
        lane_of_retried = lane_at(table, columns, count)
        for row in sorted(
            (r for r in rows if r["retry_position"] is not None),
            key=lambda r: -int(r["retry_position"]),
        ):
            index = await conn.fetchval(lane_of_retried, row["retry_position"])
            if index is None:  # the row is gone: nothing to count
                continue
            await conn.execute(
                self.queries["carry_retry"],
                outbox if count == 1 else f"{outbox}/{index}",
                row["retry_position"],
                row["attempts"],
                row["rejections"],
                row["retry_rule"],
            )

    async def _published(
        self, conn: asyncpg.Connection, skip: Skip, start: int, columns: ColumnsConfig, table: str
    ) -> int:
        """Events after `start` that the old lanes had published: the new lanes skip them."""
        sql = published(table, columns, len(skip.layers))
        return int(await conn.fetchval(sql, start, skip.upto, *skip.arguments()))

    async def _move_parked(self, conn: asyncpg.Connection, outbox: str, count: int) -> int:
        """Parked messages follow their aggregate to its new lane."""
        status = await conn.execute(move_parked(self.schema, count), outbox)
        return int(status.split()[-1])
