"""How many lanes each outbox has, as recorded, and changing that count safely.

A replica whose config says another count than the one recorded refuses to start:
lanes hash aggregates by the count, so two counts at once would publish some
aggregates twice and out of order. `relay repartition` changes it under every
lease involved, starting the new lanes where the slowest old one stood, so
nothing is skipped; what the faster lanes had already sent goes out again, with
the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from relay.config import ColumnsConfig
from relay.core.lanes import Lane, lanes_of
from relay.errors import RelayError
from relay.postgres.source import lane_expression, lane_of
from relay.postgres.sql import qualified, quote


class PartitionsChanged(RelayError):
    """The config's partition count differs from the one recorded for the outbox."""


@dataclass(frozen=True, slots=True)
class Repartitioned:
    outbox: str
    before: int
    after: int
    start: int  # where every new lane starts
    resent: int  # events already published by a faster old lane, to be sent again
    parked_moved: int


class Partitions:
    def __init__(self, schema: str) -> None:
        self._outboxes = f"{quote(schema)}.outboxes"
        self._checkpoints = f"{quote(schema)}.checkpoints"
        self._parked = f"{quote(schema)}.parked"
        self._commands = f"{quote(schema)}.commands"

    async def recorded(self, conn: asyncpg.Connection, outbox: str) -> int | None:
        """The recorded count; an outbox relayed before partitions existed has 1."""
        count = await conn.fetchval(
            f"SELECT partitions FROM {self._outboxes} WHERE outbox = $1", outbox
        )
        if count is not None:
            return int(count)
        existed = await conn.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM {self._checkpoints} WHERE outbox = $1)", outbox
        )
        return 1 if existed else None

    async def mismatch(self, conn: asyncpg.Connection, outbox: str, count: int) -> str | None:
        """Why `count` cannot run: the outbox runs with another recorded count; else None."""
        recorded = await self.recorded(conn, outbox)
        if recorded is None or recorded == count:
            return None
        return (
            f"outboxes.{outbox}.partitions is {count}, but the outbox runs with {recorded}"
            f" partition(s): stop its replicas and run `relay repartition {outbox}"
            f" --partitions {count}` (or set partitions back to {recorded})"
        )

    async def agree(self, conn: asyncpg.Connection, outbox: str, count: int) -> None:
        """Record `count` for a new outbox; refuse a count other than the recorded one."""
        if (why := await self.mismatch(conn, outbox, count)) is not None:
            raise PartitionsChanged(why)
        await conn.execute(
            f"INSERT INTO {self._outboxes} (outbox, partitions) VALUES ($1, $2)"
            " ON CONFLICT (outbox) DO NOTHING",
            outbox,
            count,
        )

    async def repartition(
        self,
        conn: asyncpg.Connection,
        *,
        outbox: str,
        count: int,
        columns: ColumnsConfig,
        table: str,
    ) -> Repartitioned:
        """Rewrite the outbox's lanes, in one transaction; the caller holds every lane's lock."""
        before = await self.recorded(conn, outbox) or 1
        old = lanes_of(outbox, before)
        new = lanes_of(outbox, count)
        if count == before:  # nothing to do: leave checkpoints, epochs and states alone
            start = await conn.fetchval(
                f"SELECT coalesce(min(position), 0) FROM {self._checkpoints}"
                " WHERE outbox = ANY($1::text[])",
                [lane.name for lane in old],
            )
            return Repartitioned(outbox, before, count, int(start), 0, 0)
        async with conn.transaction():
            positions = {
                r["outbox"]: int(r["position"])
                for r in await conn.fetch(
                    f"SELECT outbox, position FROM {self._checkpoints}"
                    " WHERE outbox = ANY($1::text[]) FOR UPDATE",
                    [lane.name for lane in old],
                )
            }
            start = min(positions.values(), default=0)
            resent = await self._resent(
                conn, old=old, positions=positions, start=start, columns=columns, table=table
            )
            await conn.execute(
                f"DELETE FROM {self._checkpoints} WHERE outbox = ANY($1::text[])",
                [lane.name for lane in old],
            )
            await conn.executemany(
                f"INSERT INTO {self._checkpoints} (outbox, position) VALUES ($1, $2)",
                [(lane.name, start) for lane in new],
            )
            moved = await self._move_parked(conn, old, count, columns)
            await conn.execute(
                f"UPDATE {self._commands} SET state = 'expired', finished_at = now()"
                " WHERE outbox = ANY($1::text[]) AND state = 'pending'",
                [lane.name for lane in old],
            )
            await conn.execute(
                f"INSERT INTO {self._outboxes} (outbox, partitions) VALUES ($1, $2)"
                " ON CONFLICT (outbox) DO UPDATE SET partitions = $2, updated_at = now()",
                outbox,
                count,
            )
        return Repartitioned(outbox, before, count, start, resent, moved)

    async def _resent(
        self,
        conn: asyncpg.Connection,
        *,
        old: list[Lane],
        positions: dict[str, int],
        start: int,
        columns: ColumnsConfig,
        table: str,
    ) -> int:
        """Events each old lane had published after `start`: they are sent again."""
        pos = quote(columns.position)
        total = 0
        for lane in old:
            upto = positions.get(lane.name, start)
            if upto <= start:
                continue
            only = f" AND {lane_of(columns, lane.count)} = {lane.index}" if lane.split else ""
            total += int(
                await conn.fetchval(
                    f"SELECT count(*) FROM {qualified(table)} WHERE {pos} > $1"
                    f" AND {pos} <= $2{only}",
                    start,
                    upto,
                )
            )
        return total

    async def _move_parked(
        self, conn: asyncpg.Connection, old: list[Lane], count: int, columns: ColumnsConfig
    ) -> int:
        """Parked messages follow their aggregate to its new lane."""
        names = [lane.name for lane in old]
        if count == 1:
            target = "$2"
        else:
            lane = lane_expression("aggregate_type", "aggregate_id", count)
            target = f"$2 || '/' || ({lane})::text"
        status = await conn.execute(
            f"UPDATE {self._parked} SET outbox = {target} WHERE outbox = ANY($1::text[])",
            names,
            old[0].outbox,
        )
        return int(status.split()[-1])
