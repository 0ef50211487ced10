"""The Redis broker's config: what loads, what is refused and why, and that the password never
shows; and how the adapter cuts a batch into script calls (no server needed)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from relay.brokers.redis import MAX_CALL_BYTES, MAX_CALL_MESSAGES, RedisPublisher, _chunks
from relay.config import BrokerConfig, RedisBrokerConfig
from relay.core.publishing import Message
from relay.errors import PermanentPublishError, TransientPublishError

BROKERS: TypeAdapter[Any] = TypeAdapter(BrokerConfig)
SECRET = "Tr0ub4dor-s3cret"


def load(**fields: Any) -> RedisBrokerConfig:
    config = BROKERS.validate_python({"type": "redis", "url": "redis://r.example/0", **fields})
    assert isinstance(config, RedisBrokerConfig)
    return config


def test_the_defaults() -> None:
    config = load()
    assert config.maxlen is None
    assert config.dedup_window == 120.0
    assert config.dedup_key_prefix == "outbox-relay:dedup:"
    assert config.max_message_bytes == 1024 * 1024
    assert (config.connect_timeout, config.ack_timeout) == (5.0, 10.0)


def test_sizes_and_durations_are_read_as_written() -> None:
    config = load(max_message_bytes="4MiB", dedup_window="10m", maxlen=1000)
    assert (config.max_message_bytes, config.dedup_window, config.maxlen) == (4 << 20, 600, 1000)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"url": "http://r.example"}, "must start with redis:// or rediss://"),
        ({"url": "redis://r.example/cache"}, "the path must be a database number"),
        ({"url": "redis://r.example:0"}, "the port is not a number from 1 to 65535"),
        ({"url": "redis:///0"}, "it names no host"),
        ({"tls": {}}, "tls: needs a rediss:// url"),
        ({"username": "relay"}, "username: needs a password"),
        ({"url": f"redis://u:{SECRET}@r.example/0", "password": "x"}, "give it in one place"),
        ({"max_message_bytes": "1GiB"}, "less than or equal to 536870912"),
        ({"maxlen": 0}, "greater than or equal to 1"),
        ({"dedup_window": "0s"}, "greater than 0"),
        ({"dedup_key_prefix": ""}, "at least 1 character"),
    ],
)
def test_what_is_refused_says_why(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as error:
        load(**fields)
    assert says in str(error.value)
    assert SECRET not in str(error.value)


def test_a_password_in_the_url_or_the_key_never_shows() -> None:
    for config in (load(url=f"rediss://relay:{SECRET}@r.example:6380/1"), load(password=SECRET)):
        assert SECRET not in repr(config) and SECRET not in str(config.model_dump())


def message(n: int, body: bytes = b"{}", destination: str = "s") -> Message:
    return Message(
        id=f"book/b@{n}",
        type="t",
        destination=destination,
        key="b",
        body=body,
        source="/s",
        time=datetime(2026, 12, 3, tzinfo=UTC),
        position=n,
    )


async def test_a_batch_is_cut_by_count_and_size_and_a_big_message_goes_alone() -> None:
    pub = RedisPublisher("r", load(max_message_bytes="8MiB"))
    small = [pub._entry(n, message(n)) for n in range(MAX_CALL_MESSAGES + 1)]
    assert [len(c) for c in _chunks(small)] == [MAX_CALL_MESSAGES, 1]  # type: ignore[arg-type]
    big = pub._entry(0, message(0, b"x" * MAX_CALL_BYTES))
    mixed = [small[0], big, small[1]]
    assert [len(c) for c in _chunks(mixed)] == [1, 1, 1]  # type: ignore[arg-type]


async def test_what_can_never_be_sent_is_permanent_before_any_connection() -> None:
    pub = RedisPublisher("r", load(url="redis://127.0.0.1:1/0", max_message_bytes=1000))
    outcomes = await pub.publish([replace(message(1), body=b"x" * 1000), message(2)])
    assert isinstance(outcomes[0], PermanentPublishError)
    assert "is more than max_message_bytes (1,000)" in str(outcomes[0])
    assert isinstance(outcomes[1], TransientPublishError)  # held back, never sent ahead
    fits = pub._entry(0, replace(message(1), body=b"x" * 800))  # the body is counted once
    assert not isinstance(fits, PermanentPublishError) and fits.size < 1000
    for destination, says in (("", "the destination is empty"), ("outbox-relay:dedup:s", "")):
        (outcome,) = await pub.publish([message(1, destination=destination)])
        assert isinstance(outcome, PermanentPublishError) and says in str(outcome)
