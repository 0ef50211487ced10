"""Config files: the example loads as written; every bad file names its key and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from relay.config import (
    KafkaBrokerConfig,
    NatsBrokerConfig,
    RabbitMqBrokerConfig,
    RelayConfig,
    load_config,
)
from relay.config.yaml_file import expand_vars
from relay.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "relay.example.yaml"

GOOD = """\
database:
  url: postgresql://relay:s3cret@db/app
brokers:
  nats:
    type: nats
    servers: ["nats://127.0.0.1:4222"]
outboxes:
  loans-outbox:
    broker: nats
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: library.loans
        payload:
          loanId: data.loanId
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


def test_example_config_loads_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://postgres@127.0.0.1/postgres")
    config = load_config(EXAMPLE)
    outbox = config.outboxes["loans-outbox"]
    assert outbox.aggregates == ["book"]
    (rule,) = outbox.rules("loans-outbox")["BookLent"]
    assert rule.config.payload == {
        "bookId": "aggregate_id",
        "loanId": "data.loanId",
        "memberId": "data.memberId",
    }
    assert outbox.batch.max_messages == 500
    assert outbox.batch.linger == pytest.approx(0.010)
    assert outbox.retry.initial == pytest.approx(0.1)
    assert outbox.retry.max == pytest.approx(30.0)
    assert outbox.park_after == 10
    assert outbox.id == "{aggregate_type}/{aggregate_id}@{version}"
    assert config.source.columns.created_at == "created_at"


def test_config_is_frozen(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    with pytest.raises(ValidationError):
        config.outboxes["loans-outbox"].park_after = 3  # type: ignore[misc]


def test_durations_parse(tmp_path: Path) -> None:
    text = GOOD + "    batch: {linger: 250ms}\n    retry: {initial: 2s, max: 1m}\n"
    outbox = load_config(write(tmp_path, text)).outboxes["loans-outbox"]
    assert outbox.batch.linger == pytest.approx(0.25)
    assert outbox.retry.initial == pytest.approx(2.0)
    assert outbox.retry.max == pytest.approx(60.0)


def test_batch_max_bytes_takes_sizes_and_names_a_bad_one(tmp_path: Path) -> None:
    outbox = load_config(write(tmp_path, GOOD)).outboxes["loans-outbox"]
    assert outbox.batch.max_bytes == 4 * 1024 * 1024  # the default bounds memory
    sized = load_config(write(tmp_path, GOOD + "    batch: {max_bytes: 512KiB}\n"))
    assert sized.outboxes["loans-outbox"].batch.max_bytes == 512 * 1024
    error = error_of(tmp_path, GOOD + "    batch: {max_bytes: 4 parsecs}\n")
    assert "outboxes.loans-outbox.batch.max_bytes" in error
    assert "'4 parsecs' is not a size" in error


def test_environment_expansion_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_HOST", "nats.internal")
    monkeypatch.delenv("NATS_PORT", raising=False)
    text = GOOD.replace('["nats://127.0.0.1:4222"]', '["nats://${NATS_HOST}:${NATS_PORT:-4222}"]')
    config = load_config(write(tmp_path, text))
    nats = config.brokers["nats"]
    assert isinstance(nats, NatsBrokerConfig)
    assert nats.servers == ["nats://nats.internal:4222"]


def test_relay_env_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DATABASE__URL", "postgresql://other@db2/app")
    monkeypatch.setenv("RELAY_LOGGING__LEVEL", "debug")
    config = load_config(write(tmp_path, GOOD))
    assert config.database.url.get_secret_value() == "postgresql://other@db2/app"
    assert config.logging.level == "debug"


def test_config_file_named_in_relay_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_CONFIG", str(write(tmp_path, GOOD)))
    assert "loans-outbox" in load_config().outboxes


def test_secret_is_not_in_repr(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert "s3cret" not in repr(config)
    assert "s3cret" not in str(config.model_dump())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            GOOD.replace("        destination:", "        destinaton:"),
            ["relay.yaml:13:", "outboxes.loans-outbox.messages.BookLent.destinaton: unknown key"],
        ),
        (
            GOOD.replace("loanId: data.loanId", "loanId: data.[loanId"),
            [
                "relay.yaml:15:",
                "outboxes.loans-outbox.messages.BookLent.payload.loanId: invalid JMESPath",
            ],
        ),
        (
            GOOD.replace("loanId: data.loanId", "loanId: '[data.loanId, `1e400`]'"),
            [
                "relay.yaml:15:",
                "outboxes.loans-outbox.messages.BookLent.payload.loanId: invalid JMESPath",
                "a literal number beyond a float's range (JSON has no Infinity)",
            ],
        ),
        (
            GOOD + "    batch:\n      linger: soon\n",
            ["relay.yaml:17:", "outboxes.loans-outbox.batch.linger", "not a duration"],
        ),
        (
            GOOD.replace("broker: nats", "broker: kafka"),
            ["outboxes.loans-outbox.broker: unknown broker 'kafka'"],
        ),
        (
            GOOD.replace("type: nats", "type: carrier-pigeon"),
            ["relay.yaml:5:", "brokers.nats.type"],
        ),
        (
            GOOD.replace("database:\n  url: postgresql://relay:s3cret@db/app\n", ""),
            ["database: required key is missing"],
        ),
        (
            GOOD + "    park_after: 0\n",
            ["relay.yaml:16:", "outboxes.loans-outbox.park_after", "greater than or equal to 1"],
        ),
        (
            GOOD.replace("destination: library.loans", "destination: library.{aggregate_type"),
            ["outboxes.loans-outbox.messages.BookLent.destination", "unbalanced brace"],
        ),
        (
            GOOD + "source:\n  columns:\n    position: 'pos; drop table x'\n",
            ["source.columns.position"],
        ),
        (GOOD + "  - not: a mapping\n", ["relay.yaml:", "invalid YAML"]),
        (
            GOOD.replace("postgresql://relay:s3cret@db/app", "${NO_SUCH_VARIABLE_XYZ}"),
            ["relay.yaml:2:", "database.url", "NO_SUCH_VARIABLE_XYZ is not set"],
        ),
    ],
    ids=[
        "unknown-key",
        "bad-jmespath",
        "infinite-literal",
        "bad-duration",
        "unknown-broker",
        "unknown-broker-type",
        "missing-database",
        "park-after-zero",
        "bad-template",
        "unsafe-column-name",
        "broken-yaml",
        "unset-env-var",
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = error_of(tmp_path, text)
    for fragment in expected:
        assert fragment in message, message
    assert "s3cret" not in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_no_config_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAY_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="--config"):
        load_config(None)


def test_model_rejects_unknown_top_level_key(tmp_path: Path) -> None:
    message = error_of(tmp_path, GOOD + "extra_section: {}\n")
    assert "extra_section: unknown key" in message
    assert RelayConfig.model_config["frozen"] is True


# -- database.url ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:s3cret@db/app",
        "postgres://db",
        "postgresql://",
        "postgresql:///app?host=/var/run/postgresql",
        "postgresql://%2Fvar%2Frun%2Fpostgresql/app",
        "postgresql://[::1]:5432/app",
        "postgresql://h1:5432,h2:5433/app?target_session_attrs=read-write",
        "postgresql://h1,[::1]:5433/app?target_session_attrs=primary",
        "postgresql://relay@db:5432/app?sslmode=verify-full&sslrootcert=/etc/relay/ca.pem",
        "postgresql://:5433/app",
        "postgresql://relay:s3cret:more@db/app",
        "postgresql://relay:s3cret@db/app?application_name=x&port=5433",
    ],
)
def test_valid_database_urls_load(tmp_path: Path, url: str) -> None:
    config = load_config(write(tmp_path, GOOD.replace("postgresql://relay:s3cret@db/app", url)))
    assert config.database.url.get_secret_value() == url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mysql://relay:s3cret@db/app", "must start with postgresql:// or postgres://"),
        ("db:5432/app", "must start with postgresql:// or postgres://"),
        ("host=db password=s3cret dbname=app", "write it as a postgresql:// URL"),
        ("postgresql://relay:s3cret@db:0/app", "port"),
        ("postgresql://relay:s3cret@db:65536/app", "port"),
        ("postgresql://relay:s3cret@db:54x/app", "port"),
        ("postgresql://relay:s3cret@d!b/app", "host"),
        ("postgresql://relay:s3cret@[::1/app", "host"),
        ("postgresql://relay:s3cret@db/app#top", "#"),
        ("postgresql://relay:s3cret@db/app?sslmode", "query"),
        ("postgresql://relay:s3cret@db/app?port=x", "port"),
        (
            "postgresql://relay:s3cret@db/app?sslmode=bogus",
            "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full",
        ),
        (
            "postgresql://relay:s3cret@h1,h2/app?target_session_attrs=prefer-standby",
            "target_session_attrs=prefer-standby is not for the relay, which writes on every"
            " connection and so always connects to the primary",
        ),
        ("postgresql://db/app?target_session_attrs=standby", "one of primary, read-write, any"),
        ("postgresql://db/app?target_session_attrs=read-only", "one of primary, read-write, any"),
    ],
)
def test_bad_database_url_is_a_config_error(tmp_path: Path, url: str, expected: str) -> None:
    message = error_of(tmp_path, GOOD.replace("postgresql://relay:s3cret@db/app", url))
    assert "relay.yaml:2: database.url:" in message
    assert expected in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:guest@127.0.0.1:5672/",
        "amqps://relay:s3cret@rabbit.internal:5671/%2F",
        "amqp://rabbit?heartbeat=30",
        "amqp://relay:p%2Fw%40x@rabbit/library",
    ],
)
def test_valid_rabbitmq_urls_load(tmp_path: Path, url: str) -> None:
    text = GOOD.replace(
        '    type: nats\n    servers: ["nats://127.0.0.1:4222"]\n',
        f"    type: rabbitmq\n    url: {url}\n",
    )
    broker = load_config(write(tmp_path, text)).brokers["nats"]
    assert isinstance(broker, RabbitMqBrokerConfig)
    assert broker.url.get_secret_value() == url


def test_rabbitmq_tls_needs_amqps(tmp_path: Path) -> None:
    text = GOOD.replace(
        '    type: nats\n    servers: ["nats://127.0.0.1:4222"]\n',
        "    type: rabbitmq\n    url: amqp://rabbit/\n    tls: {}\n",
    )
    assert "relay.yaml:7: brokers.nats.tls: needs an amqps:// url" in error_of(tmp_path, text)
    assert load_config(write(tmp_path, text.replace("amqp://", "amqps://")))


# -- ${VAR} expansion -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A:-${B}}", {"B": "b"}, "b"),
        ("${A:-${B}}", {"A": "a"}, "a"),  # B unset: the default is not needed, not looked at
        ("${A:-${B}}", {"A": "", "B": "b"}, "b"),
        ("${A:-${B:-x}}", {}, "x"),
        ("${A:-${B:-${C:-deep}}}", {}, "deep"),
        ("${A:-pre-${B:-x}-post}", {}, "pre-x-post"),
        ("${A:-${B:-x}}/${C:-y}", {"C": "c"}, "x/c"),
        ("$${A:-${B}}", {"B": "b"}, "${A:-b}"),
        ("${A:-$$}", {}, "$"),
        ("${A:-a$${B}}", {}, "a${B}"),
        ("cost: $$5", {}, "cost: $5"),
        ("$HOME and $ alone", {}, "$HOME and $ alone"),
        ("${ID:-{aggregate_id}}", {}, "{aggregate_id}"),
        ("${A}", {"A": "${B}"}, "${B}"),  # a value is never expanded again
    ],
)
def test_nested_defaults_expand(text: str, env: dict[str, str], expected: str) -> None:
    def missing(name: str) -> ConfigError:
        return ConfigError(f"{name} is not set")

    assert expand_vars(text, env, missing) == expected


def test_nested_default_in_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER_XYZ", raising=False)
    monkeypatch.setenv("NATS_FALLBACK_XYZ", "nats://fallback:4222")
    text = GOOD.replace('["nats://127.0.0.1:4222"]', '["${NATS_SERVER_XYZ:-${NATS_FALLBACK_XYZ}}"]')
    config = load_config(write(tmp_path, text))
    assert config.brokers["nats"].servers == ["nats://fallback:4222"]  # type: ignore[union-attr]


def test_missing_variable_in_a_nested_default_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NATS_SERVER_XYZ", raising=False)
    monkeypatch.delenv("NATS_FALLBACK_XYZ", raising=False)
    text = GOOD.replace('["nats://127.0.0.1:4222"]', '["${NATS_SERVER_XYZ:-${NATS_FALLBACK_XYZ}}"]')
    message = error_of(tmp_path, text)
    assert "relay.yaml:6: brokers.nats.servers.0: environment variable NATS_FALLBACK_XYZ" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("postgresql://relay:s3cret${PGPASS@db/app", "unterminated ${"),
        ("${DATABASE_URL:-${FALLBACK}", "unterminated ${"),
        ("${DATABASE_URL", "unterminated ${"),
        ("postgresql://relay:s3cret${}@db/app", "variable name"),
        ("postgresql://relay:s3cret${9X}@db/app", "variable name"),
        ("${DATABASE_URL:postgresql://relay:s3cret@db/app}", "variable name"),
    ],
)
def test_bad_expansion_names_file_line_and_key(tmp_path: Path, value: str, expected: str) -> None:
    message = error_of(tmp_path, GOOD.replace("postgresql://relay:s3cret@db/app", value))
    assert message.startswith(f"{tmp_path / 'relay.yaml'}:2: database.url: "), message
    assert expected in message
    assert "$$" in message  # how to write a literal dollar
    assert "s3cret" not in message


# -- source.poll_interval and warnings -------------------------------------------------------


@pytest.mark.parametrize("interval", ["1ms", "9ms", "500us", "0.005"])
def test_poll_interval_has_a_floor(tmp_path: Path, interval: str) -> None:
    message = error_of(tmp_path, GOOD + f"source:\n  poll_interval: {interval}\n")
    assert "relay.yaml:17: source.poll_interval:" in message
    assert "at least 10ms" in message
    assert "source.notify_trigger" in message


def test_poll_interval_floor_applies_to_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_SOURCE__POLL_INTERVAL", "2ms")
    message = error_of(tmp_path, GOOD)
    assert "poll_interval" in message
    assert "at least 10ms" in message


def test_poll_interval_of_10ms_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD + "source:\n  poll_interval: 10ms\n"))
    assert config.source.poll_interval == pytest.approx(0.010)


def test_default_config_has_no_warnings(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, GOOD)).warnings() == []


@pytest.mark.parametrize(("settings", "passes"), [("50ms", "about 17"), ("20ms", "about 33")])
def test_short_poll_without_notify_trigger_warns(
    tmp_path: Path, settings: str, passes: str
) -> None:
    config = load_config(write(tmp_path, GOOD + f"source:\n  poll_interval: {settings}\n"))
    (warning,) = config.warnings()
    assert "source.poll_interval" in warning
    assert f"{passes} barrier passes a second" in warning
    assert "source.notify_trigger" in warning


def test_short_poll_warning_counts_linger_and_outboxes(tmp_path: Path) -> None:
    text = GOOD + "    batch: {linger: 0}\n" + "source:\n  poll_interval: 10ms\n"
    (warning,) = load_config(write(tmp_path, text)).warnings()
    assert "about 100 barrier passes a second" in warning
    two = text.replace(
        "outboxes:\n",
        "outboxes:\n  other:\n    broker: nats\n"
        "    messages: {BookReturned: {type: t, destination: d}}\n",
    )
    (warning,) = load_config(write(tmp_path, two)).warnings()
    assert "about 100 barrier passes a second (2 outboxes: about 200)" in warning


def test_short_poll_with_notify_trigger_warns_that_it_is_only_a_fallback(tmp_path: Path) -> None:
    text = GOOD + "source:\n  poll_interval: 50ms\n  notify_trigger: true\n"
    (warning,) = load_config(write(tmp_path, text)).warnings()
    assert "fallback" in warning
    assert "source.poll_interval" in warning


def test_poll_of_100ms_without_trigger_does_not_warn(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD + "source:\n  poll_interval: 100ms\n"))
    assert config.warnings() == []


# -- two outboxes publishing the same ids ---------------------------------------------------

TWO_OUTBOXES = """\
database:
  url: postgresql://relay:s3cret@db/app
brokers:
  nats:
    type: nats
    servers: ["nats://127.0.0.1:4222"]
  other:
    type: nats
    servers: ["nats://127.0.0.1:4223"]
outboxes:
  loans-v1:
    broker: nats
    messages:
      BookLent:
        type: library.book-lent.v1
        destination: library.loans
  loans-v2:
    broker: nats
    messages:
      BookLent:
        type: library.book-lent.v2
        destination: library.loans
"""


def test_two_outboxes_with_the_same_ids_to_one_destination_are_refused(tmp_path: Path) -> None:
    message = error_of(tmp_path, TWO_OUTBOXES)
    assert "relay.yaml:20: outboxes.loans-v2.messages.BookLent:" in message
    for fragment in (
        "loans-v1",
        "loans-v2",
        "BookLent",
        "'library.loans'",
        "'{aggregate_type}/{aggregate_id}@{version}'",
        "broker 'nats'",
        "duplicate",
        "different `id` template",
    ):
        assert fragment in message, message


def test_a_backfill_outbox_with_the_same_rule_and_ids_is_accepted(tmp_path: Path) -> None:
    """contracts.md, step 3: a temporary outbox with only the v2 rule and the v2 rule's id
    re-sends v2's messages as they are; a broker dropping one copy loses nothing."""
    lists = TWO_OUTBOXES.replace(
        "      BookLent:\n        type: library.book-lent.v1\n        destination: library.loans\n",
        "      BookLent:\n        - type: library.book-lent.v1\n"
        "          destination: library.loans\n"
        "        - type: library.book-lent.v2\n          destination: library.loans.v2\n",
    )
    backfill = lists.replace(
        "        type: library.book-lent.v2\n        destination: library.loans\n",
        "        type: library.book-lent.v2\n        destination: library.loans.v2\n"
        "        id: '{aggregate_type}/{ aggregate_id }@{version}/library.book-lent.v2'\n",
    )
    assert set(load_config(write(tmp_path, backfill)).outboxes) == {"loans-v1", "loans-v2"}
    other_payload = backfill.replace(
        "destination: library.loans.v2\n        id:",
        "destination: library.loans.v2\n        payload: data.member\n        id:",
    )
    assert "duplicate" in error_of(tmp_path, other_payload)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        # loans-v2 sets an outbox-level id, but its message takes loans-v1's id back.
        (
            (
                "  loans-v2:\n    broker: nats\n",
                "  loans-v2:\n    broker: nats\n    id: '{aggregate_id}/v2'\n",
            ),
            "relay.yaml:23: outboxes.loans-v2.messages.BookLent.id:",
        ),
        # Both set the same id at outbox level.
        (
            ("    broker: nats\n", "    broker: nats\n    id: '{aggregate_id}@{version}'\n"),
            "relay.yaml:20: outboxes.loans-v2.id:",
        ),
        # Overlapping aggregate filters.
        (
            ("    broker: nats\n", "    broker: nats\n    aggregates: [book, member]\n"),
            "outboxes.loans-v2.messages.BookLent:",
        ),
    ],
    ids=["message-id-overrides-outbox-id", "same-outbox-id", "aggregates-overlap"],
)
def test_same_ids_are_found_through_overrides_and_filters(
    tmp_path: Path, change: tuple[str, str], where: str
) -> None:
    text = TWO_OUTBOXES.replace(*change)
    if "{aggregate_id}/v2" in text:
        text = text.replace(
            "        type: library.book-lent.v2\n",
            "        type: library.book-lent.v2\n"
            "        id: '{aggregate_type}/{aggregate_id}@{version}'\n",
        )
    message = error_of(tmp_path, text)
    assert where in message, message
    assert "loans-v1" in message


@pytest.mark.parametrize(
    "change",
    [
        ("  loans-v2:\n    broker: nats\n", "  loans-v2:\n    broker: other\n"),
        (
            "        destination: library.loans\n  loans-v2",
            "        destination: library.v1\n  loans-v2",
        ),
        (
            "  loans-v2:\n    broker: nats\n",
            "  loans-v2:\n    broker: nats\n"
            "    id: '{aggregate_type}/{aggregate_id}@{version}/v2'\n",
        ),
        (
            "        type: library.book-lent.v2\n",
            "        type: library.book-lent.v2\n        id: '{aggregate_id}@{version}/v2'\n",
        ),
    ],
    ids=["other-broker", "other-destination", "outbox-id-differs", "message-id-differs"],
)
def test_outboxes_whose_ids_cannot_collide_load(tmp_path: Path, change: tuple[str, str]) -> None:
    text = TWO_OUTBOXES.replace(*change)
    assert text != TWO_OUTBOXES
    assert set(load_config(write(tmp_path, text)).outboxes) == {"loans-v1", "loans-v2"}


def test_disjoint_aggregate_filters_cannot_collide(tmp_path: Path) -> None:
    text = TWO_OUTBOXES.replace(
        "  loans-v1:\n    broker: nats\n", "  loans-v1:\n    broker: nats\n    aggregates: [book]\n"
    ).replace(
        "  loans-v2:\n    broker: nats\n", "  loans-v2:\n    broker: nats\n    aggregates: [dvd]\n"
    )
    assert set(load_config(write(tmp_path, text)).outboxes) == {"loans-v1", "loans-v2"}
    one_unfiltered = text.replace("    aggregates: [dvd]\n", "")
    assert "loans-v2" in error_of(tmp_path, one_unfiltered)
    one_relays_nothing = text.replace("aggregates: [dvd]", "aggregates: []")
    assert "loans-v2" in load_config(write(tmp_path, one_relays_nothing)).outboxes


def test_model_level_errors_point_at_their_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, GOOD.replace("broker: nats", "broker: kafka"))
    assert "relay.yaml:9: outboxes.loans-outbox.broker: unknown broker 'kafka'" in message


def test_broker_level_errors_name_the_key_not_the_broker_type(tmp_path: Path) -> None:
    text = GOOD.replace(
        '    servers: ["nats://127.0.0.1:4222"]\n',
        '    servers: ["nats://127.0.0.1:4222"]\n    jetstream: false\n'
        "    stream: {name: LIBRARY, subjects: [library.>]}\n",
    )
    message = error_of(tmp_path, text)
    assert "relay.yaml:8: brokers.nats.stream: a stream needs JetStream" in message


@pytest.mark.parametrize("window", ["1ms", "99ms", "0.05s"])
def test_a_duplicate_window_jetstream_refuses_is_a_config_error(
    tmp_path: Path, window: str
) -> None:
    """JetStream refuses a stream whose window is under 100 ms (error 10052): the relay
    would retry creating it for ever. Found attacking: `1ms` passed `relay check`."""
    text = GOOD.replace(
        '    servers: ["nats://127.0.0.1:4222"]\n',
        '    servers: ["nats://127.0.0.1:4222"]\n'
        f"    stream: {{name: LIBRARY, subjects: [library.>], duplicate_window: {window}}}\n",
    )
    message = error_of(tmp_path, text)
    assert "brokers.nats.stream.duplicate_window: JetStream needs at least 100ms" in message


def kafka_config(servers: str) -> str:
    """GOOD with its broker swapped for Kafka, bootstrap_servers written as given."""
    return GOOD.replace(
        '  nats:\n    type: nats\n    servers: ["nats://127.0.0.1:4222"]\n',
        f"  kafka:\n    type: kafka\n    bootstrap_servers: {servers}\n",
    ).replace("broker: nats", "broker: kafka")


@pytest.mark.parametrize(
    "servers",
    [
        '"kafka-1.internal:9093,kafka-2.internal:9093"',
        '"kafka-1.internal:9093, kafka-2.internal:9093,"',
        '["kafka-1.internal:9093", "kafka-2.internal:9093"]',
    ],
    ids=["comma-separated", "spaces-and-trailing-comma", "list"],
)
def test_kafka_bootstrap_servers_as_a_comma_separated_string_or_a_list(
    tmp_path: Path, servers: str
) -> None:
    broker = load_config(write(tmp_path, kafka_config(servers))).brokers["kafka"]
    assert isinstance(broker, KafkaBrokerConfig)
    assert broker.bootstrap_servers == ["kafka-1.internal:9093", "kafka-2.internal:9093"]


@pytest.mark.parametrize(
    ("servers", "expected"),
    [
        ('""', "brokers.kafka.bootstrap_servers: no server: write host:port"),
        ('" , "', "brokers.kafka.bootstrap_servers: no server: write host:port"),
        ("[]", "brokers.kafka.bootstrap_servers: Value should have at least 1 item"),
        ('["kafka-1:9093", ""]', "brokers.kafka.bootstrap_servers: an entry is empty"),
    ],
    ids=["empty", "only-a-comma", "empty-list", "empty-entry"],
)
def test_kafka_bootstrap_servers_without_a_server_is_refused(
    tmp_path: Path, servers: str, expected: str
) -> None:
    message = error_of(tmp_path, kafka_config(servers))
    assert "relay.yaml:6:" in message
    assert expected in message


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"RELAY_LEASE__CHECK_INTERVAL": "abc"},
            "environment variable RELAY_LEASE__CHECK_INTERVAL: lease.check_interval: 'abc' is not",
        ),
        (
            {"RELAY_HTTP__PORT": "99999"},
            "environment variable RELAY_HTTP__PORT: http.port: Input should be less than",
        ),
        (  # a key the file has too: the override is what is wrong, not the file's line
            {"RELAY_BROKERS__NATS__SERVERS": '["bad://x"]'},
            "environment variable RELAY_BROKERS__NATS__SERVERS: brokers.nats.servers: bad://",
        ),
        (  # a whole section as JSON
            {"RELAY_LEASE": '{"check_interval": "abc"}'},
            "environment variable RELAY_LEASE: lease.check_interval: 'abc' is not",
        ),
    ],
)
def test_a_bad_override_names_its_variable_and_whole_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], expected: str
) -> None:
    """Not the file's line: the file may not have the key at all, or have it right."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    message = error_of(tmp_path, GOOD)
    assert expected in message
    assert str(tmp_path) not in message.splitlines()[1]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("RELAY_OUTBOXES", "null", "outboxes: Input should be a valid dictionary"),
        ("RELAY_DATABASE", "null", "database: Input should be a valid dictionary"),
        ("RELAY_LEASE", "null", "lease: Input should be a valid dictionary"),
        ("RELAY_OUTBOXES", "{}", "outboxes: Dictionary should have at least 1 item"),
        ("relay_brokers", "{}", "brokers: Dictionary should have at least 1 item"),
    ],
)
def test_an_override_of_a_whole_section_is_applied_not_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str
) -> None:
    """The variable sets the section to its value, as it does any other key: `null` is
    null, `{}` is empty (not merged into the file's section, which would change nothing)."""
    monkeypatch.setenv(name, value)
    message = error_of(tmp_path, GOOD)
    assert f"environment variable {name}: {expected}" in message
    assert "relay.yaml" not in message


def test_a_mapping_override_replaces_the_files_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A section given as JSON is the whole section; deeper variables then set keys in it."""
    other = {"broker": "nats", "messages": {"BookReturned": {"type": "t.v1", "destination": "d"}}}
    monkeypatch.setenv("RELAY_OUTBOXES", json.dumps({"returns": other}))
    monkeypatch.setenv("RELAY_OUTBOXES__RETURNS__PARK_AFTER", "3")
    monkeypatch.setenv("RELAY_LOGGING", '{"format": "json"}')
    config = load_config(write(tmp_path, GOOD + "logging:\n  level: debug\n"))
    assert list(config.outboxes) == ["returns"]
    assert config.outboxes["returns"].park_after == 3
    assert (config.logging.format, config.logging.level) == ("json", "info")


def test_an_override_reaches_a_key_written_in_another_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Variable names are not case-sensitive, so `...__BOOKLENT__TYPE` is the file's
    `BookLent`, not a rule of its own for an event type `booklent`."""
    monkeypatch.setenv("RELAY_OUTBOXES__LOANS-OUTBOX__MESSAGES__BOOKLENT__TYPE", "t.v2")
    config = load_config(write(tmp_path, GOOD))
    rules = config.outboxes["loans-outbox"].rules("loans-outbox")
    assert list(rules) == ["BookLent"]
    assert rules["BookLent"][0].config.type == "t.v2"


def test_a_key_missing_from_a_section_an_override_made_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the line of `outboxes:` in the file, which has no such outbox."""
    monkeypatch.setenv("RELAY_OUTBOXES__RETURNS__PARK_AFTER", "3")
    message = error_of(tmp_path, GOOD)
    expected = "environment variable RELAY_OUTBOXES__RETURNS__PARK_AFTER: outboxes.returns"
    assert f"{expected}.broker: required key is missing" in message
    assert f"{expected}.messages: required key is missing" in message
    assert "relay.yaml" not in message


def test_a_bad_override_of_a_secret_does_not_show_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAY_DATABASE__URL", "mysql://relay:hunter2@db/app")
    message = error_of(tmp_path, GOOD)
    assert "environment variable RELAY_DATABASE__URL: database.url:" in message
    assert "hunter2" not in message


def test_audit_defaults_off_and_takes_its_keys(tmp_path: Path) -> None:
    plain = load_config(write(tmp_path, GOOD)).outboxes["loans-outbox"].audit
    assert plain.enabled is False and plain.repair is False
    assert (plain.delay, plain.every, plain.clock_skew) == (60.0, 60.0, 60.0)
    audited = GOOD + "    audit: {enabled: true, delay: 30s, every: 10s, repair: true}\n"
    audit = load_config(write(tmp_path, audited)).outboxes["loans-outbox"].audit
    assert (audit.enabled, audit.delay, audit.every, audit.repair) == (True, 30.0, 10.0, True)


def test_an_audit_of_a_broker_that_cannot_be_read_back_is_refused_naming_the_key(
    tmp_path: Path,
) -> None:
    text = GOOD.replace(
        'type: nats\n    servers: ["nats://127.0.0.1:4222"]', "type: sqs\n    region: eu-west-1"
    )
    assert "type: sqs" in text
    load_config(write(tmp_path, text))  # without an audit it is fine
    said = error_of(tmp_path, text + "    audit: {enabled: true}\n")
    assert "outboxes.loans-outbox.audit.enabled" in said
    assert "cannot be read back" in said


def test_an_audit_setting_out_of_range_names_the_key(tmp_path: Path) -> None:
    said = error_of(tmp_path, GOOD + "    audit: {enabled: true, every: 0s}\n")
    assert "outboxes.loans-outbox.audit.every" in said


@pytest.mark.parametrize(
    ("broker", "says"),
    [
        ("type: nats\n    servers: [nats://n:4222]\n    jetstream: false", "core NATS"),
        ("type: pubsub\n    project: my-project", "audit_subscription"),
        ("type: rabbitmq\n    url: amqp://guest:guest@r:5672/", "audit_streams"),
    ],
)
def test_an_audit_that_its_broker_config_cannot_serve_is_refused(
    tmp_path: Path, broker: str, says: str
) -> None:
    text = GOOD.replace('type: nats\n    servers: ["nats://127.0.0.1:4222"]', broker)
    load_config(write(tmp_path, text))
    said = error_of(tmp_path, text + "    audit: {enabled: true}\n")
    assert "outboxes.loans-outbox.audit.enabled" in said and says in said
