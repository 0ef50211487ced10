"""Mapping events to integration events: pure logic, no services needed."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta, timezone

import jmespath
import orjson
import pytest

from relay.config import OutboxConfig, RetryConfig
from relay.core.event import Event
from relay.core.retry import Backoff
from relay.errors import MappingError
from relay.mapping.expressions import (
    ExpressionError,
    compile_expression,
    compile_template,
    may_compute,
    normalized,
)
from relay.mapping.mapper import Mapper
from relay.postgres.source import decode_json
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


@pytest.mark.parametrize(("multiplier", "attempt"), [(2.0, 1025), (2.0, 10**9), (10.0, 400)])
def test_backoff_stays_at_max_however_long_the_outage(multiplier: float, attempt: int) -> None:
    """The attempt count is kept across restarts and takeovers, and an outage of a weekend
    passes a thousand attempts: the delay is `max`, never an overflow that stops the relay."""
    config = RetryConfig(initial=0.1, multiplier=multiplier, max=30.0, jitter=0.2)
    backoff = Backoff(config, random.Random(1))
    assert 24.0 <= backoff.delay(attempt) <= 30.0


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


# The fast path (orjson) must not change what goes out: exact integers, strict JSON.


def test_an_integer_beyond_64_bits_is_decoded_and_published_exactly() -> None:
    big = 123456789012345678901234567890
    assert decode_json(f'{{"n": {big}, "m": -{big}}}') == {"n": big, "m": -big}
    config = outbox(messages={"BookLent": {"type": "t", "destination": "d", "payload": "data"}})
    message = Mapper("loans", config).map(event(data={"n": big}))
    assert message is not None
    assert message.body == f'{{"n":{big}}}'.encode()


# Numbers a 64-bit float cannot hold: a token amount with 18 decimals, a 20-digit one with a
# fraction. orjson read them as floats and they went out changed (1.1234567890123457).
EXACT = ["1.123456789012345678", "12345678901234567890.5", "-0.12345678901234567", "1.5e-400"]


@pytest.mark.parametrize("number", EXACT)
def test_a_number_a_float_cannot_hold_is_published_as_the_event_wrote_it(number: str) -> None:
    data = decode_json(f'{{"amount": {number}, "rate": 0.1, "items": [{{"x": {number}}}]}}')
    assert str(data["amount"]) == number
    assert type(data["rate"]) is float  # what a float holds stays a plain float
    config = outbox(messages={"BookLent": {"type": "t", "destination": "d", "payload": "data"}})
    message = Mapper("loans", config).map(event(data=data))
    assert message is not None
    assert orjson.loads(message.body)["rate"] == 0.1
    assert message.body == f'{{"amount":{number},"rate":0.1,"items":[{{"x":{number}}}]}}'.encode()


def test_a_number_kept_exact_is_a_number_to_templates_conditions_and_functions() -> None:
    data = decode_json('{"amounts": [1.123456789012345678, 2], "id": 10000000000000000.5}')
    payload = {"top": "max(data.amounts)", "copy": "data.amounts", "total": "sum(data.amounts)"}
    rule = {
        "type": "t",
        "destination": "d.{data.id}",
        "when": "data.amounts[0] > `1`",
        "payload": payload,
    }
    config = outbox(messages={"BookLent": rule})
    message = Mapper("loans", config).map(event(data=data))
    assert message is not None
    assert message.destination == "d.10000000000000000.5"
    body = message.body.decode()
    assert '"top":2' in body  # a function compared it as a number
    assert '"copy":[1.123456789012345678,2]' in body  # a computed payload keeps it too
    assert orjson.loads(body)["total"] == pytest.approx(3.1234567890123457)


@pytest.mark.parametrize(
    ("payload", "data"),
    [
        ("avg(data.arr)", '{"arr": [1' + "0" * 400 + ", 1, 1" + "0" * 400 + "]}"),
        ("sum(data.arr)", '{"arr": [1' + "0" * 400 + ", 1.5]}"),
        ("avg(data.arr)", '{"arr": [1.123456789012345678, 1' + "0" * 400 + "]}"),
    ],
)
def test_arithmetic_beyond_a_floats_range_fails_the_event_not_the_relay(
    payload: str, data: str
) -> None:
    """jsonb holds such integers exactly; `avg` and `sum` overflowed with an OverflowError
    that nothing caught: "task died", at every start (a black-box attack)."""
    config = outbox(messages={"BookLent": {"type": "t", "destination": "d", "payload": payload}})
    with pytest.raises(MappingError, match=r"at position 7 .*too large"):
        Mapper("loans", config).map(event(data=decode_json(data)))


@pytest.mark.parametrize("depth", [253, 254, 300, 1000])
def test_a_number_kept_exact_stays_exact_deeper_than_orjson_writes(depth: int) -> None:
    """orjson writes 254 levels at most; past them the standard encoder wrote every number as
    a float (a black-box attack): `1.2345678901234567e+19` for `12345678901234567890.5`."""
    deep = "[" * depth + "12345678901234567890.5" + "]" * depth
    text = f'{{"a": 12345678901234567890.5, "big": 1{"0" * 30}, "deep": {deep}, "s": "é"}}'
    config = outbox(messages={"BookLent": {"type": "t", "destination": "d", "payload": "data"}})
    message = Mapper("loans", config).map(event(data=decode_json(text)))
    assert message is not None
    assert message.body.decode() == text.replace(": ", ":").replace(", ", ",")


def test_a_long_number_that_a_float_holds_stays_a_float() -> None:
    """Digits a float keeps (trailing zeros, 0.1 written long) are not worth the exact path:
    the value is the same."""
    data = decode_json('{"a": 1.50000000000000000000, "b": 0.10000000000000000000}')
    assert type(data["a"]) is float
    assert type(data["b"]) is float


@pytest.mark.parametrize("text", ["NaN", '{"a": Infinity}', "[1e999]", "-1e400", "{'a': 1}"])
def test_decoding_refuses_what_is_not_strict_json(text: str) -> None:
    with pytest.raises(ValueError):
        decode_json(text)


def test_a_computed_infinity_is_a_mapping_error_not_null() -> None:
    """sum() of two huge numbers is Infinity; orjson would write null, so it is not used."""
    payload = {"total": "sum(data.amounts)", "copy": "data.amounts"}
    config = outbox(messages={"BookLent": {"type": "t", "destination": "d", "payload": payload}})
    with pytest.raises(MappingError, match="Out of range float values"):
        Mapper("loans", config).map(event(data={"amounts": [1e308, 1e308]}))


@pytest.mark.parametrize(
    ("expression", "computes"),
    [
        ("data.loanId", False),
        ("{id: aggregate_id, loan: data.loanId}", False),
        ("data.items[0].price", False),
        ("sum(data.amounts)", True),
        ("{n: to_number(data.n)}", True),
        ("`1e999`", True),
        ("{kind: 'loan'}", True),
    ],
)
def test_payloads_that_may_compute_numbers_are_known(expression: str, computes: bool) -> None:
    assert may_compute(expression) is computes


def test_metadata_is_decoded_only_for_an_outbox_that_reads_it() -> None:
    assert Mapper("loans", outbox()).reads_metadata  # its destination names metadata.tenant
    plain = {"BookLent": {"type": "t", "destination": "d", "payload": "data"}}
    assert not Mapper("loans", outbox(messages=plain)).reads_metadata
    bad = event(metadata=None, metadata_problem="column 'metadata' is not valid JSON")
    assert Mapper("loans", outbox(messages=plain)).map(bad) is not None
    with pytest.raises(MappingError, match="metadata"):
        Mapper("loans", outbox()).map(bad)


def test_templates_render_literals_numbers_and_braces() -> None:
    render = compile_template("{{x}}-{aggregate_type}/{version}:{data.flag}!")
    envelope = {"aggregate_type": "book", "version": 3, "data": {"flag": True}}
    assert render(envelope) == "{x}-book/3:true!"
    assert compile_template("constant")({}) == "constant"


def test_templates_of_scalar_fields_check_each_field_and_keep_braces() -> None:
    render = compile_template("{{v}}{aggregate_type}/{aggregate_id}@{version}")
    assert (
        render({"aggregate_type": "book", "aggregate_id": "b-1", "version": 2}) == "{v}book/b-1@2"
    )
    with pytest.raises(ExpressionError, match=r"\{aggregate_id\} is null or empty"):
        render({"aggregate_type": "book", "aggregate_id": "", "version": 2})
    with pytest.raises(ExpressionError, match=r"\{version\} is null or empty"):
        render({"aggregate_type": "book", "aggregate_id": "b-1", "version": None})


def test_one_placeholder_templates_render_like_the_general_ones() -> None:
    envelope = {"aggregate_id": "b-1", "version": 2, "data": {"flag": False, "n": None}}
    assert compile_template("{aggregate_id}")(envelope) == "b-1"
    assert compile_template("{{k}}:{version}}}")(envelope) == "{k}:2}"
    assert compile_template("flag={data.flag}.")(envelope) == "flag=false."
    with pytest.raises(ExpressionError, match=r"\{data.n\} is null or empty"):
        compile_template("x.{data.n}")(envelope)
    with pytest.raises(ExpressionError, match=r"\{aggregate_id\} is null or empty"):
        compile_template("{aggregate_id}")({"aggregate_id": ""})


def test_the_default_id_keeps_plain_values_and_escapes_what_would_read_alike() -> None:
    mapper = Mapper("loans", outbox())
    ids = {
        (kind, key): mapper.map(event(aggregate_type=kind, aggregate_id=key))
        for kind, key in [("book", "b-1"), ("book", "a/b"), ("book/a", "b"), ("u", "a@b%c")]
    }
    assert {k: m.id for k, m in ids.items() if m is not None} == {
        ("book", "b-1"): "book/b-1@2",
        ("book", "a/b"): "book/a/b@2",  # the id's `/` is not its separator
        ("book/a", "b"): "book%2Fa/b@2",
        ("u", "a@b%c"): "u/a%40b%25c@2",
    }


def test_an_id_template_renders_distinct_values_to_distinct_ids() -> None:
    """Every pair of short values over the separators and `%`: no two render alike."""
    render = compile_template("{aggregate_type}/{aggregate_id}@{version}", distinct=True)
    alphabet = ["", "a", "/", "@", "%", "%2F", "%25", "é"]
    values = {a + b for a in alphabet for b in alphabet} - {""}
    seen: dict[str, tuple[str, str]] = {}
    for kind in values:
        for key in values:
            rendered = render({"aggregate_type": kind, "aggregate_id": key, "version": 1})
            assert seen.setdefault(rendered, (kind, key)) == (kind, key), rendered
    assert len(seen) == len(values) ** 2


def test_an_escaped_separator_is_its_utf8_percent_encoding() -> None:
    render = compile_template("{aggregate_id}é{version}", distinct=True)
    assert render({"aggregate_id": "xéy", "version": 1}) == "x%C3%A9yé1"


def test_an_id_template_with_placeholders_side_by_side_is_a_config_error() -> None:
    with pytest.raises(ExpressionError, match=r"\{aggregate_type\} and \{aggregate_id\} stand"):
        compile_template("{aggregate_type}{aggregate_id}@{version}", distinct=True)
    assert (
        compile_template("{aggregate_type}{aggregate_id}")(
            {"aggregate_type": "a", "aggregate_id": "b"}
        )
        == "ab"
    )
    with pytest.raises(ValueError, match="side by side"):
        outbox(id="{aggregate_type}{aggregate_id}")


def test_an_id_is_never_a_list_rules_id_of_another_event() -> None:
    """A rule of a list adds `/` and its type after the outbox's id: the last value of an id
    escapes `/`, so `{metadata.eid}` with `k/v1` cannot read as the list rule v1's id of `k`."""
    render = compile_template("{metadata.eid}", distinct=True)
    assert render({"metadata": {"eid": "k/v1"}}) == "k%2Fv1"
    assert render({"metadata": {"eid": "k"}}) + "/v1" == "k/v1"
    assert compile_template("{metadata.eid}")({"metadata": {"eid": "k/v1"}}) == "k/v1"


@pytest.mark.parametrize("follower", ["%", "0", "2", "9"])
def test_a_percent_or_a_digit_cannot_end_a_value_in_an_id(follower: str) -> None:
    """`%25` and `%3N` hold them: `{a}%{b}` would render `x%` + `y` and `x` + `25%y` alike."""
    with pytest.raises(ExpressionError, match=rf"\{{aggregate_type\}} is followed by '{follower}'"):
        compile_template(f"{{aggregate_type}}{follower}{{aggregate_id}}", distinct=True)
    assert (
        compile_template(f"{{aggregate_id}}{follower}x")({"aggregate_id": "a"}) == f"a{follower}x"
    )


def test_templates_written_alike_are_the_same_once_normalized() -> None:
    assert (
        normalized("{ aggregate_type }/{aggregate_id }@{{v}}")
        == "{aggregate_type}/{aggregate_id}@{{v}}"
    )
    assert normalized("{{x}}") == "{{x}}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_created_at_is_written_exactly_as_isoformat(seed: int) -> None:
    """The mapper writes UTC times a second at a time; any time must come out as isoformat()."""
    rng = random.Random(seed)
    mapper = Mapper(
        "o",
        OutboxConfig(
            broker="b",
            messages={"BookLent": {"type": "t", "destination": "d", "payload": "created_at"}},
        ),
    )
    zones = [UTC, timezone(timedelta(hours=5, minutes=30)), None]
    moments = [WHEN, WHEN.replace(microsecond=1), datetime(1969, 12, 31, 23, 59, 59, 999999, UTC)]
    moments += [
        datetime.fromtimestamp(rng.uniform(-3e9, 5e9), rng.choice(zones[:2])).replace(
            microsecond=rng.choice([0, rng.randrange(10**6)]), tzinfo=rng.choice(zones)
        )
        for _ in range(2000)
    ]
    for moment in moments:
        message = mapper.map(event(created_at=moment))
        assert message is not None
        assert message.time_text == moment.isoformat()
        assert json.loads(message.body) == moment.isoformat()
