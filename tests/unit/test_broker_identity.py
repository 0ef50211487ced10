"""A broker's identity, as recorded with the checkpoint: type and hosts, never a secret."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from relay.config import BrokerConfig
from relay.config.broker_identity import broker_identity, same_broker

BROKERS: TypeAdapter[Any] = TypeAdapter(BrokerConfig)


@pytest.mark.parametrize(
    ("config", "identity"),
    [
        (
            {"type": "nats", "servers": ["nats://relay:s3cret@b.example", "tls://a.example:4333"]},
            "nats a.example:4333,b.example:4222",
        ),
        (
            {"type": "kafka", "bootstrap_servers": ["k2:9093", "k1", "k2:9093"]},
            "kafka k1:9092,k2:9093",
        ),
        (
            {"type": "rabbitmq", "url": "amqps://relay:s3cret@mq.example/prod"},
            "rabbitmq mq.example:5671/prod",
        ),
        ({"type": "rabbitmq", "url": "amqp://guest:guest@[::1]:5673"}, "rabbitmq [::1]:5673//"),
        ({"type": "sqs", "region": "eu-west-1"}, "sqs sqs.eu-west-1.amazonaws.com:443/eu-west-1"),
        (
            {"type": "sqs", "region": "us-east-1", "endpoint_url": "http://127.0.0.1:5000"},
            "sqs 127.0.0.1:5000/us-east-1",
        ),
        (
            {"type": "pubsub", "project": "library-prod"},
            "pubsub pubsub.googleapis.com:443/library-prod",
        ),
        (
            {"type": "pubsub", "project": "library-prod", "emulator_host": "localhost:8085"},
            "pubsub localhost:8085/library-prod",
        ),
        (
            {"type": "redis", "url": "rediss://relay:s3cret@Redis.example:6380/2"},
            "redis redis.example:6380/2",
        ),
        ({"type": "redis", "url": "redis://redis.example"}, "redis redis.example:6379/0"),
        ({"type": "sns", "region": "eu-west-1"}, "sns sns.eu-west-1.amazonaws.com:443/eu-west-1"),
        (
            {"type": "kinesis", "region": "eu-west-1"},
            "kinesis kinesis.eu-west-1.amazonaws.com:443/eu-west-1",
        ),
    ],
)
def test_identity_is_type_and_sorted_hosts_without_credentials(
    config: dict[str, Any], identity: str
) -> None:
    found = broker_identity(BROKERS.validate_python(config))
    assert found == identity
    assert "s3cret" not in found and "guest" not in found


def test_same_broker_when_the_type_matches_and_a_host_is_shared() -> None:
    assert same_broker("kafka k1:9092", "kafka k1:9092,k2:9092")  # a seed added
    assert not same_broker("kafka k1:9092", "kafka k3:9092")
    assert not same_broker("nats k1:9092", "kafka k1:9092")
    assert not same_broker("rabbitmq mq:5672/prod", "rabbitmq mq:5672/test")


@pytest.mark.parametrize("char", ["/", "@", ":", "#", "%", "?", "[", "]", "\\"])
def test_no_piece_of_a_password_with_a_reserved_character_becomes_a_host(char: str) -> None:
    """A NATS URL nats-py would misread is refused at load; one that loads names its host only."""
    server = f"nats://relay:Xk7{char}12@nats-1.internal:4222"
    if char != ":":  # the one reserved character that leaves a single reading
        with pytest.raises(ValidationError) as info:
            BROKERS.validate_python({"type": "nats", "servers": [server]})
        said = " ".join(error["msg"] for error in info.value.errors())  # as load_config words it
        assert "servers.0: not a valid NATS URL" in said or "%XX escape" in said
        assert "Xk7" not in said and "12@" not in said
        return
    found = broker_identity(BROKERS.validate_python({"type": "nats", "servers": [server]}))
    assert found == "nats nats-1.internal:4222"
    assert "Xk7" not in found and "12@" not in found
