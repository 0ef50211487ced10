"""`relay contract diff` on configs: each change a config makes, classified as a consumer of the
old contract would (the schema pairs themselves are in test_schema_inclusion.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relay.asyncapi.diff import Change, diff
from relay.cli.contract import read_side
from relay.errors import ContractError
from tests.support.contract_views import NESTED_ID, NESTED_ID_SUB

HEAD = """\
database: {url: "postgresql://relay@db.invalid/app"}
brokers:
  nats: {type: nats, servers: ["nats://nats.invalid:4222"]}
  kafka: {type: kafka, bootstrap_servers: ["kafka.invalid:9092"]}
outboxes:
  loans:
    broker: nats
"""
V1 = """\
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: library.loans
        payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
"""


def changes(
    tmp_path: Path, old: str, new: str, new_head: str = HEAD
) -> list[tuple[str, str, str, str | None]]:
    (tmp_path / "old.yaml").write_text(HEAD + old)
    (tmp_path / "new.yaml").write_text(new_head + new)
    found = diff(read_side(tmp_path / "old.yaml"), read_side(tmp_path / "new.yaml"))
    return [(c.message, c.path, c.verdict, c.channel) for c in found]


def whys(tmp_path: Path, old: str, new: str) -> list[Change]:
    (tmp_path / "old.yaml").write_text(HEAD + old)
    (tmp_path / "new.yaml").write_text(HEAD + new)
    return diff(read_side(tmp_path / "old.yaml"), read_side(tmp_path / "new.yaml"))


def test_the_same_config_changes_nothing(tmp_path: Path) -> None:
    assert changes(tmp_path, V1, V1) == []


def test_a_when_that_splits_an_event_type_over_two_destinations_breaks_the_first(
    tmp_path: Path,
) -> None:
    split = """\
    messages:
      BookLent:
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
          when: "data.priority != 'high'"
        - type: library.book-lent.v1
          destination: library.loans.priority
          id: "{aggregate_type}/{aggregate_id}@{version}/priority"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
          when: "data.priority == 'high'"
"""
    assert changes(tmp_path, V1, split) == [
        ("library.book-lent.v1", "$.when", "breaking", "library.loans"),
        ("library.book-lent.v1", "$", "compatible", "library.loans.priority"),
    ]
    (when, _) = whys(tmp_path, V1, split)
    assert "only when `data.priority != 'high'`: the others no longer arrive" in when.why


def test_a_second_destination_for_some_events_keeps_the_first_whole(tmp_path: Path) -> None:
    """The documented pattern: every loan to library.loans, the urgent ones also elsewhere."""
    both = """\
    messages:
      BookLent:
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
        - type: library.book-lent.v1
          destination: library.loans.priority
          id: "{aggregate_type}/{aggregate_id}@{version}/priority"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
          when: "data.priority == 'high'"
"""
    assert changes(tmp_path, V1, both) == [
        ("library.book-lent.v1", "$", "compatible", "library.loans.priority"),
    ]


def test_a_changed_condition_cannot_be_decided(tmp_path: Path) -> None:
    old = V1 + "        when: \"data.priority == 'high'\"\n"
    new = V1 + '        when: "data.urgent"\n'
    assert changes(tmp_path, old, new) == [
        ("library.book-lent.v1", "$.when", "unknown", "library.loans")
    ]
    assert changes(tmp_path, old, V1) == []  # the condition dropped: more events, none less


def test_where_and_how_a_message_goes(tmp_path: Path) -> None:
    moved = V1.replace("destination: library.loans", "destination: library.lending")
    assert changes(tmp_path, V1, moved) == [
        ("library.book-lent.v1", "$.channel.address", "breaking", "library.loans")
    ]
    on_kafka = HEAD.replace("broker: nats", "broker: kafka")
    assert changes(tmp_path, V1, V1, new_head=on_kafka) == [
        ("library.book-lent.v1", "$.channel.server", "breaking", "library.loans")
    ]
    structured = "    cloudevents: structured\n" + V1
    assert changes(tmp_path, V1, structured) == [
        ("library.book-lent.v1", "$.contentType", "breaking", "library.loans")
    ]
    keyed = '    key: "{data.memberId}"\n' + V1
    assert changes(tmp_path, V1, keyed) == [
        ("library.book-lent.v1", "$.key", "breaking", "library.loans")
    ]
    narrowed = "    aggregates: [book]\n" + V1
    assert changes(tmp_path, V1, narrowed) == [
        ("library.book-lent.v1", "$.aggregates", "breaking", "library.loans")
    ]


def test_a_single_rule_turned_into_a_list_changes_its_ids(tmp_path: Path) -> None:
    listed = (
        V1.replace("        type:", "        - type:")
        .replace("        destination", "          destination")
        .replace("        payload", "          payload")
    )
    (change,) = whys(tmp_path, V1, listed)
    assert (change.path, change.verdict) == ("$.id", "breaking")
    assert "`{aggregate_type}/{aggregate_id}@{version}/library.book-lent.v1`" in change.why


def test_a_new_version_beside_the_old_one_is_new_and_says_so(tmp_path: Path) -> None:
    v2 = """\
      BookLentV2:
        type: library.book-lent.v2
        destination: library.loans.v2
        payload: {bookId: aggregate_id, member: "{id: data.memberId}"}
"""
    (change,) = whys(tmp_path, V1, V1 + v2)
    assert (change.message, change.verdict) == ("library.book-lent.v2", "new")
    assert "beside `library.book-lent.v1`: the documented way to make a breaking change" in (
        change.why
    )
    renamed = V1.replace("library.book-lent.v1", "library.book-lent.v2")
    assert changes(tmp_path, V1, renamed) == [
        ("library.book-lent.v1", "$", "breaking", None),
        ("library.book-lent.v2", "$", "unknown", "library.loans"),  # where v1 was
    ]


def test_a_new_type_on_a_channel_old_carries_is_unknown(tmp_path: Path) -> None:
    """Its consumers that do not filter on the type receive a body of another shape."""
    beside = V1 + V1.removeprefix("    messages:\n").replace("BookLent:", "BookLentV2:").replace(
        "library.book-lent.v1", "library.book-lent.v2"
    )
    (change,) = whys(tmp_path, V1, beside)
    assert (change.message, change.verdict, change.channel) == (
        "library.book-lent.v2",
        "unknown",
        "library.loans",
    )
    assert "`library.loans`, which OLD already carries (`library.book-lent.v1`)" in change.why
    assert "do not filter on the type" in change.why


def test_payload_changes_of_an_inferred_schema(tmp_path: Path) -> None:
    """An inferred payload closes additionalProperties: a field added is breaking too."""
    fewer = V1.replace(", memberId: data.memberId", "")
    assert changes(tmp_path, V1, fewer) == [
        ("library.book-lent.v1", "$.payload.memberId", "breaking", "library.loans")
    ]
    more = V1.replace("data.memberId}", "data.memberId, note: data.note}")
    assert changes(tmp_path, V1, more) == [
        ("library.book-lent.v1", "$.payload.note", "breaking", "library.loans")
    ]


SCHEMA_RULE = """\
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: library.loans
        payload: {bookId: aggregate_id, note: data.note}
        schema: %s
"""


def test_a_rules_own_schema_judged_by_what_it_admits(tmp_path: Path) -> None:
    with_ref: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://schemas.example.com/book-lent.v1.json",
        "type": "object",
        "required": ["bookId"],
        "properties": {"bookId": {"$ref": "#/$defs/id"}},
        "$defs": {"id": {"type": "string"}},
    }
    inline = {**with_ref, "properties": {"bookId": {"type": "string"}}}
    del inline["$defs"]
    optional = {**inline, "properties": {**inline["properties"], "note": {"type": "string"}}}
    old = SCHEMA_RULE % json.dumps(with_ref)
    assert changes(tmp_path, old, SCHEMA_RULE % json.dumps(inline)) == []
    assert changes(tmp_path, old, SCHEMA_RULE % json.dumps(optional)) == [
        ("library.book-lent.v1", "$.payload.note", "compatible", "library.loans")
    ]
    loosened = {**inline, "required": []}
    assert changes(tmp_path, old, SCHEMA_RULE % json.dumps(loosened)) == [
        ("library.book-lent.v1", "$.payload.bookId", "breaking", "library.loans")
    ]


def test_trace_context_adds_optional_headers_compatibly(tmp_path: Path) -> None:
    found = changes(tmp_path, V1, "    trace_context: true\n" + V1)
    assert found and {verdict for _, _, verdict, _ in found} == {"compatible"}
    assert {path for _, path, _, _ in found} == {
        "$.headers['ce-traceparent']",
        "$.headers['ce-tracestate']",
    }


def test_a_renamed_outbox_changes_the_source_and_the_feed(tmp_path: Path) -> None:
    (tmp_path / "old.yaml").write_text(HEAD + V1)
    (tmp_path / "new.yaml").write_text(HEAD.replace("  loans:\n", "  lending:\n") + V1)
    found = diff(read_side(tmp_path / "old.yaml"), read_side(tmp_path / "new.yaml"))
    assert ("$", "breaking") in {(c.path, c.verdict) for c in found}  # loans' events: gone
    assert ("$.headers['ce-source']", "breaking") in {(c.path, c.verdict) for c in found}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("a: [\n", "is not valid YAML or JSON"),
        ("just: text\n", "is neither a contract (no `asyncapi` key) nor a relay config"),
        ("asyncapi: 2.6.0\n", "only AsyncAPI 3 documents"),
        ("asyncapi: 3.0.0\nchannels: {}\n", "components: missing, or not a mapping"),
        (HEAD + "    messages: {BookLent: {type: x, destination: 'a.{'}}\n", "unbalanced brace"),
    ],
)
def test_a_file_that_is_neither_is_refused_naming_it(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "side.yaml"
    path.write_text(text)
    with pytest.raises(ContractError) as raised:
        read_side(path)
    assert said in str(raised.value)
    assert "side.yaml" in str(raised.value)


def test_merge_arguments_swapped_let_data_override_the_key(tmp_path: Path) -> None:
    """`merge(data, {bookId: ...})` sets bookId last; swapped, `data` may override it."""
    last = V1.replace(
        "payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}",
        'payload: "merge(data, {bookId: aggregate_id})"',
    )
    first = last.replace(
        "merge(data, {bookId: aggregate_id})", "merge({bookId: aggregate_id}, data)"
    )
    found = changes(tmp_path, last, first)
    assert found and {(p, v) for _, p, v, _ in found} == {("$.payload.bookId", "breaking")}
    narrower = changes(tmp_path, first, last)
    assert {(p, v) for _, p, v, _ in narrower} == {("$.payload.bookId", "compatible")}


LEGACY = """\
      BookLentLegacy:
        type: library.book-lent.v1
        destination: library.loans
        payload: %s
"""


def test_a_second_shape_of_a_type_on_a_channel_is_compared_too(tmp_path: Path) -> None:
    """Every NEW message of a type on a channel must be one OLD's messages admit."""
    found = whys(tmp_path, V1, V1 + LEGACY % "data")
    assert {(c.path, c.verdict) for c in found} >= {
        ("$", "compatible"),  # BookLentLegacy's events: new here
        ("$.payload.bookId", "breaking"),
        ("$.payload.*", "breaking"),
    }
    assert all(c.verdict != "unknown" for c in found)
    assert "NEW's message `library.book-lent.v1.nats`: " in found[-1].why
    same = LEGACY % "{bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}"
    assert changes(tmp_path, V1, V1 + same) == [
        ("library.book-lent.v1", "$", "compatible", "library.loans")
    ]


def test_a_second_rule_in_a_list_with_another_shape_is_compared(tmp_path: Path) -> None:
    listed = """\
    messages:
      BookLent:
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}/short"
          payload: {bookId: aggregate_id}
"""
    assert changes(tmp_path, V1, listed) == [
        ("library.book-lent.v1", "$.id", "breaking", "library.loans"),  # a copy of each event
        ("library.book-lent.v1", "$.payload.loanId", "breaking", "library.loans"),
        ("library.book-lent.v1", "$.payload.memberId", "breaking", "library.loans"),
    ]


def test_two_shapes_of_a_type_reordered_change_nothing(tmp_path: Path) -> None:
    """Compared as sets: OLD's shapes, each admitted by one of NEW's, are the same."""
    legacy = LEGACY % "{legacyId: version}"
    reordered = "    messages:\n" + legacy + V1.removeprefix("    messages:\n")
    assert changes(tmp_path, V1 + legacy, reordered) == []
    found = changes(tmp_path, V1 + legacy, V1)  # a shape fewer: still within OLD's
    assert {(p, v) for _, p, v, _ in found} == {("$", "breaking"), ("$", "compatible")}
    assert ("$", "breaking") in {(p, v) for _, p, v, _ in found}  # the legacy events are gone


def test_a_copy_of_each_event_under_another_id_is_breaking(tmp_path: Path) -> None:
    """A consumer that drops duplicates by id processes each event twice."""
    copied = """\
    messages:
      BookLent:
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
        - type: library.book-lent.v1
          destination: library.loans
          id: "{aggregate_type}/{aggregate_id}@{version}/copy"
          payload: {bookId: aggregate_id, loanId: data.loanId, memberId: data.memberId}
"""
    (change,) = whys(tmp_path, V1, copied)
    assert (change.path, change.verdict) == ("$.id", "breaking")
    assert "published here twice" in change.why
    assert "processes each event twice" in change.why
    assert changes(tmp_path, copied, copied) == []
    late, early = '          when: "data.late"\n', '          when: "data.early"\n'
    first, _, second = copied.rpartition("        - type")
    exclusive = first + late + "        - type" + second + early
    assert ("$.id", "unknown") in {(p, v) for _, p, v, _ in changes(tmp_path, V1, exclusive)}


def test_a_second_outbox_publishing_the_same_events_under_other_ids(tmp_path: Path) -> None:
    second = V1 + (
        '  lending:\n    broker: nats\n    id: "{aggregate_id}@{version}"\n'
        + V1.replace("      BookLent:\n", "      BookLent:\n")
    )
    found = changes(tmp_path, V1, second)
    assert ("library.book-lent.v1", "$.id", "breaking", "library.loans") in found
    same_ids = V1 + "  lending:\n    broker: nats\n" + V1
    assert ("$.id", "breaking") not in {(p, v) for _, p, v, _ in changes(tmp_path, V1, same_ids)}
    other_aggregates = V1.replace("    messages:", "    aggregates: [book]\n    messages:")
    apart = other_aggregates + (
        '  lending:\n    broker: nats\n    aggregates: [dvd]\n    id: "{aggregate_id}@{version}"\n'
        + V1
    )
    assert ("$.id", "breaking") not in {
        (p, v) for _, p, v, _ in changes(tmp_path, other_aggregates, apart)
    }


def between(tmp_path: Path, old: str, new: str) -> list[Change]:
    """Two whole configs."""
    (tmp_path / "old.yaml").write_text(old)
    (tmp_path / "new.yaml").write_text(new)
    return diff(read_side(tmp_path / "old.yaml"), read_side(tmp_path / "new.yaml"))


ON = """\
database: {url: "postgresql://relay@db.invalid/app"}
brokers:
  out: %s
outboxes:
  loans:
    broker: out
    messages:
      BookLent: {type: library.book-lent.v1, destination: %s%s}
"""


def test_a_rabbitmq_routing_key_changed_is_breaking(tmp_path: Path) -> None:
    """Queues bound to the old routing key get nothing."""
    rabbit = '{type: rabbitmq, url: "amqp://guest:guest@rabbit.invalid:5672/"}'
    old = ON % (rabbit, "library", "")
    keyed = ON % (rabbit, "library", ', routing_key: "loans.{aggregate_type}"')
    (change,) = between(tmp_path, old, keyed)
    assert (change.path, change.verdict) == ("$.routingKey", "breaking")
    assert "queues bound to `library.book-lent.v1` no longer receive them" in change.why
    same = ON % (rabbit, "library", ", routing_key: library.book-lent.v1")
    assert between(tmp_path, old, same) == []
    spelled = ON % (rabbit, "library", ', routing_key: "loans.{@.aggregate_type}"')
    assert between(tmp_path, keyed, spelled) == []


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("https://hooks.example.com/in/{type}", "https://hooks.example.com/in/{key}"),
        (
            "https://hooks.example.com/in/{destination}",
            "https://hooks.example.com/in/{destination}/v2",
        ),
        ("https://hooks.example.com/in/{type}?v=1", "https://hooks.example.com/in/{type}?w=1"),
        ("https://hooks.example.com/in/{type}", "https://hooks.example.com/in/{type}?k={key}"),
        ("{destination}", "{destination}/v2"),
    ],
)
def test_a_webhook_url_changed_past_its_first_placeholder_is_breaking(
    tmp_path: Path, before: str, after: str
) -> None:
    destination = "https://hooks.example.com/loans" if before.startswith("{") else "loans"
    old = ON % (f'{{type: http, url: "{before}"}}', destination, "")
    new = ON % (f'{{type: http, url: "{after}"}}', destination, "")
    (change,) = between(tmp_path, old, new)
    assert (change.path, change.verdict) == ("$.channel.server", "breaking")
    assert f"the webhook URL changed from `{before.partition('?')[0]}" in change.why


def test_the_contract_keeps_no_secret_of_a_webhook_url(tmp_path: Path) -> None:
    hook = '{type: http, url: "https://user:pass@hooks.example.com/in/{type}?token=s3cret&k={key}"}'
    (tmp_path / "c.yaml").write_text(ON % (hook, "loans", ""))
    server = read_side(tmp_path / "c.yaml")["servers"]["out"]
    assert server["x-relay-url"] == "https://hooks.example.com/in/{type}?token=***&k={key}"
    assert "s3cret" not in json.dumps(server) and "pass" not in json.dumps(server)


NATS = '{type: nats, servers: ["nats://n1.invalid:4222", "nats://n2.invalid:4222"]}'


@pytest.mark.parametrize(
    ("broker", "rule"),
    [
        ('{type: nats, servers: ["nats://n2.invalid:4222", "nats://n1.invalid:4222"]}', ""),
        (NATS, ', when: "`true`"'),
        (NATS, ', key: "{@.aggregate_id}"'),
        (NATS, ', key: "{ aggregate_id }"'),
    ],
    ids=["servers reordered", "when true", "key @.", "key spaced"],
)
def test_what_is_written_another_way_changes_nothing(
    tmp_path: Path, broker: str, rule: str
) -> None:
    """False alarms: the same cluster's servers in another order, a `when` that takes every
    event, a template's placeholder written another way."""
    old = ON % (NATS, "library.loans", "")
    assert between(tmp_path, old, ON % (broker, "library.loans", rule)) == []


def test_another_cluster_is_another_server(tmp_path: Path) -> None:
    old = ON % (NATS, "library.loans", "")
    elsewhere = '{type: nats, servers: ["nats://n3.invalid:4222"]}'
    (moved,) = between(tmp_path, old, ON % (elsewhere, "library.loans", ""))
    assert (moved.path, moved.verdict) == ("$.channel.server", "breaking")
    more = '{type: nats, servers: ["nats://n2.invalid:4222", "nats://n3.invalid:4222"]}'
    assert between(tmp_path, old, ON % (more, "library.loans", "")) == []  # n2 still serves


def test_trace_context_removed_drops_optional_headers_compatibly(tmp_path: Path) -> None:
    found = changes(tmp_path, "    trace_context: true\n" + V1, V1)
    assert found and {verdict for _, _, verdict, _ in found} == {"compatible"}
    assert {path for _, path, _, _ in found} == {
        "$.headers['ce-traceparent']",
        "$.headers['ce-tracestate']",
    }
    structured = "    cloudevents: structured\n"
    found = changes(tmp_path, structured + "    trace_context: true\n" + V1, structured + V1)
    assert {(p, v) for _, p, v, _ in found} == {
        ("$.payload.traceparent", "compatible"),
        ("$.payload.tracestate", "compatible"),
    }


def test_a_reference_under_a_nested_id_is_read_where_json_schema_resolves_it(
    tmp_path: Path,
) -> None:
    """`b` is sub.json's integer in OLD, the root's string in NEW: breaking, not "no change"."""
    nested, sub = NESTED_ID, NESTED_ID_SUB
    flat = {**nested, "properties": {"a": {"type": "object", "properties": sub["properties"]}}}
    found = changes(tmp_path, SCHEMA_RULE % json.dumps(nested), SCHEMA_RULE % json.dumps(flat))
    assert ("library.book-lent.v1", "$.payload.a.b", "breaking", "library.loans") in found


def test_a_document_that_moved_a_nested_ids_reference_to_the_root_is_unknown(
    tmp_path: Path,
) -> None:
    """An older `relay contract` pointed such a `$ref` at the root's schema: the document
    states a type the relay does not check, so the comparison cannot rely on it."""
    (tmp_path / "c.yaml").write_text(HEAD + SCHEMA_RULE % json.dumps(NESTED_ID))
    document = read_side(tmp_path / "c.yaml")
    older = json.loads(json.dumps(document))
    schema = older["components"]["schemas"]["library.book-lent.v1"]
    schema["properties"]["a"]["properties"]["b"] = {
        "$ref": "#/components/schemas/library.book-lent.v1/definitions/s"
    }
    found = diff(older, document)
    assert [(c.path, c.verdict) for c in found] == [("$.payload.a.b", "unknown")]
    assert "`$id`" in found[0].why


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("{type: pubsub, project: proj-a}", "{type: pubsub, project: proj-b}"),
        ('{type: redis, url: "redis://h:6379/0"}', '{type: redis, url: "redis://h:6379/1"}'),
        ('{type: redis, url: "redis://h:6379"}', '{type: redis, url: "redis://h:6379/3"}'),
        (
            '{type: sqs, region: eu-west-1, endpoint_url: "http://aws.invalid:4566"}',
            '{type: sqs, region: eu-west-2, endpoint_url: "http://aws.invalid:4566"}',
        ),
        ('{type: rabbitmq, url: "amqp://a:5672/"}', '{type: rabbitmq, url: "amqp://a:5672/b"}'),
    ],
    ids=["pubsub project", "redis database", "redis database added", "aws region", "vhost"],
)
def test_what_else_addresses_the_destination_is_part_of_the_server(
    tmp_path: Path, before: str, after: str
) -> None:
    """A Pub/Sub project, a Redis database, an AWS region (beside a custom endpoint), a
    RabbitMQ vhost: the same destination name elsewhere, which OLD's consumers do not read."""
    (moved,) = between(tmp_path, ON % (before, "loans", ""), ON % (after, "loans", ""))
    assert (moved.path, moved.verdict) == ("$.channel.server", "breaking")


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ('{type: rabbitmq, url: "amqp://a:5672/"}', '{type: rabbitmq, url: "amqp://a:5672/%2F"}'),
        ('{type: rabbitmq, url: "amqp://a/"}', '{type: rabbitmq, url: "amqp://A:5672/"}'),
        ('{type: rabbitmq, url: "amqps://a/v"}', '{type: rabbitmq, url: "amqps://a:5671/v"}'),
        ('{type: redis, url: "redis://h"}', '{type: redis, url: "redis://H:6379/0"}'),
        ('{type: nats, servers: ["nats://n1"]}', '{type: nats, servers: ["nats://N1:4222"]}'),
        (
            '{type: kafka, bootstrap_servers: ["k1"]}',
            '{type: kafka, bootstrap_servers: ["K1:9092"]}',
        ),
        (
            '{type: http, url: "https://h/in/{type}"}',
            '{type: http, url: "HTTPS://H:443/in/{type}"}',
        ),
        ('{type: http, url: "http://h/in"}', '{type: http, url: "http://H:80/in"}'),
    ],
    ids=["vhost /", "amqp port", "amqps port", "redis", "nats", "kafka", "webhook", "webhook path"],
)
def test_the_same_address_written_another_way_changes_nothing(
    tmp_path: Path, before: str, after: str
) -> None:
    """Hosts are case-insensitive, a default port is the port, `/` and `/%2F` are vhost `/`."""
    assert between(tmp_path, ON % (before, "loans", ""), ON % (after, "loans", "")) == []


@pytest.mark.parametrize(
    ("mode", "path"),
    [("structured", "$.payload.dataschema"), ("binary", "$.headers['ce-dataschema']")],
)
def test_a_schema_id_added_sends_dataschema_compatibly_and_says_so(
    tmp_path: Path, mode: str, path: str
) -> None:
    """NEW sends a `dataschema` OLD's open schema admits: one line, about what NEW adds."""
    schema = {"type": "object", "properties": {"bookId": {"type": "string"}}}
    with_id = {"$id": "https://schemas.example.com/book-lent.v1.json", **schema}
    mode_line = f"    cloudevents: {mode}\n"
    old = mode_line + SCHEMA_RULE % json.dumps(schema)
    new = mode_line + SCHEMA_RULE % json.dumps(with_id)
    (change,) = whys(tmp_path, old, new)
    assert (change.path, change.verdict) == (path, "compatible")
    assert "is gone" not in change.why
    assert "NEW always sends it; OLD did not" in change.why
    (back,) = whys(tmp_path, new, old)  # the $id removed: OLD's consumers read dataschema
    assert (back.path, back.verdict) == (path, "breaking")
    assert "is gone; OLD requires it" in back.why
