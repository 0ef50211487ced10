"""`relay audit` refuses what cannot be read back: an SQS queue hands each message to one
consumer, so reading it would take messages from the consumers. It says so (exit 2) before
it reaches anything: nothing listens at the addresses of this config."""

from __future__ import annotations

from pathlib import Path

from tests.support.relay_process import run_cli
from tests.support.scenario import config_dict, save


def test_an_sqs_outbox_cannot_be_audited_and_the_audit_says_why(tmp_path: Path) -> None:
    data = config_dict("postgresql://relay@127.0.0.1:1/relay", "nats://127.0.0.1:1", "loans")
    data["brokers"] = {
        "queues": {"type": "sqs", "region": "eu-west-1", "endpoint_url": "http://127.0.0.1:1"}
    }
    data["outboxes"]["loans"]["broker"] = "queues"
    config = save(tmp_path, data)
    result = run_cli(["audit", "loans", "--from-start", "--config", str(config), "--json"])
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "broker 'queues' (sqs) cannot be read back" in result.stderr
    assert "hands each message to one consumer" in result.stderr
