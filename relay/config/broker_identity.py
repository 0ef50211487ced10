"""Which broker an outbox publishes to, in words that hold no secret.

The checkpoint records it, so that a relay started with an outbox pointed at another
broker can say so: the checkpoint then stands for events the new broker never got.
An identity is the broker's type and the hosts it is reached at (`kafka a:9092,b:9092`);
no user, password or token is ever part of it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from relay.config.brokers import (
    KafkaBrokerConfig,
    NatsBrokerConfig,
    RabbitMqBrokerConfig,
    SqsBrokerConfig,
)

_DEFAULT_PORTS = {"nats": 4222, "tls": 4222, "kafka": 9092, "amqp": 5672, "amqps": 5671}


def broker_identity(
    config: NatsBrokerConfig | KafkaBrokerConfig | RabbitMqBrokerConfig | SqsBrokerConfig,
) -> str:
    """`<type> <host:port>[,<host:port>...]`, the hosts sorted; a vhost or region kept."""
    if isinstance(config, NatsBrokerConfig):
        hosts = [_host(server, "nats") for server in config.servers]
    elif isinstance(config, KafkaBrokerConfig):
        hosts = [_host(server, "kafka") for server in config.bootstrap_servers]
    elif isinstance(config, RabbitMqBrokerConfig):
        url = config.url.get_secret_value().strip()
        scheme = url.partition(":")[0].lower()
        vhost = urlsplit(url).path.removeprefix("/") or "/"
        hosts = [f"{_host(url, scheme)}/{vhost}"]
    else:
        endpoint = config.endpoint_url or f"https://sqs.{config.region}.amazonaws.com"
        hosts = [f"{_host(endpoint, 'https')}/{config.region}"]
    return f"{config.type} {','.join(sorted(set(hosts)))}"


def same_broker(recorded: str, current: str) -> bool:
    """Whether two identities may be the same broker: one type, at least one host shared.

    Adding a bootstrap server or a NATS seed of the same cluster keeps one in common.
    """
    type_a, _, hosts_a = recorded.partition(" ")
    type_b, _, hosts_b = current.partition(" ")
    return type_a == type_b and bool(set(hosts_a.split(",")) & set(hosts_b.split(",")))


def _host(address: str, default_scheme: str) -> str:
    """`host:port` of a URL or a bare `host:port`, without credentials; default port added."""
    text = address.strip()
    parts = urlsplit(text if "://" in text else f"{default_scheme}://{text}")
    try:
        port = parts.port
        host = parts.hostname or ""
    except ValueError:  # not a URL the clients would read either: keep the text after any '@'
        return text.rpartition("@")[2].lower()
    port = port or _DEFAULT_PORTS.get(parts.scheme.lower(), 443 if parts.scheme == "https" else 0)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host
