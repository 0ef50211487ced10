"""Header values a broker's client would alter: named, with the character (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.brokers._header_values import altered
from relay.config import load_config
from relay.errors import ConfigError
from tests.support.hostile_configs import nats


def test_header_values_a_client_would_alter_are_named() -> None:
    assert altered(("ce-id", "book/Łódź ok@1"), ("ce-tracestate", None)) is None
    assert altered(("ce-id", "al\u00a0ice")) is None  # not printable, but sent as written
    assert altered(("ce-id", "a\nb")) == (
        "header ce-id holds a line feed (\\x0a), which the broker's client would not send"
        " as written"
    )
    assert altered(("ce-id", "ok"), ("ce-partitionkey", "\u2003x")) == (
        "header ce-partitionkey starts or ends with whitespace, which the broker's client strips"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("type", "'library.book-lent.v1 '"), ("type", '"library.\\tlent"'), ("source", "' /x'")],
)
def test_header_values_from_the_config_are_checked_at_load(
    tmp_path: Path, key: str, value: str
) -> None:
    """Else every message of the rule would be refused at run time, one by one."""
    text = nats("").replace("        type: library.book-lent.v1\n", f"        type: {value}\n")
    if key == "source":
        text = text.replace(
            "    broker: nats\n", f"    broker: nats\n    cloudevents_source: {value}\n"
        )
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="goes in a message header") as info:
        load_config(path)
    assert ("cloudevents_source" if key == "source" else ".type:") in str(info.value)


def test_the_nats_size_check_counts_the_header_block_as_the_server_does() -> None:
    """Exactly at the limit is sent; a byte over is refused, with ids of 4-byte characters."""
    from datetime import UTC, datetime

    from relay.brokers.nats import _oversized, message_headers
    from relay.core.publishing import Message

    for aggregate in ("book-1", "\U0001f4da" * 300):
        message = Message(
            id=f"book/{aggregate}@1",
            type="library.book-lent.v1",
            destination="library.loans",
            key=aggregate,
            body=b"x" * 5000,
            source="/outbox-relay/loans",
            time=datetime.now(UTC),
            position=1,
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        headers = message_headers(message)
        block = b"NATS/1.0\r\n"  # as nats-py writes it
        block += b"".join(k.encode() + b": " + v.encode() + b"\r\n" for k, v in headers.items())
        size = len(block + b"\r\n") + len(message.body)
        assert _oversized(message, headers, size, None) is None
        refused = _oversized(message, headers, size - 1, None)
        assert refused is not None and f"{size:,} bytes" in refused


def test_a_refusal_quotes_a_long_id_or_subject_by_its_start_and_length() -> None:
    """An id or subject comes from the event and may be megabytes: the error, logged and
    kept in the parked table, quotes its first 80 characters and says how long it is."""
    from datetime import UTC, datetime

    from relay.brokers._nats_subjects import invalid as _invalid
    from relay.brokers.nats import _oversized, message_headers
    from relay.core.publishing import Message

    aggregate = "b" * 300_000
    message = Message(
        id=f"book/{aggregate}@1",
        type="library.book-lent.v1",
        destination=f"library.{aggregate} x",
        key="k",
        body=b"{}",
        source="/outbox-relay/loans",
        time=datetime.now(UTC),
        position=1,
    )
    oversized = _oversized(message, message_headers(message), 1024, None)
    invalid = _invalid(message.destination)
    assert oversized is not None
    for text, length in ((oversized, len(message.id)), (invalid, len(message.destination))):
        assert len(text) < 300, text
        assert f"... ({length:,} characters)" in text
    assert oversized.startswith("message 'book/bbbb")
