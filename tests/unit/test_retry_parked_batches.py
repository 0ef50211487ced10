"""retry-parked's batches: one outcome per message, in as few round trips as order allows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from relay.brokers._batch import not_sent
from relay.core.publishing import Message, Outcome
from relay.errors import PermanentPublishError, TransientPublishError
from relay.runtime.commands import publish_each


def message(n: int) -> Message:
    return Message(str(n), "t", "d", f"k{n}", b"{}", "/s", None, n)


@dataclass
class Broker:
    """Sends in order and holds back what follows a refused message, as the adapters do."""

    refuse: set[int] = field(default_factory=set)
    down: bool = False
    name: str = "fake"
    duplicates: int = 0
    last_duplicates: tuple[int, ...] = ()
    batches: list[list[int]] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        self.batches.append([m.position for m in messages])
        if self.down:
            return [TransientPublishError("connection refused")] * len(messages)
        for i, m in enumerate(messages):
            if m.position in self.refuse:
                refused = PermanentPublishError(f"refused {m.position}")
                return [None] * i + [refused, *not_sent(len(messages) - i - 1)]
            self.received.append(m.position)
        return [None] * len(messages)


async def test_a_refused_message_fails_alone_and_the_rest_follow_in_order() -> None:
    broker = Broker(refuse={2, 4})
    outcomes = await publish_each(broker, [message(n) for n in range(1, 6)])
    assert [str(o) if o else None for o in outcomes] == [None, "refused 2", None, "refused 4", None]
    assert broker.batches == [[1, 2, 3, 4, 5], [3, 4, 5], [5]]
    assert broker.received == [1, 3, 5]


async def test_a_broker_that_is_down_costs_one_round_trip() -> None:
    broker = Broker(down=True)
    outcomes = await publish_each(broker, [message(n) for n in range(1, 4)])
    assert [str(o) for o in outcomes] == ["connection refused"] * 3
    assert broker.batches == [[1, 2, 3]]


async def test_all_acknowledged_in_one_batch() -> None:
    broker = Broker()
    assert await publish_each(broker, [message(n) for n in range(1, 4)]) == [None] * 3
    assert broker.batches == [[1, 2, 3]]
    assert await publish_each(broker, []) == []
