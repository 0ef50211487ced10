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

from relay.core.event import Event
from relay.core.lanes import Lane, lanes_of
from relay.core.publishing import Message, Outcome, Publisher, one_outcome_each
from relay.errors import PublishError, RelayError
from relay.mapping.mapper import CompiledRule, Mapper
from relay.postgres.claimed import ClaimedOutbox
from relay.postgres.command_queue import (
    Arguments,
    CommandKind,
    CommandQueue,
    ReplayArgs,
    RetryParkedArgs,
    arguments,
)
from relay.postgres.source import EventSource
from relay.postgres.store import ParkedMessage, Store

log = structlog.get_logger("relay.operations")


@dataclass(frozen=True, slots=True)
class Done:
    """How a command went; `moved_to` is the checkpoint after a replay (None otherwise)."""

    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)
    moved_to: int | None = None


Handler = Callable[[ClaimedOutbox, asyncpg.Connection, Any], Awaitable[Done]]


def replay_forwards(position: int, checkpoint: int) -> str:
    """Why a replay from `position` is refused: it would move the checkpoint forwards."""
    return (
        f"replay only moves back: position {position} is after the checkpoint ({checkpoint});"
        " those events have not been published yet"
    )


async def fail_stuck(
    queue: CommandQueue,
    claimed: ClaimedOutbox,
    reader: asyncpg.Connection,
    lane: Lane,
    *,
    namespace: str,
    by: str,
) -> None:
    """Fail, each with why, the commands of the claimed lane's outbox that no holder will
    ever carry out or finish: one for a lane the outbox does not have (its bare name when
    split, `loans/9` of three), one left running by a holder that is gone. Else they stay
    `pending` or `running` for ever, and the operator who asked is never told. The lanes
    are `lane`'s count: a claim holds one of them, so the count cannot change meanwhile."""
    lanes = [other.name for other in lanes_of(lane.outbox, lane.count)]
    found = await queue.unsettled(reader, namespace, outbox=lane.outbox, failed_within=0.0)
    stuck = [(c, why) for c in found if (why := c.stuck(lane.outbox, lanes)) is not None]
    if not stuck:
        return
    async with claimed.writer.statement() as conn:
        failed = await queue.fail_stuck(conn, claimed.claim, stuck, by)
    for command_id, why in failed:
        log.warning("command failed", outbox=lane.name, command=command_id, error=why)


class CommandRunner:
    """Carries out operators' commands for one outbox."""

    def __init__(
        self,
        store: Store,
        source: EventSource,
        mapper: Mapper,
        publisher: Publisher | None,
        batch_size: int = 500,
    ) -> None:
        self.store = store
        self.batch_size = batch_size  # retry-parked publishes this many messages at once
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
        args: object,
        claimed: ClaimedOutbox,
        reader: asyncpg.Connection,
    ) -> Done:
        """Run one command under the lease; a RelayError (bad args, say) is a failed command,
        not a crash."""
        try:
            checked: Arguments = arguments(kind, args)
            return await self._handlers[kind](claimed, reader, checked)
        except RelayError as exc:
            return Done(ok=False, detail={"error": str(exc)})

    async def _replay(
        self, claimed: ClaimedOutbox, _reader: asyncpg.Connection, args: ReplayArgs
    ) -> Done:
        """Move the checkpoint back to `to`; events after it are published again.

        A lane already before `to` is left as it is, and says so: on a split outbox, a lane
        not that far yet; on an outbox of one lane, a replay forwards, refused as the CLI
        refuses one it sees (another command moved the checkpoint back since it asked)."""
        to = args.to
        if claimed.position < to:
            here = claimed.position
            unchanged = {"checkpoint": here, "previous_checkpoint": here}
            lane = self.source.lane
            if lane is None or not lane.split:
                error = replay_forwards(to + 1, here)
                return Done(ok=False, detail={**unchanged, "error": error})
            why = f"the checkpoint ({here}) is before position {to + 1}: nothing to publish again"
            return Done(ok=True, detail={**unchanged, "unchanged": why})
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
        self, claimed: ClaimedOutbox, reader: asyncpg.Connection, args: RetryParkedArgs
    ) -> Done:
        """Map each parked event again with the current config and publish them, in order.

        The messages go out in batches through the publisher's batched path, in position
        order (so each aggregate's in order); each parked message gets its own outcome.
        The lease connection is taken per write, never across a publish, so that the
        lease check is not held up by a slow broker.
        """
        ids = args.ids
        outbox = claimed.claim.outbox
        parked = await self.store.parked(reader, outbox, ids)
        unknown = sorted(set(ids or []) - {p.id for p in parked})
        events = {
            e.position: e for e in await self.source.events_at(reader, [p.position for p in parked])
        }
        outcomes: list[dict[str, Any]] = []
        for start in range(0, len(parked), self.batch_size):
            chunk = parked[start : start + self.batch_size]
            errors = await self._retry_batch([(p, events.get(p.position)) for p in chunk])
            await claimed.unpark([p.id for p in chunk if p.id not in errors])
            await claimed.still_parked({i: (str(e), e.reason) for i, e in errors.items()})
            outcomes += [_outcome(message, errors.get(message.id)) for message in chunk]
        published = [o["id"] for o in outcomes if o["outcome"] == "published"]
        failed = {o["id"]: o["error"] for o in outcomes if o["outcome"] == "still parked"}
        log.info("retry-parked", outbox=outbox, published=len(published), still_parked=len(failed))
        detail: dict[str, Any] = {
            "retried": len(parked),
            "published": published,
            "still_parked": failed,
            "outcomes": outcomes,
        }
        if unknown:
            detail["not_found"] = unknown
        return Done(ok=True, detail=detail)

    async def _retry_batch(
        self, batch: list[tuple[ParkedMessage, Event | None]]
    ) -> dict[int, PublishError]:
        """Publish a batch of parked messages at once; why each one that failed did."""
        errors: dict[int, PublishError] = {}
        sendable: list[tuple[int, Message]] = []
        for parked, event in batch:
            mapped = self._mapped(parked, event)
            if isinstance(mapped, PublishError):
                errors[parked.id] = mapped
            else:
                sendable += [(parked.id, message) for message in mapped]
        if sendable and self.publisher is None:
            raise RelayError("retry-parked needs the outbox's broker")  # a caller's bug
        if self.publisher is not None:
            outcomes = await publish_each(self.publisher, [m for _, m in sendable])
            for (id_, _), outcome in zip(sendable, outcomes, strict=True):
                if outcome is not None:
                    errors.setdefault(id_, outcome)
            log.debug("retry-parked: batch sent", messages=len(sendable), failed=len(errors))
        return errors

    def _mapped(self, parked: ParkedMessage, event: Event | None) -> list[Message] | PublishError:
        """The messages to send again for a parked one, or why there are none.

        Only the parked rule's message: its siblings of the same event went out already.
        """
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
        return sendable


async def publish_each(publisher: Publisher, messages: list[Message]) -> list[Outcome]:
    """One final outcome per message, sent in order through the batched path.

    A publisher holds back what follows a failure ("not sent"); those are sent again in
    the next round, after it. Each round settles at least the first failure, and every
    message that failed with that same error (a connection that could not be opened),
    so a broker that is down costs one round, not one per message.
    """
    final: list[Outcome] = [None] * len(messages)
    pending = list(range(len(messages)))
    while pending:
        sent = await publisher.publish([messages[i] for i in pending])
        got = one_outcome_each(publisher.name, sent, len(pending))
        first = next((o for o in got if o is not None), None)
        if first is None:
            break
        again = []
        for index, outcome in zip(pending, got, strict=True):
            if outcome is first:
                final[index] = outcome
            elif outcome is not None:
                again.append(index)
        pending = again
    return final


def _outcome(parked: ParkedMessage, error: PublishError | None) -> dict[str, Any]:
    """One parked message's outcome, as the CLI reports it."""
    return {
        "id": parked.id,
        "position": parked.position,
        "event": parked.event,
        "event_type": parked.event_type,
        "rule": parked.rule,
        "outcome": "published" if error is None else "still parked",
        "error": None if error is None else str(error),
    }


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
