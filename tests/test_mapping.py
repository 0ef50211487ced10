"""Mapping events to integration events: pure logic, no services needed."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import jmespath
import pytest

from relay.config import OutboxConfig, RetryConfig
from relay.config.expressions import ExpressionError, compile_expression, compile_template
from relay.core.mapping import Event, Mapper
from relay.core.retry import Backoff
from relay.errors import MappingError
from relay.redaction import redact

WHEN = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def event(type_: str = "BookLent", data: object = None, **fields: object) -> Event:
    base: dict[str, object] = {
        "position": 7,
        "aggregate_type": "book",
        "aggregate_id": "book-1",
        "version": 2,
        "type": type_,
        "data": {"loanId": "L1", "memberId": "M1"} if data is None else data,
        "metadata": {"tenant": "north"},
        "created_at": WHEN,
    }
    base.update(fields)
    return Event(**base)  # type: ignore[arg-type]


def outbox(**overrides: object) -> OutboxConfig:
    config: dict[str, object] = {
        "broker": "nats",
        "messages": {
            "BookLent": {
                "type": "library.book-lent.v1",
                "destination": "library.{aggregate_type}.{metadata.tenant}",
                "payload": {"bookId": "aggregate_id", "loanId": "data.loanId"},
            },
            "BookReturned": {
                "type": "library.book-returned.v1",
                "destination": "library.loans",
                "payload": "{bookId: aggregate_id, late: data.late}",
            },
        },
    }
    config.update(overrides)
    return OutboxConfig.model_validate(config)


def test_maps_payload_destination_id_and_key() -> None:
    message = Mapper("loans", outbox()).map(event())
    assert message is not None
    assert json.loads(message.body) == {"bookId": "book-1", "loanId": "L1"}
    assert message.destination == "library.book.north"
    assert message.id == "book/book-1@2"
    assert message.key == "book-1"
    assert message.type == "library.book-lent.v1"
    assert message.position == 7
    assert message.time == WHEN
    assert message.source == "/outbox-relay/loans"


def test_single_expression_payload() -> None:
    message = Mapper("loans", outbox()).map(event("BookReturned", {"late": True}))
    assert message is not None
    assert json.loads(message.body) == {"bookId": "book-1", "late": True}


def test_id_and_key_templates_are_configurable() -> None:
    mapper = Mapper("loans", outbox(id="{aggregate_id}:{version}", key="{data.memberId}"))
    message = mapper.map(event())
    assert message is not None
    assert (message.id, message.key) == ("book-1:2", "M1")


def test_message_id_is_stable_across_mappings() -> None:
    mapper = Mapper("loans", outbox())
    first, second = mapper.map(event()), mapper.map(event())
    assert first is not None and second is not None
    assert first.id == second.id and first.body == second.body


def test_unmapped_type_and_filtered_aggregate_are_skipped() -> None:
    mapper = Mapper("loans", outbox(aggregates=["book"]))
    assert mapper.map(event("BookAdded")) is None
    assert mapper.map(event(aggregate_type="member")) is None
    assert mapper.map(event()) is not None


def test_null_in_a_template_is_a_mapping_error_naming_the_event() -> None:
    mapper = Mapper("loans", outbox(key="{data.missing}"))
    with pytest.raises(MappingError) as info:
        mapper.map(event())
    text = str(info.value)
    assert "outboxes.loans.messages.BookLent" in text
    assert "position 7" in text and "book/book-1@2" in text
    assert "{data.missing} is null" in text


def test_undecodable_payload_is_a_mapping_error() -> None:
    mapper = Mapper("loans", outbox())
    with pytest.raises(MappingError, match="not JSON"):
        mapper.map(event(problem="payload or metadata is not JSON: Expecting value"))


@pytest.mark.parametrize(
    "expr",
    ["data.loanId", "aggregate_id", "data.a.b.c", "metadata.tenant", "data.missing", "data"],
)
def test_fast_dotted_paths_agree_with_jmespath(expr: str) -> None:
    envelope = event(data={"loanId": "L", "a": {"b": {"c": [1, 2]}}, "x": 3}).envelope()
    assert compile_expression(expr)(envelope) == jmespath.search(expr, envelope)


def test_dotted_path_through_a_non_object_is_null_like_jmespath() -> None:
    envelope = event(data={"loanId": "L"}).envelope()
    for expr in ("data.loanId.deeper", "version.x"):
        assert compile_expression(expr)(envelope) is None
        assert jmespath.search(expr, envelope) is None


@pytest.mark.parametrize("bad", ["", "data.[", "a ||", "`unterminated"])
def test_bad_expressions_fail_to_compile(bad: str) -> None:
    with pytest.raises(ExpressionError):
        compile_expression(bad)


def test_templates() -> None:
    env = event().envelope()
    assert compile_template("library.{aggregate_type}")(env) == "library.book"
    assert compile_template("{{literal}}.{version}")(env) == "{literal}.2"
    assert compile_template("plain")(env) == "plain"
    with pytest.raises(ExpressionError, match="unbalanced"):
        compile_template("a.{b")


def test_backoff_grows_caps_and_jitters() -> None:
    config = RetryConfig(initial=0.1, multiplier=2.0, max=1.0, jitter=0.2)
    backoff = Backoff(config, random.Random(1))
    delays = [backoff.delay(n) for n in range(1, 8)]
    for n, delay in enumerate(delays, start=1):
        base = min(1.0, 0.1 * 2 ** (n - 1))
        assert base * 0.8 <= delay <= min(1.0, base * 1.2)
    assert delays[-1] <= 1.0
    plain = Backoff(RetryConfig(initial=0.1, multiplier=2.0, max=30.0, jitter=0.0))
    assert [plain.delay(n) for n in (1, 2, 3)] == pytest.approx([0.1, 0.2, 0.4])


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("postgresql://relay:hunter2@db:5432/app", "hunter2"),
        ("connect failed: nats://u:p4ss@nats:4222", "p4ss"),
        ("host=db password=hunter2 user=relay", "hunter2"),
    ],
)
def test_redact_hides_passwords(text: str, hidden: str) -> None:
    assert hidden not in redact(text)
    assert "***" in redact(text)
