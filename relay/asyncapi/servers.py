"""The contract's servers: where each configured broker is, and how clients authenticate.

Nothing here may carry a secret. Hosts come from URLs taken apart field by field (the
user and password part is never read), query strings are dropped, and security schemes say
only which kind of credential a broker wants, never its value.
"""

from __future__ import annotations

import re
from functools import singledispatch
from typing import Any

from relay.config import brokers as cfg
from relay.config.broker_identity import host_of

Object = dict[str, Any]

# A webhook's URL template as the contract keeps it: `relay contract diff` compares it whole.
URL_EXTENSION = "x-relay-url"
_LISTED = re.compile(r"^(?:Servers|Bootstrap servers): (?P<hosts>[^ ]+(?:, [^ ]+)*)\.$")
# What besides its hosts addresses a destination, as a server's summary states it: the same
# topic or stream name in another project, database or region is another one.
_SCOPE = re.compile(r"^(?P<what>Project|Database|Region) (?P<value>[^ ]+)\.$")
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_SASL = {"PLAIN": "plain", "SCRAM-SHA-256": "scramSha256", "SCRAM-SHA-512": "scramSha512"}


def servers(brokers: dict[str, cfg.BrokerConfig]) -> tuple[Object, Object]:
    """(servers, security schemes), one server per configured broker, named as in the config."""
    found: Object = {}
    schemes: Object = {}
    for name, broker in brokers.items():
        server, needs = _server(broker)
        security = []
        for scheme_name, scheme in needs.items():
            key = f"{name}-{scheme_name}"
            schemes[key] = scheme
            security.append({"$ref": f"#/components/securitySchemes/{key}"})
        if security:
            server["security"] = security
        found[name] = server
    return found, schemes


@singledispatch
def _server(broker: cfg.BrokerConfig) -> tuple[Object, Object]:
    """(server, security schemes) of one broker; each kind registers its own below."""
    raise TypeError(f"no AsyncAPI server for a {type(broker).__name__}")


def _listing(kind: str, hosts: list[str]) -> Object:
    """The first host is the server's; a cluster's others are named in its description."""
    server: Object = {"host": hosts[0]}
    if len(hosts) > 1:
        server["description"] = f"{kind}: {', '.join(hosts)}."
    return server


def hosts_of(server: Any) -> tuple[str, ...]:
    """Every host of a server `_listing` wrote: the cluster's, else its one host."""
    host = str(server.get("host", "")) if isinstance(server, dict) else ""
    listed = _LISTED.match(str(server.get("description", ""))) if host else None
    return tuple(listed["hosts"].split(", ")) if listed else (host,)


def scope_of(server: Any) -> str | None:
    """The Pub/Sub project, Redis database or AWS region a server's summary names."""
    summary = str(server.get("summary", "")) if isinstance(server, dict) else ""
    found = _SCOPE.match(summary)
    return f"{found['what'].lower()} {found['value']}" if found else None


def _mutual_tls(tls: Any) -> Object:
    if tls is not None and tls.cert_file is not None:
        return {"tls-client-certificate": {"type": "X509"}}
    return {}


@_server.register
def _nats(broker: cfg.NatsBrokerConfig) -> tuple[Object, Object]:
    server = _listing("Servers", [host_of(url)[0] for url in broker.servers])
    server["protocol"] = "nats"
    server["title"] = "NATS JetStream" if broker.jetstream else "NATS"
    if broker.stream is not None:
        server["summary"] = f"Stream {broker.stream.name}."
    needs: Object = {}
    if broker.user is not None:
        needs["user-password"] = {"type": "userPassword"}
    if broker.token is not None:
        needs["token"] = {"type": "apiKey", "in": "user", "description": "A NATS auth token."}
    if broker.creds_file is not None:
        needs["credentials"] = {
            "type": "asymmetricEncryption",
            "description": "A NATS credentials file: an NKey and a user JWT.",
        }
    return server, {**needs, **_mutual_tls(broker.tls)}


@_server.register
def _kafka(broker: cfg.KafkaBrokerConfig) -> tuple[Object, Object]:
    server = _listing("Bootstrap servers", [host_of(h)[0] for h in broker.bootstrap_servers])
    secure = broker.security_protocol in ("SSL", "SASL_SSL")
    server["protocol"] = "kafka-secure" if secure else "kafka"
    server["title"] = "Kafka"
    needs: Object = {}
    if broker.sasl_mechanism is not None and broker.security_protocol.startswith("SASL"):
        needs["sasl"] = {"type": _SASL[broker.sasl_mechanism]}
    return server, {**needs, **_mutual_tls(broker.tls)}


@_server.register
def _rabbitmq(broker: cfg.RabbitMqBrokerConfig) -> tuple[Object, Object]:
    url = broker.url.get_secret_value()  # only the scheme, host and path are read
    host, path = host_of(url)
    server: Object = {
        "host": host,
        "protocol": url.partition(":")[0].lower(),
        "protocolVersion": "0.9.1",
        "title": "RabbitMQ",
    }
    if path not in ("", "/"):
        server["pathname"] = path
    return server, {"user-password": {"type": "userPassword"}, **_mutual_tls(broker.tls)}


@_server.register
def _redis(broker: cfg.RedisBrokerConfig) -> tuple[Object, Object]:
    url = broker.url.get_secret_value().strip()  # only the scheme, host and path are read
    host, path = host_of(url)
    server: Object = {
        "host": host,
        "protocol": url.partition(":")[0].lower(),
        "title": "Redis Streams",
        "summary": f"Database {path.strip('/') or '0'}.",
    }
    needs: Object = {}
    userinfo, at, _ = url.partition("://")[2].rpartition("@")
    if broker.password is not None or (at and userinfo):
        needs["user-password"] = {"type": "userPassword", "description": "AUTH (an ACL user)."}
    return server, {**needs, **_mutual_tls(broker.tls)}


_AWS_TITLES = {"sqs": "Amazon SQS", "sns": "Amazon SNS", "kinesis": "Amazon Kinesis Data Streams"}


@_server.register
def _aws(
    broker: cfg.SqsBrokerConfig | cfg.SnsBrokerConfig | cfg.KinesisBrokerConfig,
) -> tuple[Object, Object]:
    if broker.endpoint_url is not None:
        host = host_of(broker.endpoint_url)[0]
    else:
        host = f"{broker.type}.{broker.region}.amazonaws.com"
    server: Object = {
        "host": host,
        "protocol": broker.type,
        "title": _AWS_TITLES[broker.type],
        "summary": f"Region {broker.region}.",
    }
    sigv4 = {
        "type": "symmetricEncryption",
        "description": "AWS credentials (Signature Version 4), from the standard AWS chain.",
    }
    return server, {"aws-sigv4": sigv4}


@_server.register
def _pubsub(broker: cfg.PubSubBrokerConfig) -> tuple[Object, Object]:
    host = broker.emulator_host or broker.endpoint or "pubsub.googleapis.com:443"
    server: Object = {
        "host": host,
        "protocol": "googlepubsub",
        "title": "Google Cloud Pub/Sub",
        "summary": f"Project {broker.project}.",
    }
    if broker.emulator_host is not None:
        return server, {}  # the emulator takes no credentials
    oauth = {
        "type": "oauth2",
        "description": "Google credentials: a service account key file, or Application"
        " Default Credentials.",
        "flows": {
            "clientCredentials": {
                "tokenUrl": "https://oauth2.googleapis.com/token",
                "availableScopes": {
                    "https://www.googleapis.com/auth/pubsub": "Publish to Pub/Sub topics."
                },
            }
        },
        "scopes": ["https://www.googleapis.com/auth/pubsub"],
    }
    return server, {"google-oauth2": oauth}


@_server.register
def _http(broker: cfg.HttpBrokerConfig) -> tuple[Object, Object]:
    """The receiver's host, or a variable when each destination names its own."""
    server: Object = {"title": "Webhooks", "summary": "A POST per message (Standard Webhooks)."}
    if broker.url.startswith("{"):
        server["host"] = "{receiver}"
        server["protocol"] = "https"
        server["variables"] = {"receiver": {"description": "The host a destination names."}}
    else:
        host, path = host_of(broker.url.partition("{")[0])
        server["host"] = host
        server["protocol"] = broker.url.partition(":")[0].lower()
        if path not in ("", "/"):
            server["pathname"] = path
    server[URL_EXTENSION] = url_template(broker.url)
    needs: Object = {
        f"header-{name.lower()}": {"type": "httpApiKey", "name": name, "in": "header"}
        for name in broker.headers  # the names only: their values are secrets
    }
    if broker.signing_keys:
        needs["standard-webhooks"] = {
            "type": "symmetricEncryption",
            "description": "Standard Webhooks: webhook-signature, HMAC-SHA256 with a whsec_ key.",
        }
    return server, {**needs, **_mutual_tls(broker.tls)}


def url_template(url: str) -> str:
    """A webhook URL with its placeholders, and nothing that may be secret: everything up to
    the last `@` goes (a user and password, as `host_of` drops them), and a query keeps its
    names and placeholders, each literal value (or bare token) written `***`."""
    scheme, sep, rest = url.strip().partition("://")
    url = f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url.strip().rpartition("@")[2]
    base, mark, query = url.partition("?")
    if not mark:
        return base
    fields = []
    for field in query.split("&"):
        name, equals, value = field.partition("=")
        if not equals:  # a bare token: as secret as a value
            name, value = "", name
        literal = _PLACEHOLDER.split(value)
        placeholders = [*_PLACEHOLDER.findall(value), ""]
        kept = "".join(
            ("***" if text else "") + p for text, p in zip(literal, placeholders, strict=True)
        )
        fields.append(f"{name}{'=' if equals else ''}{kept}")
    return f"{base}?{'&'.join(fields)}"
