"""Pure rules of `relay check`: which destinations are known in advance, and which subjects a
JetStream stream captures."""

from __future__ import annotations

import pytest

from relay.brokers._nats_subjects import captures
from relay.mapping.expressions import static_text


@pytest.mark.parametrize(
    ("template", "fixed"),
    [
        ("library.loans", "library.loans"),
        ("library.{aggregate_type}", None),
        ("{data.topic}", None),
        ("odd.{{braces}}", "odd.{braces}"),
        ("half.{{.{type}", None),
    ],
)
def test_only_a_template_without_placeholders_is_known_in_advance(
    template: str, fixed: str | None
) -> None:
    assert static_text(template) == fixed


@pytest.mark.parametrize(
    ("pattern", "subject", "captured"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        (">", "x", True),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.d", False),
    ],
)
def test_stream_subjects_capture_as_nats_does(pattern: str, subject: str, captured: bool) -> None:
    assert captures(pattern, subject) is captured
