"""The Pub/Sub adapter's pure parts: its config's rules, the attributes it sends, the
limits it checks before sending (the emulator checks none), the ordering key."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from relay.brokers.pubsub import (
    MAX_ATTRIBUTE_VALUE_BYTES,
    PubSubPublisher,
    attribute_problem,
    message_attributes,
    ordering_key,
)
from relay.config import PubSubBrokerConfig
from relay.core.publishing import Message, to_structured
from relay.errors import PermanentPublishError, PublishError


def sample(**changes: Any) -> Message:
    message = Message(
        id="book/b1@2",
        type="library.book-lent.v1",
        destination="loans",
        key="b1",
        body=b'{"book":"b1"}',
        source="/outbox-relay/loans",
        time=datetime(2026, 12, 1, tzinfo=UTC),
        position=2,
    )
    return replace(message, **changes) if changes else message


def publisher() -> PubSubPublisher:
    config = PubSubBrokerConfig(type="pubsub", project="library-prod")
    return PubSubPublisher("ps", config)


def test_binary_mode_attributes_are_the_pubsub_bindings() -> None:
    assert message_attributes(sample()) == {
        "ce-specversion": "1.0",
        "ce-id": "book/b1@2",
        "ce-type": "library.book-lent.v1",
        "ce-source": "/outbox-relay/loans",
        "ce-time": "2026-12-01T00:00:00+00:00",
        "ce-partitionkey": "b1",
        "content-type": "application/json",
    }


def test_structured_mode_sends_only_the_content_type() -> None:
    message = sample()
    to_structured(message)
    assert message_attributes(message) == {"content-type": "application/cloudevents+json"}


def test_attribute_values_over_a_kibibyte_are_named() -> None:
    assert attribute_problem({"ce-id": "i" * MAX_ATTRIBUTE_VALUE_BYTES}) is None
    problem = attribute_problem({"ce-id": "é" * 513})  # 1,026 bytes in UTF-8
    assert problem == (
        "attribute ce-id is 1,026 bytes; Pub/Sub takes at most 1,024 bytes per attribute value"
    )
    assert "at most 100" in str(attribute_problem({f"a{n}": "v" for n in range(101)}))
    assert "'goog'" in str(attribute_problem({"googler": "v"}))


def test_an_empty_or_hash_shaped_key_is_hashed_every_other_is_kept() -> None:
    assert ordering_key("book-1") == "book-1"
    assert ordering_key("") == "~sha256:" + hashlib.sha256(b"").hexdigest()
    shaped = "~sha256:" + "a" * 64
    assert ordering_key(shaped) == "~sha256:" + hashlib.sha256(shaped.encode()).hexdigest()
    assert ordering_key(shaped) != shaped


def test_what_pubsub_would_refuse_is_permanent_and_names_the_limit() -> None:
    pub = publisher()
    long_key = sample(key="k" * 1025)
    to_structured(long_key)  # no ce-partitionkey: the ordering key itself is checked
    refused = pub._prepare(long_key)
    assert isinstance(refused, PermanentPublishError)
    assert "the key is 1,025 bytes" in str(refused)
    refused = pub._prepare(sample(destination="goog-topic"))
    assert isinstance(refused, PermanentPublishError)
    assert "is not a topic id" in str(refused)
    prepared = pub._prepare(sample(destination="projects/other-project/topics/loans"))
    assert not isinstance(prepared, PublishError)
    assert prepared.topic == "projects/other-project/topics/loans"
    prepared = pub._prepare(sample())
    assert not isinstance(prepared, PublishError)
    assert prepared.topic == "projects/library-prod/topics/loans"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"project": "Library"}, "String should match pattern"),
        ({"project": "lib"}, "String should match pattern"),
        ({"emulator_host": "http://localhost:8085"}, "must be host:port"),
        ({"endpoint": "pubsub.googleapis.com"}, "must be host:port"),
        ({"max_messages": 1001}, "less than or equal to 1000"),
        ({"max_bytes": 10_000_001}, "less than or equal to 10000000"),
        ({"credentials_file": "/nope/key.json"}, "no such file"),
    ],
)
def test_config_errors_name_the_rule(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        PubSubBrokerConfig.model_validate({"type": "pubsub", "project": "library-prod", **fields})


def test_the_emulator_takes_no_credentials(tmp_path: Path) -> None:
    key = tmp_path / "key.json"
    key.write_text("{}")
    with pytest.raises(ValidationError, match="the emulator takes no endpoint"):
        PubSubBrokerConfig(
            type="pubsub",
            project="library-prod",
            emulator_host="localhost:8085",
            credentials_file=str(key),
        )
