"""What replay and retry-parked do, given the outbox's lease (by the holder or by the CLI)."""

from __future__ import annotations

from typing import Any

import asyncpg
import structlog

from relay.core.mapping import Mapper
from relay.core.publishing import Message, Publisher
from relay.errors import PublishError, RelayError
from relay.postgres.source import EventSource
from relay.postgres.store import Claim, Store, Writer

log = structlog.get_logger("relay.operations")


class Operations:
    """What replay and retry-parked do, given the lease (by the holder or by the CLI)."""

    def __init__(
        self, store: Store, source: EventSource, mapper: Mapper, publisher: Publisher | None
    ) -> None:
        self.store = store
        self.source = source
        self.mapper = mapper
        self.publisher = publisher

    async def replay(self, writer: Writer, claim: Claim, to: int) -> dict[str, Any]:
        """Move the checkpoint back to `to`; events after it are published again."""
        async with writer.statement() as conn:
            previous = await self.store.rewind(conn, claim, to)
        log.info(
            "replay: checkpoint moved back", outbox=claim.outbox, position=to, previous=previous
        )
        return {"checkpoint": to, "previous_checkpoint": previous}

    async def retry_parked(
        self,
        writer: Writer,
        reader: asyncpg.Connection,
        claim: Claim,
        ids: list[int] | None,
    ) -> dict[str, Any]:
        """Map each parked event again with the current config and publish it, in order.

        The lease connection is taken per write, never across a publish, so that the
        lease check is not held up by a slow broker.
        """
        parked = await self.store.parked(reader, claim.outbox, ids)
        unknown = sorted(set(ids or []) - {row["id"] for row in parked})
        events = {
            e.position: e
            for e in await self.source.events_at(reader, [p["position"] for p in parked])
        }
        published: list[int] = []
        failed: dict[int, str] = {}
        for row in parked:
            error = await self._retry_one(row, events.get(row["position"]))
            async with writer.statement() as conn:
                if error is None:
                    await self.store.unpark(conn, claim, row["id"])
                    published.append(row["id"])
                else:
                    await self.store.still_parked(conn, claim, row["id"], str(error), error.reason)
                    failed[row["id"]] = str(error)
        log.info(
            "retry-parked", outbox=claim.outbox, published=len(published), still_parked=len(failed)
        )
        outcome: dict[str, Any] = {
            "retried": len(parked),
            "published": published,
            "still_parked": failed,
        }
        if unknown:
            outcome["not_found"] = unknown
        return outcome

    async def _retry_one(self, row: dict[str, Any], event: Any) -> PublishError | None:
        if event is None:
            return PublishError(f"event at position {row['position']} is no longer in the table")
        try:
            message: Message | None = self.mapper.map(event)
        except PublishError as exc:
            return exc
        if message is None:
            return PublishError("the current config no longer maps this event")
        if self.publisher is None:
            raise RelayError("retry-parked needs the outbox's broker")  # a caller's bug
        (outcome,) = await self.publisher.publish([message])
        return outcome
