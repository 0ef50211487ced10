"""Config files: the example loads as written; every bad file names its key and line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from relay.config import RelayConfig, load_config
from relay.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
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
    assert outbox.messages["BookLent"].payload == {
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


def test_environment_expansion_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_HOST", "nats.internal")
    monkeypatch.delenv("NATS_PORT", raising=False)
    text = GOOD.replace('["nats://127.0.0.1:4222"]', '["nats://${NATS_HOST}:${NATS_PORT:-4222}"]')
    config = load_config(write(tmp_path, text))
    assert config.brokers["nats"].servers == ["nats://nats.internal:4222"]


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


def test_cli_exits_2_on_bad_config(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("        destination:", "        destinaton:"))
    result = subprocess.run(
        [sys.executable, "-m", "relay", "check", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "destinaton: unknown key" in result.stderr


def test_model_rejects_unknown_top_level_key(tmp_path: Path) -> None:
    message = error_of(tmp_path, GOOD + "extra_section: {}\n")
    assert "extra_section: unknown key" in message
    assert RelayConfig.model_config["frozen"] is True
