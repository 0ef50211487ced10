"""Which broker an outbox publishes to, in words that hold no secret.

The checkpoint records it, so that a relay started with an outbox pointed at another
broker can say so: the checkpoint then stands for events the new broker never got.
An identity is the broker's type and the hosts it is reached at (`kafka a:9092,b:9092`);
no user, password or token is ever part of it.
"""

from __future__ import annotations

import re

from relay.config.brokers import (
    BrokerConfig,
    HttpBrokerConfig,
    KafkaBrokerConfig,
    NatsBrokerConfig,
    PubSubBrokerConfig,
    RabbitMqBrokerConfig,
    RedisBrokerConfig,
)

_DEFAULT_PORTS = {
    "nats": 4222,
    "tls": 4222,
    "kafka": 9092,
    "amqp": 5672,
    "amqps": 5671,
    "redis": 6379,
    "rediss": 6379,
    "http": 80,
    "https": 443,
    "kafka-secure": 9092,  # the AsyncAPI protocol of Kafka over TLS
}


def broker_identity(config: BrokerConfig) -> str:
    """`<type> <host:port>[,<host:port>...]`, the hosts sorted; a vhost or region kept."""
    if isinstance(config, NatsBrokerConfig):
        hosts = [_host(server, "nats")[0] for server in config.servers]
    elif isinstance(config, KafkaBrokerConfig):
        hosts = [_host(server, "kafka")[0] for server in config.bootstrap_servers]
    elif isinstance(config, RabbitMqBrokerConfig):
        host, path = _host(config.url.get_secret_value(), "amqp")
        hosts = [f"{host}/{path.removeprefix('/') or '/'}"]
    elif isinstance(config, PubSubBrokerConfig):
        endpoint = config.emulator_host or config.endpoint or "pubsub.googleapis.com:443"
        hosts = [f"{endpoint}/{config.project}"]
    elif isinstance(config, RedisBrokerConfig):
        host, path = _host(config.url.get_secret_value(), "redis")
        hosts = [f"{host}/{path.removeprefix('/') or '0'}"]  # the database number
    elif isinstance(config, HttpBrokerConfig):
        # A URL that starts with {destination} names its hosts per message: `*` stands for them.
        fixed = not config.url.startswith("{")
        hosts = [_host(config.url.partition("{")[0], "https")[0] if fixed else "*"]
    else:
        endpoint = config.endpoint_url or f"https://{config.type}.{config.region}.amazonaws.com"
        hosts = [f"{_host(endpoint, 'https')[0]}/{config.region}"]
    return f"{config.type} {','.join(sorted(set(hosts)))}"


def same_broker(recorded: str, current: str) -> bool:
    """Whether two identities may be the same broker: one type, at least one host shared.

    Adding a bootstrap server or a NATS seed of the same cluster keeps one in common.
    """
    type_a, _, hosts_a = recorded.partition(" ")
    type_b, _, hosts_b = current.partition(" ")
    return type_a == type_b and bool(set(hosts_a.split(",")) & set(hosts_b.split(",")))


def host_of(address: str) -> tuple[str, str]:
    """(`host[:port]`, path) of a URL or a bare `host:port`, without user, password or query.

    Not urlsplit: a raw `/`, `#` or `?` in a password (NATS URLs are not checked at load)
    would end its netloc inside the password. Everything up to the last `@` is dropped,
    as `relay.redaction` does.
    """
    rest = address.strip().partition("://")[2] or address.strip()
    rest = rest.rpartition("@")[2]
    host = re.split(r"[/?#]", rest, maxsplit=1)[0]
    path = re.split(r"[?#]", rest[len(host) :], maxsplit=1)[0]
    return host, path


def canonical_host(host: str, scheme: str) -> str:
    """`host:port` of a bare `host[:port]`, lower case, with the scheme's default port."""
    return _host(f"{scheme}://{host}", scheme)[0]


def _host(address: str, default_scheme: str) -> tuple[str, str]:
    """(`host:port`, path), lower case, with the scheme's default port added."""
    scheme, sep, _ = address.strip().partition("://")
    if not sep:
        scheme = default_scheme
    hostport, path = host_of(address)
    if hostport.startswith("["):  # [IPv6]:port
        host, _, port = hostport.partition("]")
        host, port = f"{host}]", port.removeprefix(":")
    else:
        host, _, port = hostport.partition(":")
    if not port.isdigit():
        port = str(_DEFAULT_PORTS.get(scheme.lower(), ""))
    return (f"{host.lower()}:{port}" if port else host.lower()), path
