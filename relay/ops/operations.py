"""What replay and retry-parked do, given the outbox's lease (by the holder or by the CLI).

One dispatch table from command kind to handler, used by the holder's loop and by
the CLI when it carries a command out itself, so that both do exactly the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from relay.core.mapping import CompiledRule, Event, Mapper
from relay.core.publishing import Publisher
from relay.errors import PublishError, RelayError
from relay.postgres.claimed import ClaimedOutbox
from relay.postgres.command_queue import CommandKind
from relay.postgres.source import EventSource
from relay.postgres.store import ParkedMessage, Store

log = structlog.get_logger("relay.operations")


@dataclass(frozen=True, slots=True)
class Done:
    """How a command went; `moved_to` is the checkpoint after a replay (None otherwise)."""

    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)
    moved_to: int | None = None


Handler = Callable[[ClaimedOutbox, asyncpg.Connection, dict[str, Any]], Awaitable[Done]]


class Operations:
    """Carries out operators' commands for one outbox."""

    def __init__(
        self, store: Store, source: EventSource, mapper: Mapper, publisher: Publisher | None
    ) -> None:
        self.store = store
        self.source = source
        self.mapper = mapper
        self.publisher = publisher
        self._handlers: dict[CommandKind, Handler] = {
            CommandKind.REPLAY: self._replay,
            CommandKind.RETRY_PARKED: self._retry_parked,
        }

    async def carry_out(
        self,
        kind: CommandKind,
        args: dict[str, Any],
        claimed: ClaimedOutbox,
        reader: asyncpg.Connection,
    ) -> Done:
        """Run one command under the lease; a RelayError is a failed command, not a crash."""
        try:
            return await self._handlers[kind](claimed, reader, args)
        except RelayError as exc:
            return Done(ok=False, detail={"error": str(exc)})

    async def _replay(
        self, claimed: ClaimedOutbox, _reader: asyncpg.Connection, args: dict[str, Any]
    ) -> Done:
        """Move the checkpoint back to `to`; events after it are published again."""
        to = int(args["to"])
        if claimed.position < to:  # a lane of a split outbox that is not that far yet
            here = claimed.position
            return Done(ok=True, detail={"checkpoint": here, "previous_checkpoint": here})
        previous = await claimed.rewind(to)
        log.info(
            "replay: checkpoint moved back",
            outbox=claimed.claim.outbox,
            position=to,
            previous=previous,
        )
        return Done(
            ok=True, detail={"checkpoint": to, "previous_checkpoint": previous}, moved_to=to
        )

    async def _retry_parked(
        self, claimed: ClaimedOutbox, reader: asyncpg.Connection, args: dict[str, Any]
    ) -> Done:
        """Map each parked event again with the current config and publish it, in order.

        The lease connection is taken per write, never across a publish, so that the
        lease check is not held up by a slow broker.
        """
        ids: list[int] | None = args.get("ids")
        outbox = claimed.claim.outbox
        parked = await self.store.parked(reader, outbox, ids)
        unknown = sorted(set(ids or []) - {p.id for p in parked})
        events = {
            e.position: e for e in await self.source.events_at(reader, [p.position for p in parked])
        }
        published: list[int] = []
        failed: dict[int, str] = {}
        for message in parked:
            error = await self._retry_one(message, events.get(message.position))
            if error is None:
                await claimed.unpark(message.id)
                published.append(message.id)
            else:
                await claimed.still_parked(message.id, str(error), error.reason)
                failed[message.id] = str(error)
        log.info("retry-parked", outbox=outbox, published=len(published), still_parked=len(failed))
        detail: dict[str, Any] = {
            "retried": len(parked),
            "published": published,
            "still_parked": failed,
        }
        if unknown:
            detail["not_found"] = unknown
        return Done(ok=True, detail=detail)

    async def _retry_one(self, parked: ParkedMessage, event: Event | None) -> PublishError | None:
        """Publish again the parked rule's message only: its siblings went out already."""
        if event is None:
            return PublishError(f"event at position {parked.position} is no longer in the table")
        rules = _parked_rules(self.mapper.rules_for(event), parked)
        if not rules:
            return PublishError(
                "the current config no longer maps this event"
                + (f" with rule {parked.rule!r}" if parked.rule else "")
            )
        try:
            messages = [self.mapper.message(event, rule) for rule in rules]
        except PublishError as exc:
            return exc
        sendable = [m for m in messages if m is not None]
        if not sendable:
            return PublishError("the rule's `when` now rejects this event: nothing to publish")
        if self.publisher is None:
            raise RelayError("retry-parked needs the outbox's broker")  # a caller's bug
        outcomes = await self.publisher.publish(sendable)
        return next((o for o in outcomes if o is not None), None)


def _parked_rules(rules: tuple[CompiledRule, ...], parked: ParkedMessage) -> list[CompiledRule]:
    """The current rules that made the parked message.

    By name; a message parked under the single-rule form (name "") is its event type's
    only message, so every current rule makes it now; a rule renamed since (another rule
    of the same type was added) is found by its type when that is unambiguous.
    """
    if not parked.rule:
        return list(rules)
    named = [rule for rule in rules if rule.name == parked.rule]
    if named:
        return named
    type_ = parked.message_type or parked.rule.split(" ")[0]
    typed = [rule for rule in rules if rule.type == type_]
    return typed if len(typed) == 1 else []
