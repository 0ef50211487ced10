"""Passwords in connection URLs never show: not in a config error, the CLI's output or a log line.

A password with a reserved character (`/`, `@`, `#`, `?`, `%`) written raw in a URL makes
parsers split the URL inside the password, and their error text then quotes a piece of it
(`invalid literal for int() with base 10: 'Tr0ub4dor'`). The config models check the URLs
themselves and say what is wrong without quoting any of it; `redact` hides the whole userinfo.
Each check looks for every 3-character piece of the password, not just the whole of it.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from urllib.parse import quote, urlsplit

import asyncpg
import pytest
import structlog
from pydantic import SecretStr, ValidationError

from relay.config import DatabaseConfig, RabbitMqBrokerConfig, load_config
from relay.errors import ConfigError, DatabaseError
from relay.postgres.database import Database, DatabaseUnavailable
from relay.redaction import redact
from relay.runtime.logs import configure
from tests.support import hostile_configs
from tests.support.relay_process import run_cli

RESERVED = ["/", "@", ":", "#", "%", "?", "[", "]", "\\"]
# Raw in a URL, these still leave one way to read it: the URL loads as written.
UNAMBIGUOUS = {":"}
# Nothing listens on port 1, so a URL that loads fails fast and harmlessly in `relay check`.
NOWHERE = "127.0.0.1:1"


def password(char: str) -> str:
    return f"Xk7Tq2{char}Zp9Wm4"


def pieces(secret: str) -> set[str]:
    return {secret[i : i + 3] for i in range(len(secret) - 2)}


def assert_hidden(text: str, secret: str) -> None:
    leaked = sorted(piece for piece in pieces(secret) if piece in text)
    assert not leaked, f"pieces {leaked} of the password are in:\n{text}"


def config_text(database_url: str, rabbitmq_url: str | None = None) -> str:
    broker = (
        f"  rabbit:\n    type: rabbitmq\n    url: '{rabbitmq_url}'\n"
        if rabbitmq_url
        else '  nats:\n    type: nats\n    servers: ["nats://127.0.0.1:4222"]\n'
    )
    return (
        f"database:\n  url: '{database_url}'\n"
        f"brokers:\n{broker}"
        "outboxes:\n"
        "  loans-outbox:\n"
        f"    broker: {'rabbit' if rabbitmq_url else 'nats'}\n"
        "    messages:\n"
        "      BookLent:\n"
        "        type: library.book-lent.v1\n"
        "        destination: library.loans\n"
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    return path


def check_cli(path: Path) -> tuple[int, str]:
    result = run_cli(["check", "--config", str(path)], timeout=60)
    return result.returncode, result.stdout + result.stderr


CASES = [
    pytest.param(char, encoded, id=f"{'encoded' if encoded else 'raw'}-{char}")
    for char in RESERVED
    for encoded in (False, True)
]


@pytest.mark.integration  # runs `relay check` as a process
@pytest.mark.parametrize(("char", "encoded"), CASES)
def test_database_url_password_with_reserved_character(
    tmp_path: Path, char: str, encoded: bool
) -> None:
    secret = password(char)
    written = quote(secret, safe="") if encoded else secret
    url = f"postgresql://relay:{written}@{NOWHERE}/app"
    path = write(tmp_path, config_text(url))
    if encoded or char in UNAMBIGUOUS:
        assert load_config(path).database.url.get_secret_value() == url
        code, output = check_cli(path)
        assert code == 1, output  # loads, then nothing answers on port 1
        assert "cannot reach the database" in output
    else:
        with pytest.raises(ConfigError) as info:
            load_config(path)
        message = str(info.value)
        assert "relay.yaml:2: database.url:" in message
        assert "percent-encode" in message
        assert "/ → %2F, @ → %40, : → %3A, # → %23, % → %25, ? → %3F" in message
        assert_hidden(message, secret)
        code, output = check_cli(path)
        assert code == 2, output
        assert "database.url" in output
    assert_hidden(output, secret)


@pytest.mark.integration  # runs `relay check` as a process
@pytest.mark.parametrize(("char", "encoded"), CASES)
def test_rabbitmq_url_password_with_reserved_character(
    tmp_path: Path, char: str, encoded: bool
) -> None:
    secret = password(char)
    written = quote(secret, safe="") if encoded else secret
    url = f"amqp://relay:{written}@{NOWHERE}/library"
    path = write(tmp_path, config_text(f"postgresql://relay@{NOWHERE}/app", url))
    if encoded or char in UNAMBIGUOUS:
        broker = load_config(path).brokers["rabbit"]
        assert isinstance(broker, RabbitMqBrokerConfig)
        assert broker.url.get_secret_value() == url
        code, output = check_cli(path)
        assert code == 1, output
    else:
        with pytest.raises(ConfigError) as info:
            load_config(path)
        message = str(info.value)
        assert "relay.yaml:6: brokers.rabbit.url:" in message
        assert "percent-encode" in message
        assert_hidden(message, secret)
        code, output = check_cli(path)
        assert code == 2, output
        assert "brokers.rabbit.url" in output
    assert_hidden(output, secret)


@pytest.mark.parametrize(
    "url",
    [
        # The part before the `/` looks like a port, so the URL parses, to the wrong server.
        "postgresql://relay:9183/Zq8Wv4@db/app",
        "postgresql://relay:Zq8/Wv4@db/app",
        "postgresql://relay:Zq8@Wv4@db/app",
        "postgresql://relay:Zq8#Wv4@db/app",
        "postgresql://relay:Zq8?Wv4@db/app",
        "postgresql://relay:Zq8%Wv4@db/app",
        "postgresql://relay:Zq8 Wv4@db/app",
        "postgresql://relay:Zq8Wv4@db:5432,/app",
    ],
)
def test_ambiguous_database_urls_are_refused_without_a_trace_of_the_password(url: str) -> None:
    secret = url.split("relay:", 1)[1].split("@db", 1)[0]
    with pytest.raises(ValidationError) as info:
        DatabaseConfig(url=SecretStr(url))
    errors = info.value.errors(include_url=False)
    assert [e["loc"] for e in errors] == [("url",)]
    assert_hidden(errors[0]["msg"], secret)
    assert_hidden(str(info.value), secret)  # pydantic's own text leaves the input out


@pytest.mark.parametrize(
    "url",
    [
        "amqp://relay:9183/Zq8Wv4@rabbit/library",
        "amqp://relay:Zq8@Wv4@rabbit/library",
        "amqp://relay:Zq8#Wv4@rabbit/library",
        "http://relay:Zq8Wv4@rabbit/library",
    ],
)
def test_ambiguous_rabbitmq_urls_are_refused_without_a_trace_of_the_password(url: str) -> None:
    secret = url.split("relay:", 1)[1].split("@rabbit", 1)[0]
    with pytest.raises(ValidationError) as info:
        RabbitMqBrokerConfig(type="rabbitmq", url=SecretStr(url))
    message = str(info.value)
    assert_hidden(message, secret)
    assert "percent-encode" in message or "must start with amqp:// or amqps://" in message


def test_rabbitmq_url_must_be_amqp(tmp_path: Path) -> None:
    path = write(
        tmp_path, config_text(f"postgresql://relay@{NOWHERE}/app", "http://relay:Zq8Wv4@rabbit/")
    )
    with pytest.raises(ConfigError, match=r"brokers\.rabbit\.url: .*amqp:// or amqps://"):
        load_config(path)


def test_database_url_override_is_checked_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = password("/")
    monkeypatch.setenv("RELAY_DATABASE__URL", f"postgresql://relay:{secret}@db/app")
    path = write(tmp_path, config_text(f"postgresql://relay@{NOWHERE}/app"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "database.url" in str(info.value)
    assert_hidden(str(info.value), secret)


@pytest.mark.parametrize("char", RESERVED)
@pytest.mark.parametrize("scheme", ["postgresql", "amqps", "nats"])
def test_redact_hides_the_whole_userinfo(scheme: str, char: str) -> None:
    secret = password(char)
    for written in (secret, quote(secret, safe="")):
        text = f"connect failed: {scheme}://relay:{written}@db:5432/app (will retry)"
        hidden = redact(text)
        assert hidden == f"connect failed: {scheme}://***@db:5432/app (will retry)"
        assert_hidden(hidden, secret)


def test_redact_keeps_urls_without_credentials() -> None:
    text = "servers nats://127.0.0.1:4222 and postgresql://db/app"
    assert redact(text) == text


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("char", RESERVED)
def test_log_lines_never_carry_the_password(char: str, capsys: pytest.CaptureFixture[str]) -> None:
    configure("debug", "json")  # here, not in a fixture: stderr is the test's captured one now
    secret = password(char)
    url = f"postgresql://relay:{secret}@db:5432/app"
    log = structlog.get_logger("relay.test")
    log.warning("connect failed", url=url, error=f"cannot connect to {url}")
    log.warning("nested", attempt={"url": url, "urls": [url]}, error=ValueError(url))
    try:
        raise ValueError(f"bad {url}")
    except ValueError:
        log.exception("failed with a traceback")
        logging.getLogger("aiormq.connection").exception("client library: %s", url)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4
    for line in lines:
        json.loads(line)
        assert_hidden(line, secret)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:Xk7Tq2/Zp9Wm4@127.0.0.1:5432/app",
        "host=127.0.0.1 password=Xk7Tq2Zp9Wm4 dbname=app",
        "postgresql://relay:Xk7Tq2Zp9Wm4@127.0.0.1:5432/app?sslmode=bogus",
    ],
)
async def test_connect_refuses_a_bad_url_for_good_without_the_parsers_text(url: str) -> None:
    """A URL that slipped past the config (built in code) is refused for good, and not quoted."""
    config = DatabaseConfig.model_construct(url=SecretStr(url), connect_timeout=1.0)
    with pytest.raises(DatabaseError) as info:
        await Database(config, "test").connect("test")
    assert not isinstance(info.value, DatabaseUnavailable)
    assert "database.url" in str(info.value)
    assert_hidden(str(info.value), "Xk7Tq2Zp9Wm4")
    assert_hidden(str(info.value), "Xk7Tq2/Zp9Wm4")


@pytest.mark.integration  # runs `relay check` as a process
@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "host=127.0.0.1 password=Xk7Tq2Zp9Wm4 dbname=app",
            "write it as a postgresql:// URL",
        ),
        (
            "postgresql://relay:Xk7Tq2Zp9Wm4@127.0.0.1:5432/app?sslmode=bogus",
            "sslmode must be one of disable, allow, prefer, require, verify-ca, verify-full",
        ),
    ],
    ids=["keyword-dsn", "bad-sslmode"],
)
def test_cli_refuses_what_would_look_like_an_outage(
    tmp_path: Path, url: str, expected: str
) -> None:
    code, output = check_cli(write(tmp_path, config_text(url)))
    assert code == 2, output
    assert "database.url" in output
    assert expected in output
    assert_hidden(output, "Xk7Tq2Zp9Wm4")
    assert "unreachable" not in output
    assert "cannot reach" not in output


async def test_percent_encoded_credentials_connect(tmp_path: Path, database: str) -> None:
    """A user and password full of reserved characters, percent-encoded, reach the server.

    The server trusts local connections, so the password is not checked; what this proves is
    that the URL is accepted and read as meant: the user, the host, the port and the database.
    """
    user = f"relay/t@m:{uuid.uuid4().hex[:8]}"
    secret = "Xk7/@:#%?Zp9"
    where = urlsplit(database)
    url = (
        f"postgresql://{quote(user, safe='')}:{quote(secret, safe='')}"
        f"@{where.hostname}:{where.port}{where.path}"
    )
    admin = await asyncpg.connect(database)
    try:
        quoted_user = '"' + user.replace('"', '""') + '"'
        await admin.execute(f"CREATE ROLE {quoted_user} LOGIN PASSWORD $${secret}$$")
        try:
            config = load_config(write(tmp_path, config_text(url)))
            conn = await Database(config.database, "test").connect("test")
            try:
                row = await conn.fetchrow("SELECT current_user, current_database()")
            finally:
                await conn.close()
            assert tuple(row) == (user, where.path.lstrip("/"))
        finally:
            await admin.execute(f"DROP ROLE {quoted_user}")
    finally:
        await admin.close()


@pytest.mark.integration  # runs `relay check --offline` as a process
def test_a_duplicated_url_in_the_file_prints_neither_password(tmp_path: Path) -> None:
    """A merge mistake leaves two `url:` lines; the error goes to CI and pod logs."""
    old, new = password("a"), password("b")
    text = config_text(f"postgresql://relay:{old}@{NOWHERE}/app").replace(
        "database:\n", f"database:\n  url: 'postgresql://relay:{new}@{NOWHERE}/app'\n", 1
    )
    result = run_cli(["check", "--offline", "--config", str(write(tmp_path, text))])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert 'relay.yaml:3: invalid YAML: the key "url" appears twice in one mapping' in output
    assert_hidden(output, old)
    assert_hidden(output, new)


@pytest.mark.integration  # runs `relay check --offline` as a process, once per broken file
@pytest.mark.parametrize(
    "text",
    [*hostile_configs.DUPLICATED.values(), *(t for t, _ in hostile_configs.BROKEN.values())],
    ids=[*hostile_configs.DUPLICATED, *hostile_configs.BROKEN],
)
def test_no_broken_config_prints_a_secret(tmp_path: Path, text: str) -> None:
    """Every error path of loading a config, as an operator's terminal or a pod's log sees it."""
    result = run_cli(["check", "--offline", "--config", str(write(tmp_path, text))])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.startswith("error: "), output
    assert not hostile_configs.leaked(output), output
