"""The webhook sink's pure parts: its config, Retry-After, and signatures a receiver's
library (standardwebhooks) accepts. The adapter itself is tested against a real server in
tests/integration/publishers/test_http.py."""

from __future__ import annotations

import base64
import tempfile
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest
from pydantic import TypeAdapter
from standardwebhooks.webhooks import Webhook

from relay.brokers.http import prepared, retry_after, sign
from relay.config import BrokerConfig, HttpBrokerConfig, load_config
from relay.errors import ConfigError
from tests.support.config import write_config

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def http(**fields: object) -> HttpBrokerConfig:
    config = TypeAdapter(BrokerConfig).validate_python({"type": "http", **fields})
    assert isinstance(config, HttpBrokerConfig)
    return config


def refused(**fields: object) -> str:
    """The error an operator reads: `relay` loads the file and words the message."""
    with tempfile.TemporaryDirectory() as directory:
        path = write_config(
            Path(directory) / "relay.yaml",
            {
                "database": {"url": "postgresql://relay@db.example.com/app"},
                "brokers": {"hooks": {"type": "http", **fields}},
                "outboxes": {
                    "loans": {
                        "broker": "hooks",
                        "messages": {"BookLent": {"type": "t.v1", "destination": "https://h/x"}},
                    }
                },
            },
        )
        with pytest.raises(ConfigError) as caught:
            load_config(path)
    return str(caught.value)


def test_the_defaults_take_the_url_from_the_destination() -> None:
    config = http()
    assert config.url == "{destination}"
    assert (config.max_in_flight, config.follow_redirects, config.retry_after_max) == (
        16,
        False,
        300.0,
    )


def test_a_url_names_only_fields_of_a_message() -> None:
    assert "{aggregate_id} is not a field of a message" in refused(
        url="https://h.example.com/{aggregate_id}"
    )
    assert "http:// or https://" in refused(url="ftp://h.example.com/in")
    assert http(url="https://h.example.com/{type}/{key}").url.endswith("{key}")


def test_a_url_whose_own_path_steps_elsewhere_is_refused_at_load() -> None:
    """Every request would be refused for it (a step the client resolves, a fragment never
    sent), so the file is: the error names the key and the step."""
    assert "url: holds the path step '..'" in refused(url="https://h.example.com/in/../{key}")
    assert "holds the path step '%2E'" in refused(url="https://h.example.com/{type}/%2E/x")
    assert "holds a '#'" in refused(url="{destination}#{key}")
    assert http(url="https://h.example.com/.well-known/{key}/...").url.endswith("...")


def test_signing_keys_are_standard_webhooks_secrets_and_never_quoted() -> None:
    assert "starts with whsec_" in refused(signing_keys=["hunter2-hunter2-hunter2-hunter2"])
    said = refused(signing_keys=["whsec_not base64!"])
    assert "not base64" in said and "not base64!" not in said.replace("is not base64", "")
    assert "at least 24 bytes" in refused(
        signing_keys=["whsec_" + base64.b64encode(b"short").decode()]
    )
    assert SECRET not in repr(http(signing_keys=[SECRET]))


def test_headers_are_the_operators_own_and_their_values_secret() -> None:
    assert "the relay writes this header itself" in refused(headers={"webhook-id": "x"})
    assert "the relay writes this header itself" in refused(headers={"Content-Type": "x"})
    assert "the relay writes this header itself" in refused(headers={"ce-source": "x"})
    assert "is not a header name" in refused(headers={"Bad Name": "x"})
    said = refused(headers={"Authorization": "Bearer abc\n"})
    assert "Authorization: no control characters" in said and "abc" not in said
    config = http(headers={"Authorization": "Bearer s3cr3t"})
    assert "s3cr3t" not in repr(config) and "s3cr3t" not in str(config.model_dump())


def test_retry_after_in_seconds_or_as_a_date_capped() -> None:
    assert retry_after("120", cap=60.0) == 60.0
    assert retry_after(" 5 ", cap=60.0) == 5.0
    assert retry_after(None, cap=60.0) is None
    assert retry_after("tomorrow", cap=60.0) is None
    past = format_datetime(datetime.now(UTC) - timedelta(hours=1), usegmt=True)
    assert retry_after(past, cap=60.0) == 0.0
    soon = retry_after(format_datetime(datetime.now(UTC) + timedelta(seconds=40), usegmt=True), 60)
    assert soon is not None and 30 < soon <= 40


def test_a_signature_per_key_each_accepted_by_the_receivers_library() -> None:
    other = "whsec_" + base64.b64encode(b"o" * 32).decode()
    keys = [base64.b64decode(s.removeprefix("whsec_")) for s in (SECRET, other)]
    timestamp = str(int(datetime.now(UTC).timestamp()))
    body = b'{"book": "b1"}'
    header = sign(prepared(keys), "book/b1@1", timestamp, body)
    assert header.count("v1,") == 2
    headers = {
        "webhook-id": "book/b1@1",
        "webhook-timestamp": timestamp,
        "webhook-signature": header,
    }
    for secret in (SECRET, other):
        assert Webhook(secret).verify(body, headers) == {"book": "b1"}
