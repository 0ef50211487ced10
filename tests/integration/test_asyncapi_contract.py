"""`relay contract`: the AsyncAPI document, checked by the official parser as consumers' tools
would read it, and the command used as an operator would (a process, its files and exit codes).

The parser (`@asyncapi/parser`, pinned in tests/support/asyncapi_parser/) is installed by
the tests themselves with npm; without Node.js they fail, saying how to get it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from relay.asyncapi import render
from relay.asyncapi.view import outbox_views
from relay.config import load_config
from relay.core.publishing import Message, to_structured
from tests.support.asyncapi import NodeMissing, diagnostics, install_parser, problems
from tests.support.contract_views import BOOK_LENT_V2_SCHEMA, BROKERS, document, outbox, rule
from tests.support.relay_process import run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "relay.example.yaml"
SECRET = "Xk7Tq2Zp9Wm4"
ENV = {"DATABASE_URL": "postgresql://relay@127.0.0.1:1/app", "RELAY_SECRET": SECRET}

# Every broker, templates in destinations and routing keys, and a password wherever the config
# takes one (in URLs, as fields, from the environment).
EVERY_BROKER = """\
database:
  url: postgresql://relay:${RELAY_SECRET}@db.internal:5432/library
brokers:
  nats:
    type: nats
    servers: ["nats://relay:${RELAY_SECRET}@nats-1.internal:4222", "tls://nats-2.internal:4222"]
    user: relay
    password: ${RELAY_SECRET}
    stream: {name: LIBRARY, subjects: ["library.>"]}
  kafka:
    type: kafka
    bootstrap_servers: ["kafka-1.internal:9093", "kafka-2.internal:9093"]
    security_protocol: SASL_SSL
    sasl_mechanism: SCRAM-SHA-512
    sasl_username: relay
    sasl_password: ${RELAY_SECRET}
  rabbit:
    type: rabbitmq
    url: amqps://relay:${RELAY_SECRET}@rabbit.internal:5671/library
    declare_exchanges: [{name: library, type: topic}]
  sqs:
    type: sqs
    region: eu-west-1
    endpoint_url: http://relay:${RELAY_SECRET}@localhost:4566
  pubsub:
    type: pubsub
    project: library-prod
  redis:
    type: redis
    url: rediss://redis.internal:6380/2
    username: relay
    password: ${RELAY_SECRET}
  hooks:
    type: http
    url: "https://relay:${RELAY_SECRET}@hooks.internal/in/{destination}?token=${RELAY_SECRET}"
    headers: {Authorization: "Bearer ${RELAY_SECRET}"}
    signing_keys: ["whsec_${RELAY_SECRET}${RELAY_SECRET}${RELAY_SECRET}"]
  sns:
    type: sns
    region: eu-west-1
  kinesis:
    type: kinesis
    region: eu-west-1
outboxes:
  loans:
    broker: nats
    aggregates: [book]
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: "library.{aggregate_type}.{aggregate_id}.lent"
        payload: {bookId: aggregate_id, loanId: data.loanId, version: version}
      BookReturned:
        type: library.book-returned.v1
        destination: "library.{aggregate_type}.{data.branch}.returned"
        payload: "{bookId: aggregate_id, late: data.late, at: created_at}"
  members:
    broker: kafka
    key: "{data.memberId}"
    messages:
      MemberJoined:
        type: library.member-joined.v1
        destination: "members.{aggregate_id}"
        payload: "merge(data, {memberId: aggregate_id})"
      MemberLeft:
        type: library.member-left.v1
        destination: members
  loans-rabbit:
    broker: rabbit
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: library
        routing_key: "loans.{aggregate_type}"
        payload: {bookId: aggregate_id, loanId: data.loanId, version: version}
      FineCharged:
        type: library.fine-charged.v1
        destination: library
  fines:
    broker: sqs
    messages:
      FineCharged:
        type: library.fine-charged.v1
        destination: "fines-{aggregate_type}.fifo"
        payload: "{amount: to_number(data.amount), paid: data.paid == `true`}"
      FinePaid:
        type: library.fine-paid.v1
        destination: https://sqs.eu-west-1.amazonaws.com/123456789012/fines
  holds:
    broker: pubsub
    messages:
      HoldPlaced:
        type: library.hold-placed.v1
        destination: "holds-{aggregate_type}"
        payload: {bookId: aggregate_id, memberId: data.memberId}
  renewals:
    broker: redis
    messages:
      LoanRenewed:
        type: library.loan-renewed.v1
        destination: "library.renewals.{aggregate_type}"
        payload: {bookId: aggregate_id, until: data.until}
  reminders:
    broker: hooks
    messages:
      ReminderSent:
        type: library.reminder-sent.v1
        destination: "reminders/{aggregate_type}"
  notices:
    broker: sns
    messages:
      BookOverdue:
        type: library.book-overdue.v1
        destination: arn:aws:sns:eu-west-1:123456789012:notices.fifo
  visits:
    broker: kinesis
    messages:
      MemberVisited:
        type: library.member-visited.v1
        destination: "visits-{aggregate_type}"
"""


@pytest.fixture(scope="module")
def parser() -> Path:
    """The validator script, with the parser installed beside it (a failure, never a skip)."""
    try:
        return install_parser()
    except NodeMissing as exc:
        missing = str(exc)
    pytest.fail(missing, pytrace=False)


def assert_valid(parser: Path, path: Path, text: str | None = None) -> None:
    """No error and no warning from the official parser (for `text`, written to `path`)."""
    if text is not None:
        path.write_text(text)
    found = problems(diagnostics(parser, [path]))
    assert not found, json.dumps(found, indent=2)


def contract(args: list[str]) -> tuple[int, str, str]:
    result = run_cli(["contract", *args], env=ENV)
    return result.returncode, result.stdout, result.stderr


def assert_hidden(text: str) -> None:
    """No 3-character piece of the password, as in tests/integration/test_secrets.py."""
    leaked = sorted({SECRET[i : i + 3] for i in range(len(SECRET) - 2)} & _pieces(text))
    assert not leaked, f"pieces {leaked} of the password are in the output"


def _pieces(text: str) -> set[str]:
    return {text[i : i + 3] for i in range(len(text) - 2)}


@pytest.mark.integration  # runs Node.js
def test_the_example_config_gives_a_valid_document(parser: Path, tmp_path: Path) -> None:
    code, out, err = contract(["--config", str(EXAMPLE)])
    assert code == 0, err
    doc = YAML(typ="safe").load(out)
    assert doc["asyncapi"] == "3.0.0"
    (url,) = YAML(typ="safe").load(EXAMPLE.read_text())["brokers"]["nats"]["servers"]
    assert doc["servers"]["nats"] == {
        "host": url.removeprefix("nats://"),
        "protocol": "nats",
        "title": "NATS JetStream",
    }
    channel = doc["channels"]["library.loans"]
    assert channel["address"] == "library.loans"
    assert list(channel["messages"]) == ["library.book-lent.v1", "library.book-returned.v1"]
    lent = doc["components"]["messages"]["library.book-lent.v1"]
    assert lent["headers"]["properties"]["ce-type"] == {"const": "library.book-lent.v1"}
    assert doc["components"]["schemas"]["library.book-lent.v1"]["required"] == [
        "bookId",
        "loanId",
        "memberId",
    ]
    assert_valid(parser, tmp_path / "asyncapi.yaml", out)


@pytest.mark.integration  # runs Node.js
def test_every_broker_with_templates_gives_a_valid_document_without_credentials(
    parser: Path, tmp_path: Path
) -> None:
    config = tmp_path / "relay.yaml"
    config.write_text(EVERY_BROKER)
    written = tmp_path / "out" / "asyncapi.yaml"
    written.parent.mkdir()
    code, out, err = contract(["--config", str(config), "--output", str(written)])
    assert code == 0, err
    assert out == ""
    assert f"wrote {written}" in err
    text = written.read_text()
    assert_hidden(text + out + err)
    assert "relay:" not in text  # no user part of any URL either
    doc = YAML(typ="safe").load(text)
    servers = doc["servers"]
    schemes = doc["components"]["securitySchemes"]
    assert {name: (s["host"], s["protocol"]) for name, s in servers.items()} == {
        "nats": ("nats-1.internal:4222", "nats"),
        "kafka": ("kafka-1.internal:9093", "kafka-secure"),
        "rabbit": ("rabbit.internal:5671", "amqps"),
        "sqs": ("localhost:4566", "sqs"),
        "pubsub": ("pubsub.googleapis.com:443", "googlepubsub"),
        "redis": ("redis.internal:6380", "rediss"),
        "hooks": ("hooks.internal", "https"),
        "sns": ("sns.eu-west-1.amazonaws.com", "sns"),
        "kinesis": ("kinesis.eu-west-1.amazonaws.com", "kinesis"),
    }
    assert schemes["redis-user-password"]["type"] == "userPassword"
    assert "nats-2.internal:4222" in servers["nats"]["description"]
    assert schemes["kafka-sasl"] == {"type": "scramSha512"}
    assert schemes["nats-user-password"] == {"type": "userPassword"}
    assert schemes["hooks-header-authorization"] == {
        "type": "httpApiKey",
        "name": "Authorization",
        "in": "header",
    }

    channels = {c["title"]: c for c in doc["channels"].values()}
    lent = channels["library.{aggregate_type}.{aggregate_id}.lent"]
    assert lent["parameters"]["aggregate_type"]["enum"] == ["book"]
    assert lent["parameters"]["aggregate_id"]["location"] == "$message.payload#/bookId"
    assert channels["members"]["bindings"]["kafka"]["topic"] == "members"
    assert channels["library"]["bindings"]["amqp"]["exchange"]["vhost"] == "library"
    queue = channels["fines-{aggregate_type}.fifo"]["bindings"]["sqs"]["queue"]
    assert queue == {"name": "fines-{aggregate_type}.fifo", "fifoQueue": True}
    assert channels["https://sqs.eu-west-1.amazonaws.com/123456789012/fines"]["bindings"]["sqs"][
        "queue"
    ] == {"name": "fines", "fifoQueue": False}
    holds = channels["holds-{aggregate_type}"]
    assert "bindings" not in holds  # Pub/Sub's channel binding needs a topic schema
    assert "ordering key" in holds["description"]
    topic = channels["arn:aws:sns:eu-west-1:123456789012:notices.fifo"]["bindings"]["sns"]
    assert topic == {
        "name": "notices.fifo",
        "ordering": {"type": "FIFO"},
        "bindingVersion": "0.1.0",
    }

    operations = {op["title"]: op for op in doc["operations"].values()}
    assert operations["Publish to library"]["bindings"]["amqp"]["cc"] == [
        "loans.{aggregate_type}",
        "library.fine-charged.v1",
    ]
    messages = doc["components"]["messages"]
    assert (
        "`{data.memberId}`"
        in messages["library.member-joined.v1"]["bindings"]["kafka"]["key"]["description"]
    )
    assert messages["library.hold-placed.v1"]["bindings"]["googlepubsub"] == {
        "orderingKey": "{aggregate_id}",
        "bindingVersion": "0.2.0",
    }
    assert set(messages) == {
        "library.book-lent.v1",
        "library.book-returned.v1",
        "library.member-joined.v1",
        "library.member-left.v1",
        "library.book-lent.v1.rabbit",
        "library.fine-charged.v1",
        "library.fine-charged.v1.sqs",
        "library.fine-paid.v1",
        "library.hold-placed.v1",
        "library.loan-renewed.v1",
        "library.reminder-sent.v1",
        "library.book-overdue.v1",
        "library.member-visited.v1",
    }
    assert "headers" not in messages["library.member-visited.v1"]  # Kinesis: whole events
    renewals = channels["library.renewals.{aggregate_type}"]
    assert "A Redis stream" in renewals["description"]
    renewed = messages["library.loan-renewed.v1"]["headers"]["properties"]
    assert renewed["ce_type"] == {"const": "library.loan-renewed.v1"}
    reminded = messages["library.reminder-sent.v1"]["headers"]["required"]
    assert {"webhook-id", "webhook-timestamp", "ce-id"} <= set(reminded)
    assert (
        operations["Publish to reminders/{aggregate_type}"]["bindings"]["http"]["method"] == "POST"
    )
    assert_valid(parser, written)


@pytest.mark.integration  # runs Node.js
def test_json_is_the_same_document(parser: Path, tmp_path: Path) -> None:
    code, as_json, err = contract(["-c", str(EXAMPLE), "--format", "json"])
    assert code == 0, err
    code, as_yaml, err = contract(["-c", str(EXAMPLE)])
    assert code == 0, err
    assert json.loads(as_json) == YAML(typ="safe").load(as_yaml)
    assert_valid(parser, tmp_path / "asyncapi.json", as_json)


@pytest.mark.integration  # runs Node.js
def test_rules_schemas_and_cloudevents_modes_give_valid_documents(
    parser: Path, tmp_path: Path
) -> None:
    """What the config cannot say yet, built from views: the parser must accept it too."""
    rules = [
        ("BookLent", rule("library.book-lent.v1", "library.loans.{aggregate_id}")),
        ("BookLent", rule("library.book-lent.v2", "library.loans.v2", schema=BOOK_LENT_V2_SCHEMA)),
        ("BookLent", rule("library.book-lent.v1", "priority", when="data.priority == 'high'")),
    ]
    files = []
    for mode in ("binary", "structured"):
        doc = document(
            *(
                outbox(rules, broker, cloudevents=mode, trace_context=True)
                for broker in (
                    "nats",
                    "kafka",
                    "rabbit",
                    "sqs",
                    "pubsub",
                    "redis",
                    "http",
                    "sns",
                    "kinesis",
                )
            )
        )
        path = tmp_path / f"{mode}.yaml"
        path.write_text(render(doc, "yaml"))
        files.append(path)
    found = problems(diagnostics(parser, files))
    assert not found, json.dumps(found, indent=2)


def test_bad_usage_is_a_clear_error(tmp_path: Path) -> None:
    code, out, err = contract(["-c", str(EXAMPLE), "--format", "xml"])
    assert code == 2
    words = " ".join(err.replace("│", " ").split())  # typer draws a box and wraps lines
    assert "Invalid value for '--format' / '-f'" in words
    assert "'xml' is not one of 'yaml', 'json'" in words
    assert out == ""

    code, _, err = contract([])
    assert code == 2
    assert "no config file: pass --config FILE or set RELAY_CONFIG" in err

    missing_dir = tmp_path / "no-such-dir" / "asyncapi.yaml"
    code, _, err = contract(["-c", str(EXAMPLE), "-o", str(missing_dir)])
    assert code == 2
    assert f"cannot write {missing_dir}: No such file or directory" in err

    broken = tmp_path / "relay.yaml"
    broken.write_text(EVERY_BROKER.replace("destination: members\n", "destination: 'm.{'\n"))
    code, _, err = contract(["-c", str(broken)])
    assert code == 2
    assert "outboxes.members.messages.MemberLeft.destination: unbalanced brace" in err
    assert "relay.yaml:" in err
    assert_hidden(err)


def _message(**fields: Any) -> Message:
    defaults: dict[str, Any] = {
        "id": "book/book-1@2",
        "type": "library.book-lent.v1",
        "destination": "library.loans",
        "key": "book-1",
        "body": b"{}",
        "source": "/outbox-relay/nats-outbox",
        "time": datetime(2026, 11, 30, tzinfo=UTC),
        "position": 2,
    }
    return Message(**{**defaults, **fields})


def sent_headers(
    broker: str, message: Message | None = None, prefix: str = "cloudEvents:"
) -> set[str]:
    """The header names each adapter really writes (SQS, SNS: message attribute names)."""
    message = message or _message()
    if broker == "nats":
        from relay.brokers.nats import message_headers as nats_headers

        return set(nats_headers(message))
    if broker == "kafka":
        from relay.brokers.kafka import message_headers as kafka_headers

        return {name for name, _ in kafka_headers(message)}
    if broker == "rabbit":
        from relay.brokers.rabbitmq import _properties

        return set(_properties(message, prefix).headers or {})
    if broker == "pubsub":
        from relay.brokers.pubsub import message_attributes as pubsub_attributes

        return set(pubsub_attributes(message))
    if broker == "redis":
        from relay.brokers.redis import message_fields

        return set(message_fields(message))
    if broker == "http":
        from relay.brokers.http import HttpPublisher

        publisher = HttpPublisher("b", BROKERS["http"])  # type: ignore[arg-type]
        return set(publisher.headers(message))
    from relay.brokers._aws import message_attributes

    return set(message_attributes(message))


@pytest.mark.parametrize(
    "broker", ["nats", "kafka", "rabbit", "sqs", "pubsub", "redis", "http", "sns"]
)
def test_the_headers_in_the_contract_are_the_ones_the_adapters_send(broker: str) -> None:
    doc = document(outbox([("BookLent", rule("library.book-lent.v1"))], broker))
    (message,) = doc["components"]["messages"].values()
    assert set(message["headers"]["properties"]) == sent_headers(broker)


@pytest.mark.parametrize(
    "broker", ["nats", "kafka", "rabbit", "sqs", "pubsub", "redis", "http", "sns"]
)
@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_trace_context_modes_and_header_styles_match_the_adapters(broker: str, mode: str) -> None:
    """With trace context (a message that has it), each mode, RabbitMQ's `ce` style."""
    prefix = "ce-" if broker == "rabbit" else "cloudEvents:"
    view = outbox(
        [("BookLent", rule("library.book-lent.v1"))],
        broker,
        cloudevents=mode,
        trace_context=True,
        amqp_prefix=prefix,
    )
    (message,) = document(view)["components"]["messages"].values()
    sent = _message(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    sent.tracestate = "congo=t61rcWkgMzE"
    if mode == "structured":
        to_structured(sent)
    assert set(message["headers"]["properties"]) == sent_headers(broker, sent, prefix)


def test_the_config_reaches_the_contract_view(tmp_path: Path) -> None:
    """`cloudevents`, `trace_context` and RabbitMQ's `cloudevents_headers` shape the document."""
    path = tmp_path / "relay.yaml"
    path.write_text(
        "database: {url: 'postgresql://localhost/db'}\n"
        "brokers:\n"
        "  rabbit: {type: rabbitmq, url: 'amqp://guest:guest@rabbit.invalid/',"
        " cloudevents_headers: ce}\n"
        "outboxes:\n"
        "  loans:\n"
        "    broker: rabbit\n"
        "    cloudevents: structured\n"
        "    trace_context: true\n"
        "    messages: {BookLent: {type: library.book-lent.v1, destination: library}}\n"
    )
    (view,) = outbox_views(load_config(path))
    assert (view.cloudevents, view.trace_context, view.amqp_prefix) == ("structured", True, "ce-")
