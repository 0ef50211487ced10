"""Every broker a config may name has an adapter that meets the `Publisher` port and probing.

The registry, the config's broker types and the package extras are three lists that a
new adapter must extend together; this holds them to each other, and holds each adapter
to the members the core and `relay check` call, with the same signatures. It builds each
publisher from a minimal config, which must open no connection (no server is needed).
"""

from __future__ import annotations

import inspect
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from relay.brokers import _ADAPTERS, Probing, create_publisher, create_publishers
from relay.config import BrokerConfig
from relay.core.publishing import Publisher

ROOT = Path(__file__).resolve().parents[2]
MINIMAL: dict[str, dict[str, Any]] = {
    "nats": {"servers": ["nats://127.0.0.1:1"]},
    "kafka": {"bootstrap_servers": ["127.0.0.1:1"]},
    "rabbitmq": {"url": "amqp://127.0.0.1:1/"},
    "sqs": {"region": "eu-west-1", "endpoint_url": "http://127.0.0.1:1"},
    "pubsub": {"project": "relay-tests", "emulator_host": "127.0.0.1:1"},
    "redis": {"url": "redis://127.0.0.1:1/0"},
    "http": {"url": "http://127.0.0.1:1/{destination}"},
    "sns": {"region": "eu-west-1", "endpoint_url": "http://127.0.0.1:1"},
    "kinesis": {"region": "eu-west-1", "endpoint_url": "http://127.0.0.1:1"},
}


def config_types() -> set[str]:
    """The `type` values the config accepts for a broker."""
    union = typing.get_args(typing.get_args(BrokerConfig)[0])
    return {typing.get_args(model.model_fields["type"].annotation)[0] for model in union}


def members(protocol: type) -> dict[str, Any]:
    """The protocol's own methods, properties and attributes, by name."""
    names = {n for n in vars(protocol) if not n.startswith("_")}
    names |= set(typing.get_type_hints(protocol))
    return {n: getattr(protocol, n, None) for n in names}


def test_every_broker_type_of_the_config_has_an_adapter_and_an_extra() -> None:
    assert set(_ADAPTERS) == config_types() == set(MINIMAL)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for kind, (_, _, extra) in _ADAPTERS.items():
        assert extra in extras, f"broker type {kind!r}: no extra {extra!r} in pyproject.toml"
        assert extra in extras["all"][0], f"the `all` extra leaves out {extra!r}"


@pytest.mark.parametrize("kind", sorted(_ADAPTERS))
def test_each_adapter_meets_the_publisher_port_and_probing(kind: str) -> None:
    config = TypeAdapter(BrokerConfig).validate_python({"type": kind, **MINIMAL[kind]})
    publisher = create_publisher("b", config)  # builds it, connects nothing
    assert publisher.name == "b"
    assert publisher.duplicates == 0
    assert list(publisher.last_duplicates) == []
    for protocol in (Publisher, Probing):
        for name, wanted in members(protocol).items():
            got = getattr(type(publisher), name, None)
            assert got is not None or hasattr(publisher, name), f"{kind}: no {name}"
            if inspect.iscoroutinefunction(wanted):
                assert inspect.iscoroutinefunction(got), f"{kind}: {name} must be async"
                want = list(inspect.signature(wanted).parameters)
                have = inspect.signature(got).parameters
                extra = [p for n, p in have.items() if n not in want]
                assert list(have)[: len(want)] == want, f"{kind}.{name}: {list(have)} != {want}"
                assert all(p.default is not p.empty for p in extra), (
                    f"{kind}.{name}: the port calls it without {[p.name for p in extra]}"
                )


DEDUP_SCOPES = {
    # broker type, extra config: {destination: whether the broker keeps one message an id}
    ("nats", ()): {"orders.created": True},
    ("nats", (("jetstream", False),)): {"orders.created": False},
    ("sqs", ()): {"orders.fifo": True, "orders": False},
    ("sns", ()): {"orders.fifo": True, "orders": False},
    ("redis", ()): {"orders": True},
    ("kafka", ()): {"orders": False},
    ("kinesis", ()): {"orders": False},
    ("pubsub", ()): {"orders": False},
    ("rabbitmq", ()): {"orders": False},
    ("http", ()): {"orders": False},
}


@pytest.mark.parametrize(("kind", "extra"), list(DEDUP_SCOPES), ids=str)
def test_each_adapter_names_where_its_broker_drops_a_second_message_of_an_id(
    kind: str, extra: tuple[tuple[str, Any], ...]
) -> None:
    """`check --history` finds ids two outboxes share by it: a scope where only FIFO
    queues, JetStream and the Redis adapter's window drop a message, one string per queue or
    stream, and the same string for two subjects of one configured stream."""
    config = TypeAdapter(BrokerConfig).validate_python(
        {"type": kind, **MINIMAL[kind], **dict(extra)}
    )
    prober = typing.cast(Probing, create_publisher("b", config))
    for destination, drops in DEDUP_SCOPES[kind, extra].items():
        scope = prober.dedup_scope(destination)
        assert (scope is not None) == drops, (kind, destination, scope)
        if drops:
            assert prober.dedup_scope(destination) == scope
            assert prober.dedup_scope("other" + destination) != scope or kind == "nats"
    if kind == "nats" and not extra:
        streamed = {
            "type": "nats",
            **MINIMAL["nats"],
            "stream": {"name": "ORDERS", "subjects": ["orders.>"]},
        }
        prober = typing.cast(
            Probing, create_publisher("b", TypeAdapter(BrokerConfig).validate_python(streamed))
        )
        assert prober.dedup_scope("orders.a") == prober.dedup_scope("orders.b")
        assert "ORDERS" in (prober.dedup_scope("orders.a") or "")


@pytest.mark.parametrize("kind", ["sqs", "sns", "kinesis"])
async def test_an_outboxs_lanes_on_an_aws_broker_share_one_session(kind: str) -> None:
    """Each lane's publisher made an AWS session of its own, and each session loads
    botocore's models anew: eight Kinesis lanes took 67 MiB and 1.2 s against 10 MiB and
    0.6 s for one. The lanes of an outbox now share one; each still has its own client."""
    config = TypeAdapter(BrokerConfig).validate_python({"type": kind, **MINIMAL[kind]})
    lanes = create_publishers("b", config, 4)
    try:
        for publisher in lanes:
            await publisher.connect()  # makes the client; no request is sent
        sessions = {id(getattr(p, "_session", None)) for p in lanes}
        clients = {id(getattr(p, "_client", None)) for p in lanes}
        assert len(sessions) == 1 and len(clients) == 4
    finally:
        for publisher in lanes:
            await publisher.close()


def test_lanes_of_other_brokers_are_made_one_by_one() -> None:
    config = TypeAdapter(BrokerConfig).validate_python({"type": "nats", **MINIMAL["nats"]})
    lanes = create_publishers("b", config, 3)
    assert len({id(p) for p in lanes}) == 3
