"""Header values a broker's client would alter: named, with the character (no server)."""

from __future__ import annotations

from relay.brokers._header_values import altered


def test_header_values_a_client_would_alter_are_named() -> None:
    assert altered({"ce-id": "book/Łódź ok@1", "ce-type": "a.b.v1"}) is None
    assert altered({"ce-id": "al\u00a0ice"}) is None  # not printable, but sent as written
    assert altered({"ce-id": "a\nb"}) == (
        "header ce-id holds a line feed (\\x0a), which the broker's client would not send"
        " as written"
    )
    assert altered({"ce-id": "ok", "ce-partitionkey": "\u2003x"}) == (
        "header ce-partitionkey starts or ends with whitespace, which the broker's client strips"
    )
