"""Publishing a batch in order: the acknowledged prefix moves on, the rest is retried.

This is the relay's promise in code, with no database in it: a failed message is
retried, with backoff, before anything after it; nothing after an unacknowledged
message is checkpointed; only a message the broker rejects for good (or that
cannot be mapped) is parked, after `park_after` permanent failures, so that the
rest can flow; one the adapter refused before sending (UnsendableError), which no
retry can mend, is parked at its first failure. Progress goes through a
`CheckpointWriter` (the fenced checkpoint row in production, a list in memory in the
unit tests).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from relay.config import OutboxConfig
from relay.core.event import Event
from relay.core.lane_state import OutboxState
from relay.core.lanes import metric_labels
from relay.core.metrics import Metrics
from relay.core.publishing import Message, Publisher, one_outcome_each
from relay.core.retry import Backoff
from relay.core.tracing import traced
from relay.core.waiting import wait_any
from relay.errors import MappingError, PublishError, TransientPublishError


@dataclass(slots=True)  # not frozen: built once per event, and ten times cheaper so
class Item:
    """An event to publish: its message, or why it could not be mapped."""

    event: Event
    message: Message | None
    error: MappingError | None
    rule: str = ""  # which of the event type's rules made it ("" for the single-rule form)


@dataclass(frozen=True, slots=True)
class Parking:
    """A message set aside: what the parked table keeps, and where the checkpoint goes."""

    event: Event
    message: Message | None  # None when it could not be mapped
    rule: str
    reason: str
    error: str
    attempts: int
    upto: int  # its event; just before it while another of the event's messages is pending


@dataclass(frozen=True, slots=True)
class RetryCount:
    """How often the message at `position` has failed; kept across commands and holders."""

    position: int
    attempts: int
    rejections: int  # the permanent failures among them: parking counts these
    rule: str = ""  # which of the event's messages: each rule's message counts on its own


class CheckpointWriter(Protocol):
    """Where delivery records its progress, under the lease."""

    @property
    def position(self) -> int:
        """The checkpoint as last written."""

    async def advance(self, position: int) -> None:
        """Every event up to `position` is handled."""

    async def report(
        self, state: str, last_error: str | None = None, retry: RetryCount | None = None
    ) -> None:
        """The outbox's state and retry count, for `relay status` and the next holder."""

    async def park(self, parking: Parking) -> None:
        """Set the message aside and move the checkpoint to `parking.upto`, at once."""


class Delivery:
    """One outbox's publishing: order, retries, parking, and the metrics that show them."""

    def __init__(
        self,
        name: str,
        config: OutboxConfig,
        *,
        publisher: Publisher,
        metrics: Metrics,
        state: OutboxState,
        stop: asyncio.Event,
        interrupt: asyncio.Event,
        clock_offset: Callable[[], float] = lambda: 0.0,
        broker_type: str = "",
    ) -> None:
        self.name = name
        self.labels = metric_labels(name)
        self.config = config
        self.publisher = publisher
        self.metrics = metrics
        self.state = state
        self.stop = stop
        self.interrupt = interrupt  # an operator's command: stop retrying, come back later
        self.clock_offset = clock_offset  # database clock minus this host's
        # The publisher's own method, or it inside an OpenTelemetry span (the otel extra).
        self._send = traced(
            publisher.publish, outbox=name, broker=config.broker, broker_type=broker_type
        )
        self.retry: RetryCount | None = None  # the head message's failures so far
        self.log = structlog.get_logger("relay.delivery").bind(outbox=name)
        self._duplicates_seen = 0
        self._previous: list[Message] = []  # the last publish call's, for collisions
        metrics.unexpected_duplicates.labels(*self.labels)  # at 0, so that alerts see it
        # Destination templates, not rendered destinations, label the metric: bounded.
        self._published_to = {
            (event_type, rule.name): metrics.published.labels(*self.labels, rule.config.destination)
            for event_type, rules in config.rules(name).items()
            for rule in rules
        }

    async def deliver(
        self,
        checkpoint: CheckpointWriter,
        items: Sequence[Item],
    ) -> bool:
        """Publish `items` in order; False if stopped or interrupted by an operator's command.

        The head message's failures are counted per position in `retry`, which outlives
        this call: a command interrupts the retrying but does not start the count again,
        so `park_after` is reached whatever else happens.
        """
        backoff = Backoff(self.config.retry)
        pending = list(items)
        while pending:
            outcomes = await self._publish(_sendable(pending))
            acked = next((i for i, o in enumerate(outcomes) if o is not None), len(outcomes))
            if acked:
                done, pending = pending[:acked], pending[acked:]
                self._acknowledged(done)
                if pending and (upto := _handled(done, pending)) > checkpoint.position:
                    await checkpoint.advance(upto)
            if not pending:
                break
            failure = _failure(outcomes, acked, pending[0])
            count = self._failed(pending[0], failure)
            if failure.permanent and (
                failure.at_once or count.rejections >= self.config.park_after
            ):
                parked = pending.pop(0)
                upto = _handled([parked], pending) if pending else parked.event.position
                await self._park(checkpoint, parked, failure, count.rejections, upto)
                continue
            await self._retrying(checkpoint, pending[0], failure, count)
            pause = max(backoff.delay(count.attempts), failure.retry_after or 0.0)
            await wait_any(self.stop, self.interrupt, within=pause)
            if self.stop.is_set() or self.interrupt.is_set():
                return False  # nothing unacknowledged was checkpointed: it is read again
        return True

    def _check_duplicates(self, messages: list[Message], duplicates: Sequence[int]) -> None:
        """Warn about duplicates that are collisions: another event's message had the id.

        Only what proves it counts: a message of another event (position) with the same id
        in this publish call or the last. A duplicate of an id this relay did not send lately
        may be a re-send by anyone (a previous holder's batch in flight, a replay carried out
        by another holder or by the CLI), so it is not counted: no false alarm.
        """
        ids: dict[str, set[int]] = {}
        for message in (*self._previous, *messages):
            ids.setdefault(message.id, set()).add(message.position)
        unexpected = [m for m in map(messages.__getitem__, duplicates) if len(ids[m.id]) > 1]
        if unexpected:
            self.metrics.unexpected_duplicates.labels(*self.labels).inc(len(unexpected))
            self.log.warning(
                "the broker dropped messages as duplicates of another event's message with the"
                " same id; is the outbox's id unique per event?",
                count=len(unexpected),
                ids=[m.id for m in unexpected[:5]],
                positions=[m.position for m in unexpected[:5]],
            )

    def _failed(self, head: Item, failure: PublishError) -> RetryCount:
        """Count one more failure of the head message (a new message starts at zero)."""
        self.metrics.failures.labels(*self.labels, failure.reason).inc()
        position, rule = head.event.position, head.rule
        before = self.retry
        if before is None or before.position != position or before.rule != rule:
            before = RetryCount(position, 0, 0, rule)
        self.retry = RetryCount(
            position, before.attempts + 1, before.rejections + failure.permanent, rule
        )
        return self.retry

    async def _publish(self, messages: list[Message]) -> list[PublishError | None]:
        if not messages:
            return []
        started = time.monotonic()
        outcomes = one_outcome_each(self.publisher.name, await self._send(messages), len(messages))
        self.metrics.publish_duration.labels(*self.labels).observe(time.monotonic() - started)
        self.metrics.batch_messages.labels(*self.labels).observe(len(messages))
        if self.publisher.last_duplicates:
            self._check_duplicates(messages, self.publisher.last_duplicates)
        self._previous = messages
        return outcomes

    def _acknowledged(self, done: list[Item]) -> None:
        retry, attempts = self.retry, 0
        if retry is not None and any(
            i.event.position == retry.position and i.rule == retry.rule for i in done
        ):  # the failing message went through; a replay's prefix before it keeps the count
            attempts, self.retry = retry.attempts, None
        duplicates = self.publisher.duplicates - self._duplicates_seen
        self._duplicates_seen = self.publisher.duplicates
        self.state.published += len(done)
        self.metrics.retrying.labels(*self.labels).set(0)
        db_now = time.time() + self.clock_offset()
        for rule, count in Counter((item.event.type, item.rule) for item in done).items():
            self._published_to[rule].inc(count)
        self.metrics.end_to_end.labels(*self.labels).observe_many(_ages(done, db_now))
        self.log.debug(
            "batch acknowledged",
            first_position=done[0].event.position,
            last_position=done[-1].event.position,
            messages=len(done),
            duplicates=duplicates,
            attempt=attempts + 1,
        )

    async def _retrying(
        self, checkpoint: CheckpointWriter, head: Item, failure: PublishError, count: RetryCount
    ) -> None:
        self.state.retrying(count.attempts, str(failure))
        self.metrics.retrying.labels(*self.labels).set(1)
        self.log.warning(
            "publish failed, retrying",
            position=head.event.position,
            attempt=count.attempts,
            reason=failure.reason,
            error=str(failure),
        )
        await checkpoint.report("retrying", str(failure), count)

    async def _park(
        self,
        checkpoint: CheckpointWriter,
        item: Item,
        failure: PublishError,
        attempts: int,
        upto: int,
    ) -> None:
        e = item.event
        await checkpoint.park(
            Parking(e, item.message, item.rule, failure.reason, str(failure), attempts, upto)
        )
        self.retry = None
        self.state.parked += 1
        self.metrics.parked_total.labels(*self.labels, failure.reason).inc()
        self.metrics.parked.labels(*self.labels).inc()
        self.log.error(
            "message parked",
            position=e.position,
            aggregate=f"{e.aggregate_type}/{e.aggregate_id}@{e.version}",
            reason=failure.reason,
            error=str(failure),
            attempts=attempts,
            rule=item.rule or None,
        )


def _ages(done: list[Item], db_now: float) -> list[float]:
    """Seconds from each event's created_at to `db_now`, for the end-to-end latency.

    A naive time (a `timestamp` column) is taken as local time, which on the first or last
    day of datetime's range falls outside it (`year 0 is out of range`): such an event's
    age is left out, rather than end the relay after it was published.
    """
    try:
        return [
            max(db_now - item.event.created_at.timestamp(), 0.0)
            for item in done
            if item.event.created_at is not None
        ]
    except (OverflowError, ValueError):
        return [age for item in done if (age := _age(item.event, db_now)) is not None]


def _age(event: Event, db_now: float) -> float | None:
    if event.created_at is None:
        return None
    try:
        return max(db_now - event.created_at.timestamp(), 0.0)
    except (OverflowError, ValueError):
        return None


def _handled(done: list[Item], pending: list[Item]) -> int:
    """Where the checkpoint may move once `done` is: not past an event with messages pending.

    An event with several messages is handled only when the last of them is; until then the
    checkpoint stays just before it (a restart sends its acknowledged messages again).
    """
    last = done[-1].event.position
    return last - 1 if last == pending[0].event.position else last


def _sendable(pending: list[Item]) -> list[Message]:
    """The messages up to the first item that could not be mapped."""
    out = []
    for item in pending:
        if item.message is None:
            break
        out.append(item.message)
    return out


def _failure(outcomes: list[PublishError | None], index: int, head: Item) -> PublishError:
    """Why the head of the pending items failed: the broker's word, or the mapping's."""
    failure = outcomes[index] if index < len(outcomes) else head.error
    if failure is None:  # cannot happen: an item with neither a message nor an error
        return TransientPublishError(f"event at position {head.event.position}: nothing to send")
    return failure
