"""What every publisher does, written once: a broker's file subclasses `PublisherTestcase`
with a small `PublisherKit`, as faststream's tests do (tests/brokers/base/publish.py).

A kit wraps the broker's contract harness (tests/contract/brokers/): a real server reached
through a TCP proxy, a destination it prepares, and a reader of what was published. The kit
adds what a publisher-level test needs to know of the broker: its publisher options, how it
carries the CloudEvents attributes, what it refuses for good, an address where nothing
answers. A broker that lacks a behaviour (JetStream drops re-sent ids, Kafka makes a topic on
first use) leaves out that mixin. What only one broker does stays in its own file.

A new adapter needs a harness in tests/contract/brokers/ (the contract suite runs it too), a
kit in its own file here, and `class TestXPublisher(PublisherTestcase): Kit = XKit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar, cast

import pytest
from pydantic import TypeAdapter

from relay.brokers import Probing, create_publisher, create_reader
from relay.config.brokers import BrokerConfig
from relay.core.publishing import Message, Outcome, Publisher
from relay.core.readback import Reader, Stored
from relay.errors import PermanentPublishError, TransientPublishError
from tests.contract.harness import BrokerHarness, Consumed
from tests.support.proxy import TcpProxy
from tests.support.scenario import eventually

TYPE = "library.book-lent.v1"
SOURCE = "/outbox-relay/loans"
TIME = datetime(2026, 11, 29, 8, 30, 15, 250000, tzinfo=UTC)  # a fraction: RabbitMQ cuts it


def message(
    destination: str, key: str, version: int = 1, body: bytes | None = None, **changes: Any
) -> Message:
    """`book/<key>@<version>`, a book lent; its body names both unless one is given."""
    sent = Message(
        id=f"book/{key}@{version}",
        type=TYPE,
        destination=destination,
        key=key,
        body=body if body is not None else json.dumps({"book": key, "v": version}).encode(),
        source=SOURCE,
        time=TIME,
        position=version,
    )
    return replace(sent, **changes) if changes else sent


def interleaved(destination: str, keys: Iterable[str], versions: int) -> list[Message]:
    """`message` for each key, version after version: k1@1 k2@1 ... k1@2 k2@2 ..."""
    return [message(destination, k, v) for v in range(1, versions + 1) for k in keys]


class ProxiedHarness(BrokerHarness, Protocol):
    proxy: TcpProxy  # between the publisher and the server: every harness has one


H = TypeVar("H", bound=ProxiedHarness)


class PublisherKit(ABC, Generic[H]):
    """One broker as the shared tests see it. The class attributes say what differs."""

    name: ClassVar[str]  # the broker's name in the config: its errors begin `broker '<name>': `
    options: ClassVar[Mapping[str, Any]] = {}  # publisher options over the harness's own
    batches: ClassVar[tuple[int, ...]] = (300,)  # the sizes the ordering test sends
    total_order: ClassVar[bool] = True  # a consumer reads the sent order, not per key only
    oversized: ClassVar[int]  # a body size in bytes that is refused for good
    oversize_keys: ClassVar[tuple[str, str, str]] = ("b1", "b2", "b3")  # the third held back
    oversize_says: ClassVar[str]
    invalid_destination: ClassVar[str]  # a destination the broker can never have
    invalid_destination_says: ClassVar[str]
    connect_reaches_the_broker: ClassVar[bool] = True  # else an outage shows at publish only
    time_attribute: ClassVar[str]  # where the CloudEvents `time` goes
    timed_attributes: ClassVar[Mapping[str, str]]  # all `carried` holds for `message("b1", 1)`
    missing_destination_says: ClassVar[str] = ""  # MissingDestinationTestcase
    duplicate_window: ClassVar[float | None] = None  # ReadBackTestcase: the destination's
    stored_times: ClassVar[bool] = True  # ReadBackTestcase: a read says when each was stored
    seek_resolution: ClassVar[float] = 0.001  # ReadBackTestcase: a read from a time is exact
    # to this many seconds (RabbitMQ finds a stream's offset for a time by the whole second)
    counts_duplicates: ClassVar[bool] = False  # DeduplicationTestcase: `duplicates` tells

    def __init__(self, harness: H, request: pytest.FixtureRequest) -> None:
        self.harness = harness
        self.request = request  # for a server only some tests need
        self.destination = harness.destination()

    @staticmethod
    @abstractmethod
    async def start(request: pytest.FixtureRequest) -> H:
        """The broker's harness, from the fixtures it needs; its destination not created."""

    @classmethod
    @contextlib.asynccontextmanager
    async def opened(
        cls, request: pytest.FixtureRequest, harness: H | None = None, *, prepared: bool = False
    ) -> AsyncIterator[Self]:
        """A kit (on `harness`, else on `start`'s), closed and its destination deleted after."""
        kit = cls(harness or await cls.start(request), request)
        try:
            if prepared:
                await kit.harness.prepare()
            yield kit
        finally:
            await kit.harness.close()

    def publisher(self, **options: Any) -> Publisher:
        return create_publisher(self.name, self.broker_config(**options))

    def broker_config(self, **options: Any) -> Any:
        raw = {**self.harness.broker_config(), **self.options, **options}
        return TypeAdapter(BrokerConfig).validate_python(raw)

    @contextlib.asynccontextmanager
    async def reading(self, **options: Any) -> AsyncIterator[Reader]:
        """The broker's audit reader (ReadBackTestcase), connected, closed after."""
        reader = create_reader(self.name, self.broker_config(**options))
        try:
            await reader.connect()
            yield reader
        finally:
            await reader.close()

    @contextlib.asynccontextmanager
    async def publishing(self, **options: Any) -> AsyncIterator[Publisher]:
        publisher = self.publisher(**options)
        try:
            yield publisher
        finally:
            await publisher.close()

    def message(
        self, key: str, version: int = 1, body: bytes | None = None, **changes: Any
    ) -> Message:
        return message(self.destination, key, version, body, **changes)

    async def consume(self, expected: int) -> list[Consumed]:
        return await self.harness.consume(expected)

    @contextlib.asynccontextmanager
    async def oversize_kit(self) -> AsyncIterator[PublisherKit[Any]]:
        """Where `oversized` is refused: this server, unless another one has the limit."""
        yield self

    @abstractmethod
    def unreachable(self) -> dict[str, Any]:
        """Publisher options that point it where nothing listens."""

    @abstractmethod
    def unreachable_says(self) -> tuple[str, ...]:
        """How the error begins, then what else it holds."""

    @abstractmethod
    def carried(self, consumed: Consumed) -> dict[str, str]:
        """The headers (attributes) the message arrived with, as the broker names them."""

    @abstractmethod
    def content_type(self, consumed: Consumed) -> str:
        """The data's content type, from wherever the broker's binding puts it."""

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        """What else the broker's own metadata holds of `sent` (key, properties, ids)."""


def lending(kit: PublisherKit[Any], sizes: Sequence[int]) -> list[list[Message]]:
    """Batches of `sizes`: twenty versions of one book, then three books interleaved (where
    order holds per key, a run of one key and keys taking turns are both checked)."""
    total = sum(sizes)
    rest = max(total - 20, 0)
    run = [kit.message("b1", v) for v in range(1, 21)]
    turns = [kit.message(k, v) for v in range(1, rest // 3 + 2) for k in "xyz"][:rest]
    messages = (run + turns)[:total]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [messages[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def parked_at_once_as_foretold(pub: Publisher, sent: Message, outcome: Outcome) -> None:
    """A refusal `refusal()` names (known before sending: no retry can mend it) is parked at
    once, in the same words; one only the broker's answer gives is retried `park_after`
    times. Asked after the publish: some adapters know a limit only once connected."""
    assert isinstance(outcome, PermanentPublishError)
    foretold = cast(Probing, pub).refusal(sent)
    assert outcome.at_once == (foretold is not None), (str(outcome), foretold)
    if foretold is not None:
        assert str(outcome) == foretold


def per_key(ids_and_keys: Sequence[tuple[str, str | None]]) -> dict[str | None, list[str]]:
    keys: dict[str | None, list[str]] = defaultdict(list)
    for message_id, key in ids_and_keys:
        keys[key].append(message_id)
    return dict(keys)


class PublisherTestcase:
    """The behaviours every adapter shares. A broker's `Test…` subclass names its `Kit`."""

    Kit: ClassVar[type[PublisherKit[Any]]]

    @pytest.fixture
    async def unprepared(self, request: pytest.FixtureRequest) -> AsyncIterator[PublisherKit[Any]]:
        """The kit, its destination not created yet (MissingDestinationTestcase)."""
        async with self.Kit.opened(request) as kit:
            yield kit

    @pytest.fixture
    async def kit(self, unprepared: PublisherKit[Any]) -> PublisherKit[Any]:
        await unprepared.harness.prepare()
        return unprepared

    async def test_batches_are_acknowledged_one_outcome_each_and_arrive_in_order(
        self, kit: PublisherKit[Any]
    ) -> None:
        batches = lending(kit, kit.batches)
        async with kit.publishing() as pub:
            for batch in batches:
                assert await pub.publish(batch) == [None] * len(batch)
        sent = [m for batch in batches for m in batch]
        consumed = await kit.consume(expected=len(sent))
        if kit.total_order:
            assert [c.id for c in consumed] == [m.id for m in sent]
        else:  # each key's messages in order: its partition, its FIFO group
            assert per_key([(c.id, c.key) for c in consumed]) == per_key(
                [(m.id, m.key) for m in sent]
            )

    async def test_cloudevents_attributes_and_body_arrive_with_the_message(
        self, kit: PublisherKit[Any]
    ) -> None:
        timed = kit.message("b1", 1)
        untimed = kit.message("b1", 2, time=None, content_type="application/vnd.library+json")
        async with kit.publishing() as pub:
            assert await pub.publish([timed, untimed]) == [None, None]
        first, second = await kit.consume(expected=2)
        assert [first.id, second.id] == [timed.id, untimed.id]
        assert first.body == timed.body
        assert kit.carried(first) == kit.timed_attributes
        assert kit.content_type(first) == "application/json"
        assert kit.time_attribute not in kit.carried(second)
        assert kit.content_type(second) == "application/vnd.library+json"
        kit.check_native(first, timed)

    async def test_an_oversized_message_is_permanent_and_nothing_after_it_is_sent(
        self, kit: PublisherKit[Any]
    ) -> None:
        async with kit.oversize_kit() as big, big.publishing() as pub:
            batch = [big.message(key, n) for n, key in enumerate(big.oversize_keys, 1)]
            batch[1] = replace(batch[1], body=b"x" * big.oversized)
            outcomes = await pub.publish(batch)
            assert outcomes[0] is None
            assert isinstance(outcomes[1], PermanentPublishError)
            assert big.oversize_says in str(outcomes[1])
            parked_at_once_as_foretold(pub, batch[1], outcomes[1])
            assert isinstance(outcomes[2], TransientPublishError)  # never sent ahead of it
            assert [c.id for c in await big.consume(expected=1)] == [batch[0].id]
            # What the relay does next: the head again (still refused), then the rest; the
            # publisher survives a rejection.
            assert isinstance((await pub.publish(batch[1:]))[0], PermanentPublishError)
            assert await pub.publish(batch[2:]) == [None]
            assert [c.id for c in await big.consume(expected=2)] == [batch[0].id, batch[2].id]

    async def test_a_destination_the_broker_cannot_have_is_permanent(
        self, kit: PublisherKit[Any]
    ) -> None:
        sent = message(kit.invalid_destination, "b1")
        async with kit.publishing() as pub:
            (outcome,) = await pub.publish([sent])
            parked_at_once_as_foretold(pub, sent, outcome)
        assert kit.invalid_destination_says in str(outcome)

    async def test_an_unreachable_broker_is_transient_and_named(
        self, kit: PublisherKit[Any]
    ) -> None:
        begins, *holds = kit.unreachable_says()
        async with kit.publishing(**kit.unreachable()) as pub:
            outcomes = await pub.publish([kit.message("b1", 1), kit.message("b1", 2)])
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            assert str(outcomes[0]).startswith(begins), outcomes[0]
            for text in holds:
                assert text in str(outcomes[0])
            if kit.connect_reaches_the_broker:
                with pytest.raises(TransientPublishError, match="cannot connect"):
                    await pub.connect()

    async def test_a_cancelled_publish_and_close_return_at_once_while_the_broker_is_silent(
        self, kit: PublisherKit[Any]
    ) -> None:
        """What the relay does when its lease is lost or the shutdown grace is over: cancel
        the batch, then close; nothing may keep running."""
        proxy = kit.harness.proxy
        loop = asyncio.get_running_loop()
        pub = kit.publisher(ack_timeout=30.0)  # only the cancellation ends the wait
        try:
            assert await pub.publish([kit.message("b0", 1)]) == [None]
            proxy.pause()  # a black hole: connections stay open, nothing comes back
            for _ in range(2):  # in flight on an open connection, then as it comes next
                batch = [kit.message(f"b{n}", 2) for n in range(20)]
                task = asyncio.create_task(pub.publish(batch))
                await eventually(lambda: proxy.waiting_from_clients() > 0)  # it has written
                started = loop.time()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert loop.time() - started < 0.5
        finally:
            started = loop.time()
            await pub.close()
            assert loop.time() - started < 0.5
        assert len(asyncio.all_tasks()) == 1  # this test's: nothing left behind

    async def test_close_is_idempotent_and_publish_connects_again(
        self, kit: PublisherKit[Any]
    ) -> None:
        pub = kit.publisher()
        try:
            await pub.close()  # never connected
            assert await pub.publish([kit.message("k", 1)]) == [None]
            await pub.close()
            await pub.close()
            assert await pub.publish([kit.message("k", 2)]) == [None]
        finally:
            await pub.close()
        assert [c.id for c in await kit.consume(expected=2)] == ["book/k@1", "book/k@2"]


class DeduplicationTestcase:
    """For a broker that drops a message it already stored by its id (JetStream, SQS FIFO)."""

    async def test_a_message_sent_again_is_stored_once(self, kit: PublisherKit[Any]) -> None:
        (batch,) = lending(kit, kit.batches[:1])
        async with kit.publishing() as pub:
            assert await pub.publish(batch) == [None] * len(batch)
            assert await pub.publish(batch[:10]) == [None] * 10  # acknowledged as duplicates
            if kit.counts_duplicates:
                assert pub.duplicates == 10
        assert len(await kit.consume(expected=len(batch))) == len(batch)


class MissingDestinationTestcase:
    """For a broker whose destination must exist before a message can go there."""

    async def test_a_missing_destination_is_transient_until_created(
        self, unprepared: PublisherKit[Any]
    ) -> None:
        kit = unprepared
        assert kit.missing_destination_says, "the kit says what the error names"
        batch = [kit.message("k", 1), kit.message("k", 2)]
        async with kit.publishing() as pub:
            outcomes = await pub.publish(batch)
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            assert kit.missing_destination_says in str(outcomes[0])
            await kit.harness.prepare()
            assert await pub.publish(batch) == [None, None]
        assert [c.id for c in await kit.consume(expected=2)] == ["book/k@1", "book/k@2"]


async def read_back(reader: Reader, destination: str, since: datetime | None) -> list[Stored]:
    return [stored async for stored in reader.read([destination], since)]


def rounded_up(when: datetime, seconds: float) -> datetime:
    """`when`, rounded up to a whole multiple of `seconds` since the epoch."""
    epoch, step = datetime(1970, 1, 1, tzinfo=UTC), timedelta(seconds=seconds)
    return epoch - ((epoch - when) // step) * step


class ReadBackTestcase:
    """For a broker an audit can read back (relay/core/readback.py): what every reader does,
    written once. The kit's `duplicate_window` is the window its destination was prepared
    with (None: the broker drops no re-sent id)."""

    async def test_every_message_is_read_back_with_its_id_in_order_and_none_taken(
        self, kit: PublisherKit[Any]
    ) -> None:
        (batch,) = lending(kit, (60,))
        began = datetime.now(UTC)
        async with kit.publishing() as pub:
            assert await pub.publish(batch) == [None] * len(batch)
        async with kit.reading() as reader:
            got = await read_back(reader, kit.destination, began - timedelta(minutes=1))
            again = await read_back(reader, kit.destination, None)  # from the oldest held
        keys = {m.id: m.key for m in batch}
        if kit.total_order:
            assert [s.id for s in got] == [m.id for m in batch]
            assert [s.id for s in again] == [s.id for s in got]
        else:  # each key's in the order sent (keys may take turns otherwise from read to read)
            sent = per_key([(m.id, m.key) for m in batch])
            assert per_key([(s.id or "", keys.get(s.id or "")) for s in got]) == sent
            assert per_key([(s.id or "", keys.get(s.id or "")) for s in again]) == sent
        assert {s.destination for s in got} == {kit.destination}
        if kit.stored_times:
            assert all(
                s.time is not None and abs(s.time - began) < timedelta(minutes=1) for s in got
            )
        else:  # the broker does not tell a reader when it stored a message
            assert all(s.time is None for s in got)
        assert all(s.where for s in got)
        # Reading took nothing from the consumers: they still get every message.
        assert len(await kit.consume(expected=len(batch))) == len(batch)

    async def test_a_read_from_a_time_leaves_out_what_was_stored_before_it(
        self, kit: PublisherKit[Any]
    ) -> None:
        early = [kit.message("a", v) for v in range(1, 6)]
        late = [kit.message("b", v) for v in range(1, 6)]
        async with kit.publishing() as pub, kit.reading() as reader:
            assert await pub.publish(early) == [None] * 5
            stored = await read_back(reader, kit.destination, None)
            assert [s.id for s in stored] == [m.id for m in early]
            # After the last one by the broker's clock (this machine's when it gives none),
            # rounded up to what a read from a time tells apart.
            times = [s.time for s in stored if s.time is not None]
            latest = max(times) if kit.stored_times else datetime.now(UTC)
            after = rounded_up(latest + timedelta(milliseconds=1), kit.seek_resolution)
            await eventually(lambda: datetime.now(UTC) > after + timedelta(milliseconds=20))
            assert await pub.publish(late) == [None] * 5
            got = await read_back(reader, kit.destination, after)
        assert [s.id for s in got] == [m.id for m in late]

    async def test_the_horizon_names_the_oldest_message_held(self, kit: PublisherKit[Any]) -> None:
        sent = [kit.message("h", v) for v in range(1, 4)]
        async with kit.reading() as reader:
            empty = await reader.horizon(kit.destination)
            async with kit.publishing() as pub:
                assert await pub.publish(sent) == [None] * 3
            await kit.consume(expected=3)
            horizon = await reader.horizon(kit.destination)
            window = await reader.duplicate_window(kit.destination)
        assert empty.first is None
        assert horizon.first is not None and horizon.where
        assert horizon.first_id in (None, sent[0].id)
        assert window == kit.duplicate_window

    async def test_a_destination_nothing_was_published_to_reads_empty(
        self, kit: PublisherKit[Any]
    ) -> None:
        async with kit.reading() as reader:
            assert await read_back(reader, kit.destination, None) == []
            assert (await reader.horizon(kit.destination)).first is None
