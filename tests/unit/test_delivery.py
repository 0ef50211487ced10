"""The delivery loop's pure logic, with a scripted publisher and a checkpoint kept in memory.

These run in milliseconds with no service at all. They pin down what the real-server
tests (the ground truth) also check end to end: the acknowledged prefix moves on, the
rest is retried before anything after it, only permanent failures are parked, after
`park_after` of them, and an operator's command interrupts the retrying without
resetting the count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from relay.config import OutboxConfig
from relay.core.delivery import Delivery, Item, Parking, RetryCount
from relay.core.event import Event
from relay.core.lane_state import OutboxState
from relay.core.metrics import Metrics
from relay.core.publishing import Message, Outcome, Publisher
from relay.errors import (
    MappingError,
    PermanentPublishError,
    PublishError,
    TransientPublishError,
    UnsendableError,
)

# Fails message `id` (or lets it through with None) on its n-th attempt (1-based).
Script = Callable[[str, int], PublishError | None]


@dataclass
class ScriptedPublisher:
    """A broker whose verdict on each message follows a script; it records what was sent."""

    script: Script
    name: str = "fake"
    duplicates: int = 0
    last_duplicates: tuple[int, ...] = ()
    batches: list[list[str]] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    short_by: int = 0  # return this many outcomes too few (an adapter's bug)

    async def connect(self) -> None:
        """Nothing to connect."""

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        self.batches.append([m.id for m in messages])
        outcomes: list[Outcome] = []
        for message in messages:
            n = self.attempts[message.id] = self.attempts.get(message.id, 0) + 1
            outcome = self.script(message.id, n)
            outcomes.append(outcome)
            if outcome is not None:  # as real adapters do: nothing after a failure is sent
                held = TransientPublishError("not sent: an earlier message of the batch failed")
                outcomes += [held] * (len(messages) - len(outcomes))
                break
        return outcomes[: len(outcomes) - self.short_by]

    async def close(self) -> None:
        """Nothing to close."""


@dataclass
class MemoryCheckpoint:
    """The checkpoint row and the parked table, in memory."""

    position: int = 0
    advances: list[int] = field(default_factory=list)
    reports: list[tuple[str, RetryCount | None]] = field(default_factory=list)
    parked: list[tuple[int, str, int]] = field(default_factory=list)  # position, reason, attempts
    parked_rules: list[str] = field(default_factory=list)

    async def advance(self, position: int) -> None:
        assert position >= self.position, "the checkpoint never moves back"
        self.position = position
        self.advances.append(position)

    async def report(
        self, state: str, last_error: str | None = None, retry: RetryCount | None = None
    ) -> None:
        self.reports.append((state, retry))

    async def park(self, parking: Parking) -> None:
        self.parked.append((parking.event.position, parking.reason, parking.attempts))
        self.parked_rules.append(parking.rule)
        await self.advance(parking.upto)


def event(position: int) -> Event:
    return Event(
        position=position,
        aggregate_type="book",
        aggregate_id=f"b{position}",
        version=1,
        type="BookLent",
        data={},
        metadata={},
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def item(position: int, rule: str = "") -> Item:
    e = event(position)
    message = Message(
        id=f"m{position}{rule}",
        type=f"library.book-lent.{rule or 'v1'}",
        destination="library.loans",
        key=e.aggregate_id,
        body=b"{}",
        source="/test",
        time=e.created_at,
        position=position,
    )
    return Item(e, message, None, rule)


def unmappable(position: int) -> Item:
    return Item(event(position), None, MappingError(f"cannot map event at position {position}"))


CONFIG = OutboxConfig.model_validate(
    {
        "broker": "fake",
        "messages": {"BookLent": {"type": "library.book-lent.v1", "destination": "library.loans"}},
        "retry": {"initial": "1ms", "max": "1ms", "jitter": 0},
        "park_after": 3,
    }
)
# BookLent as v1 and v2 side by side: two messages per event.
TWO_RULES = OutboxConfig.model_validate(
    {
        "broker": "fake",
        "messages": {
            "BookLent": [
                {"type": "library.book-lent.v1", "destination": "library.loans"},
                {"type": "library.book-lent.v2", "destination": "library.loans.v2"},
            ]
        },
        "retry": {"initial": "1ms", "max": "1ms", "jitter": 0},
        "park_after": 3,
    }
)


def delivery(
    publisher: Publisher, config: OutboxConfig = CONFIG, **events: asyncio.Event
) -> Delivery:
    return Delivery(
        "loans",
        config,
        publisher=publisher,
        metrics=Metrics(),
        state=OutboxState("loans"),
        stop=events.get("stop", asyncio.Event()),
        interrupt=events.get("interrupt", asyncio.Event()),
    )


def always_ok(_id: str, _n: int) -> None:
    return None


def fails(message_id: str, times: int, error: PublishError) -> Script:
    """`message_id` fails its first `times` attempts with `error`; everything else passes."""
    return lambda mid, n: error if mid == message_id and n <= times else None


TRANSIENT = TransientPublishError("broker down")
REJECTED = PermanentPublishError("too large")
# What an adapter refuses before sending (a header value nats-py would alter): never sendable.
UNSENDABLE = UnsendableError("broker 'fake': header Nats-Msg-Id holds a tab (\\x09)")


async def test_a_whole_batch_acknowledged_leaves_the_checkpoint_to_the_loop() -> None:
    publisher, checkpoint = ScriptedPublisher(always_ok), MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1), item(2), item(3)])
    assert publisher.batches == [["m1", "m2", "m3"]]
    assert checkpoint.advances == []  # the loop moves it past the whole batch


async def test_the_acknowledged_prefix_moves_on_and_the_rest_is_retried_first() -> None:
    publisher = ScriptedPublisher(fails("m3", 2, TRANSIENT))
    checkpoint = MemoryCheckpoint()
    items = [item(p) for p in range(1, 6)]
    assert await delivery(publisher).deliver(checkpoint, items)
    assert publisher.batches == [
        ["m1", "m2", "m3", "m4", "m5"],
        ["m3", "m4", "m5"],
        ["m3", "m4", "m5"],
    ]
    assert checkpoint.advances == [2]  # never past the unacknowledged m3
    assert [r[1].attempts for r in checkpoint.reports if r[1]] == [1, 2]
    assert checkpoint.parked == []


async def test_transient_failures_are_never_parked() -> None:
    publisher = ScriptedPublisher(fails("m1", 10, TRANSIENT))
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1), item(2)])
    assert publisher.attempts["m1"] == 11  # well past park_after (3)
    assert checkpoint.parked == []


async def test_a_permanent_failure_is_parked_after_park_after_and_the_rest_flows() -> None:
    publisher = ScriptedPublisher(fails("m2", 99, REJECTED))
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1), item(2), item(3)])
    assert checkpoint.parked == [(2, "rejected", 3)]
    assert publisher.attempts == {"m1": 1, "m2": 3, "m3": 1}
    assert publisher.batches[-1] == ["m3"]


async def test_a_refusal_no_retry_can_mend_is_parked_at_its_first_attempt() -> None:
    """An id with a tab held its lane for park_after attempts (about 51 s by default) before
    it was parked, though every attempt was refused before anything was sent."""
    publisher = ScriptedPublisher(fails("m2", 99, UNSENDABLE))
    checkpoint = MemoryCheckpoint()
    relay = delivery(publisher)  # park_after: 3
    assert await relay.deliver(checkpoint, [item(1), item(2), item(3)])
    assert checkpoint.parked == [(2, "rejected", 1)]
    assert publisher.attempts == {"m1": 1, "m2": 1, "m3": 1}
    assert [state for state, _ in checkpoint.reports] == []  # never reported as retrying
    sample = relay.metrics.registry.get_sample_value
    labels = {"outbox": "loans", "reason": "rejected"}
    assert sample("relay_publish_failures_total", labels) == 1
    assert sample("relay_messages_parked_total", labels) == 1
    assert relay.retry is None and relay.state.parked == 1


async def test_a_refusal_at_once_after_an_outage_parks_at_that_attempt() -> None:
    """Transient failures before it (the broker was down) do not hold it back further."""
    verdicts = [TRANSIENT, TRANSIENT, UNSENDABLE]  # and refused from then on
    publisher = ScriptedPublisher(lambda mid, n: verdicts[min(n, 3) - 1] if mid == "m1" else None)
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1), item(2)])
    assert publisher.attempts == {"m1": 3, "m2": 1}
    assert checkpoint.parked == [(1, "rejected", 1)]  # its one refusal; the outage is not one


async def test_park_after_counts_only_permanent_failures() -> None:
    """Two outages in between do not bring the parking forward."""
    verdicts = [REJECTED, TRANSIENT, REJECTED, TRANSIENT, REJECTED]
    publisher = ScriptedPublisher(lambda mid, n: verdicts[n - 1] if mid == "m1" else None)
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1)])
    assert publisher.attempts["m1"] == 5
    assert checkpoint.parked == [(1, "rejected", 3)]


async def test_an_event_that_cannot_be_mapped_is_parked_and_never_sent() -> None:
    publisher, checkpoint = ScriptedPublisher(always_ok), MemoryCheckpoint()
    assert await delivery(publisher).deliver(checkpoint, [item(1), unmappable(2), item(3)])
    assert checkpoint.parked == [(2, "mapping", 3)]
    assert all("m2" not in batch for batch in publisher.batches)
    assert publisher.attempts == {"m1": 1, "m3": 1}


async def test_an_operators_command_interrupts_the_retrying_but_keeps_the_count() -> None:
    interrupt = asyncio.Event()

    def script(mid: str, n: int) -> PublishError | None:
        if n == 2:
            interrupt.set()  # a command arrives during the second attempt
        return REJECTED if mid == "m1" else None

    publisher, checkpoint = ScriptedPublisher(script), MemoryCheckpoint()
    relay = delivery(publisher, interrupt=interrupt)
    assert not await relay.deliver(checkpoint, [item(1)])  # interrupted, nothing parked
    assert checkpoint.parked == [] and relay.retry == RetryCount(1, 2, 2)
    interrupt.clear()  # the loop carried the command out; it reads the batch again
    assert await relay.deliver(checkpoint, [item(1)])
    assert checkpoint.parked == [(1, "rejected", 3)]  # one more attempt, not three
    assert publisher.attempts["m1"] == 3


async def test_a_replay_back_before_the_failing_message_keeps_its_count() -> None:
    """A replay moves the checkpoint back before the message being retried: the events in
    between are acknowledged again, and the failing message's count goes on (found
    attacking: it went back to 1, so that replays could keep a poison message from ever
    parking)."""
    interrupt = asyncio.Event()

    def script(mid: str, n: int) -> PublishError | None:
        if mid == "m3" and n == 2:
            interrupt.set()  # the replay arrives during the second attempt
        return REJECTED if mid == "m3" else None

    publisher, checkpoint = ScriptedPublisher(script), MemoryCheckpoint(position=2)
    relay = delivery(publisher, interrupt=interrupt)
    assert not await relay.deliver(checkpoint, [item(3)])
    interrupt.clear()  # the replay moved the checkpoint back to 0: 1 and 2 go again
    checkpoint.position = 0
    assert await relay.deliver(checkpoint, [item(1), item(2), item(3)])
    assert checkpoint.parked == [(3, "rejected", 3)]  # one more attempt, not three
    assert publisher.attempts == {"m1": 1, "m2": 1, "m3": 3}


async def test_the_count_of_a_previous_holder_goes_on() -> None:
    publisher = ScriptedPublisher(fails("m7", 99, REJECTED))
    checkpoint = MemoryCheckpoint(position=6)
    relay = delivery(publisher)
    relay.retry = RetryCount(7, attempts=2, rejections=2)  # read from the checkpoint row
    assert await relay.deliver(checkpoint, [item(7)])
    assert publisher.attempts["m7"] == 1
    assert checkpoint.parked == [(7, "rejected", 3)]


async def test_a_count_for_another_message_does_not_carry_over() -> None:
    publisher = ScriptedPublisher(fails("m7", 99, REJECTED))
    relay = delivery(publisher)
    relay.retry = RetryCount(5, attempts=2, rejections=2)  # that message was parked since
    assert await relay.deliver(MemoryCheckpoint(), [item(7)])
    assert publisher.attempts["m7"] == 3


async def test_stop_ends_the_retrying_without_moving_the_checkpoint() -> None:
    stop = asyncio.Event()

    def script(mid: str, n: int) -> PublishError:
        stop.set()
        return TRANSIENT

    checkpoint = MemoryCheckpoint()
    assert not await delivery(ScriptedPublisher(script), stop=stop).deliver(checkpoint, [item(1)])
    assert checkpoint.advances == [] and checkpoint.parked == []


async def test_too_few_outcomes_from_an_adapter_count_as_a_transient_failure() -> None:
    stop = asyncio.Event()

    def script(mid: str, n: int) -> None:
        if mid == "m2" and n == 3:
            stop.set()  # enough: it would be retried for ever

    publisher = ScriptedPublisher(script, short_by=1)
    relay = delivery(publisher, stop=stop)
    checkpoint = MemoryCheckpoint()
    assert not await relay.deliver(checkpoint, [item(1), item(2)])
    assert checkpoint.advances == [1]  # m1 was confirmed; m2's missing outcome is a failure
    assert checkpoint.parked == []  # transient: never parked, however often
    assert "outcomes for 1 messages" in (relay.state.last_error or "")


@pytest.mark.parametrize("park_after", [1, 2, 5])
async def test_parking_takes_exactly_park_after_rejections(park_after: int) -> None:
    config = CONFIG.model_copy(update={"park_after": park_after})
    publisher = ScriptedPublisher(fails("m1", 99, REJECTED))
    relay = Delivery(
        "loans",
        config,
        publisher=publisher,
        metrics=Metrics(),
        state=OutboxState("loans"),
        stop=asyncio.Event(),
        interrupt=asyncio.Event(),
    )
    checkpoint = MemoryCheckpoint()
    assert await relay.deliver(checkpoint, [item(1)])
    assert publisher.attempts["m1"] == park_after
    assert checkpoint.parked == [(1, "rejected", park_after)]


def both(position: int) -> list[Item]:
    """The v1 and the v2 message of one event."""
    return [item(position, "library.book-lent.v1"), item(position, "library.book-lent.v2")]


async def test_an_event_half_sent_keeps_the_checkpoint_before_it() -> None:
    """v2 of event 2 fails: events 1 is done, 2 is not, whatever its v1 did."""
    v2 = "m2library.book-lent.v2"
    publisher = ScriptedPublisher(fails(v2, 1, TRANSIENT))
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher, TWO_RULES).deliver(checkpoint, [*both(1), *both(2)])
    assert checkpoint.advances == [1]  # not 2: its v2 was not acknowledged then
    assert publisher.batches[1] == [v2]  # its v1 is not sent again
    assert publisher.attempts["m2library.book-lent.v1"] == 1


async def test_a_rejected_rule_is_parked_alone_and_its_sibling_sent_once() -> None:
    v1, v2 = "m1library.book-lent.v1", "m1library.book-lent.v2"
    publisher = ScriptedPublisher(fails(v1, 99, REJECTED))
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher, TWO_RULES).deliver(checkpoint, [*both(1), *both(2)])
    assert checkpoint.parked == [(1, "rejected", 3)]
    assert checkpoint.parked_rules == ["library.book-lent.v1"]
    assert checkpoint.advances == [0]  # parked, but the event's v2 is still to go
    assert publisher.attempts[v2] == 1
    assert publisher.attempts["m2library.book-lent.v1"] == 1


async def test_each_rule_of_an_event_has_its_own_count() -> None:
    """Both messages of one event rejected: each is tried park_after times, not fewer."""
    publisher = ScriptedPublisher(lambda mid, n: REJECTED if mid.startswith("m1") else None)
    checkpoint = MemoryCheckpoint()
    assert await delivery(publisher, TWO_RULES).deliver(checkpoint, both(1))
    assert checkpoint.parked == [(1, "rejected", 3), (1, "rejected", 3)]
    assert checkpoint.parked_rules == ["library.book-lent.v1", "library.book-lent.v2"]
    assert checkpoint.position == 1


async def test_published_counts_each_rules_destination() -> None:
    publisher = ScriptedPublisher(always_ok)
    relay = delivery(publisher, TWO_RULES)
    assert await relay.deliver(MemoryCheckpoint(), [*both(1), *both(2)])
    sample = relay.metrics.registry.get_sample_value
    for destination in ("library.loans", "library.loans.v2"):
        labels = {"outbox": "loans", "destination": destination}
        assert sample("relay_messages_published_total", labels) == 2


@dataclass
class DedupBroker:
    """A broker with a deduplication store, as JetStream's: an id it has is a duplicate.

    `lose_ack_of`: the message is stored, but its acknowledgement never comes (once).
    """

    stored: set[str] = field(default_factory=set)
    lose_ack_of: set[str] = field(default_factory=set)
    name: str = "fake"
    duplicates: int = 0
    last_duplicates: list[int] = field(default_factory=list)

    async def connect(self) -> None:
        """Nothing to connect."""

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        self.last_duplicates = []
        outcomes: list[Outcome] = []
        for index, message in enumerate(messages):
            if message.id in self.stored:
                self.duplicates += 1
                self.last_duplicates.append(index)
            self.stored.add(message.id)
            if message.id in self.lose_ack_of:
                self.lose_ack_of.discard(message.id)
                held = TransientPublishError("no PubAck")
                return [*outcomes, *[held] * (len(messages) - index)]
            outcomes.append(None)
        return outcomes

    async def close(self) -> None:
        """Nothing to close."""


def same_id(position: int, message_id: str) -> Item:
    """An event whose message has `message_id`: an id template that is not unique per event."""
    found = item(position)
    assert found.message is not None
    found.message.id = message_id
    return found


SMALL_BATCHES = CONFIG.model_copy(
    update={"batch": CONFIG.batch.model_copy(update={"max_messages": 2})}
)


async def unexpected(broker: DedupBroker, batches: list[list[Item]], stored: set[str]) -> float:
    """Deliver `batches` with `stored` already in the broker (sent by someone else)."""
    broker.stored |= stored
    run = delivery(broker, SMALL_BATCHES)
    for batch in batches:
        assert await run.deliver(MemoryCheckpoint(), batch)
    value = run.metrics.registry.get_sample_value(
        "relay_unexpected_duplicates_total", {"outbox": "loans"}
    )
    return value or 0.0


async def test_a_re_send_after_a_lost_ack_is_an_expected_duplicate() -> None:
    broker = DedupBroker(lose_ack_of={"m2"})
    assert await unexpected(broker, [[item(1), item(2), item(3)]], set()) == 0
    assert broker.duplicates == 1  # m2, sent again


async def test_the_previous_holders_batch_in_flight_is_an_expected_duplicate() -> None:
    broker = DedupBroker()
    assert await unexpected(broker, [[item(1), item(2)]], {"m1", "m2"}) == 0


async def test_a_replay_sent_before_by_another_holder_is_not_counted() -> None:
    """Found attacking: a takeover during a replay, or a replay the CLI carried out, made
    the next holder re-send what was already stored; 693 false alarms on one partition."""
    broker = DedupBroker()
    batches = [[item(1), item(2)], [item(3), item(4)], [item(5), item(6)]]
    assert await unexpected(broker, batches, {f"m{p}" for p in range(1, 7)}) == 0
    assert broker.duplicates == 6


async def test_another_events_id_in_the_last_batch_is_counted() -> None:
    broker = DedupBroker()
    batches = [[item(1)], [same_id(2, "m1")], [item(3)]]
    assert await unexpected(broker, batches, set()) == 1


async def test_two_events_with_one_id_in_a_batch_are_counted_even_right_after_a_claim() -> None:
    broker = DedupBroker()
    assert await unexpected(broker, [[same_id(1, "x"), same_id(2, "x")]], set()) == 1


async def test_a_retry_after_asked_by_the_broker_lengthens_the_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An HTTP receiver's Retry-After: the backoff waits at least that long, never less."""
    pauses: list[float] = []

    async def recorded(*_: asyncio.Event, within: float) -> None:
        pauses.append(within)

    monkeypatch.setattr("relay.core.delivery.wait_any", recorded)
    busy = TransientPublishError("429 Too Many Requests")
    busy.retry_after = 7.0
    publisher = ScriptedPublisher(lambda mid, n: busy if n == 1 else TRANSIENT if n == 2 else None)
    assert await delivery(publisher).deliver(MemoryCheckpoint(), [item(1)])
    assert pauses == [7.0, 0.001]  # the asked pause, then the backoff's own (1ms)
