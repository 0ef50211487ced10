"""Broker connection settings: a union of models chosen by the `type` field.

Secrets are SecretStr (never printed) and are usually written as `${VAR}` so
that they come from the environment, not the file.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from relay.config.base import (
    AmqpUrl,
    Model,
    PositiveDuration,
    TlsConfig,
    UrlError,
    check_nats_url,
)

_NATS_SCHEMES = ("nats", "tls", "ws", "wss")
_HTTP = re.compile(r"^https?://", re.IGNORECASE)


def codec_available(codec: str) -> bool:
    """Whether Kafka's `codec` can be used here: all but gzip need cramjam (as aiokafka)."""
    return codec in ("none", "gzip") or importlib.util.find_spec("cramjam") is not None


class NatsStreamConfig(Model):
    """A JetStream stream the relay creates if missing, or verifies if present."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,255}$")]
    subjects: list[str] = Field(min_length=1)
    create: bool = True
    storage: Literal["file", "memory"] = "file"
    duplicate_window: PositiveDuration = 120.0

    @field_validator("duplicate_window")
    @classmethod
    def _window_jetstream_takes(cls, window: float) -> float:
        """JetStream refuses a shorter one (10052): the stream could never be created."""
        if window < 0.1:
            raise ValueError("JetStream needs at least 100ms")
        return window


def _scheme(server: str) -> str:
    return server.partition("://")[0].lower() if "://" in server else "nats"


class TlsCapable(Model):
    """A broker reached over TLS when `tls` is set (see docs/brokers/README.md#tls)."""

    tls: TlsConfig | None = None


class NatsBrokerConfig(TlsCapable):
    type: Literal["nats"]
    servers: list[str] = Field(min_length=1)
    jetstream: bool = Field(
        True, description="False publishes with core NATS: no acknowledgement, no dedup."
    )
    stream: NatsStreamConfig | None = None
    user: str | None = Field(None, description="User name; with `password`.")
    password: SecretStr | None = Field(None, description="Write it as ${VAR}.")
    token: SecretStr | None = Field(None, description="An auth token instead of a user.")
    creds_file: str | None = Field(None, description="A .creds file (NKey and JWT).")
    connect_timeout: PositiveDuration = Field(2.0, description="Per connection attempt.")
    ack_timeout: PositiveDuration = Field(5.0, description="How long a batch waits for PubAcks.")

    @field_validator("servers")
    @classmethod
    def _servers_are_nats_urls(cls, servers: list[str]) -> list[str]:
        for index, server in enumerate(servers):
            scheme = _scheme(server)  # only the scheme is quoted: the rest may hold a password
            if scheme not in _NATS_SCHEMES:
                raise ValueError(
                    f"{scheme}:// is not a NATS URL scheme; use"
                    f" {', '.join(s + '://' for s in _NATS_SCHEMES)}"
                )
            try:
                check_nats_url(server, _NATS_SCHEMES)
            except UrlError as exc:
                raise ValueError(f"servers.{index}: {exc}") from None
        if len({scheme in ("ws", "wss") for scheme in map(_scheme, servers)}) > 1:
            raise ValueError("websocket (ws://, wss://) and other URLs cannot be mixed")
        return servers

    @field_validator("creds_file")
    @classmethod
    def _creds_file_exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no such file: {path}")
        return path

    @model_validator(mode="after")
    def _stream_needs_jetstream(self) -> NatsBrokerConfig:
        if self.stream is not None and not self.jetstream:
            raise ValueError("stream: a stream needs JetStream; remove it or set jetstream: true")
        return self


def _comma_separated(value: Any) -> Any:
    """`a:9092,b:9092`, as Kafka's own clients take it; a trailing comma is harmless."""
    if isinstance(value, str):
        servers = [part.strip() for part in value.split(",") if part.strip()]
        if not servers:
            raise ValueError("no server: write host:port, or several separated by commas")
        return servers
    return value


def _no_blank_entry(servers: list[str]) -> list[str]:
    if any(not server.strip() for server in servers):
        raise ValueError("an entry is empty: write host:port for each server")
    return [server.strip() for server in servers]


# A list of host:port, or one string of them separated by commas.
ServerList = Annotated[
    list[str],
    BeforeValidator(_comma_separated),
    AfterValidator(_no_blank_entry),
    Field(min_length=1),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "string", "pattern": "[^,\\s]"},
            ]
        }
    ),
]


class KafkaBrokerConfig(TlsCapable):
    type: Literal["kafka"]
    bootstrap_servers: ServerList
    enable_idempotence: bool = True
    transactional_id: str | None = None
    client_id: str = "outbox-relay"
    compression_type: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    max_request_size: Annotated[int, Field(ge=1024)] = 1_048_576
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = 30.0

    @field_validator("compression_type")
    @classmethod
    def _codec_is_installed(cls, codec: str) -> str:
        if codec in ("snappy", "lz4", "zstd") and not codec_available(codec):
            raise ValueError(f"{codec} needs the `cramjam` package (pip install cramjam)")
        return codec

    @model_validator(mode="after")
    def _security_is_complete(self) -> KafkaBrokerConfig:
        if self.security_protocol.startswith("SASL") and not (
            self.sasl_username and self.sasl_password
        ):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and sasl_password"
            )
        if self.tls is not None and self.security_protocol not in ("SSL", "SASL_SSL"):
            raise ValueError(
                f"tls: needs security_protocol SSL or SASL_SSL, not {self.security_protocol}"
            )
        return self


class RabbitMqExchange(Model):
    name: Annotated[str, Field(min_length=1)]
    type: Literal["direct", "topic", "fanout", "headers"] = "topic"
    durable: bool = True


class RabbitMqBrokerConfig(TlsCapable):
    type: Literal["rabbitmq"]
    # Checked here, not only in the adapter: yarl's error for a raw '/' in the password ends in
    # a piece of it, and a config error at load beats a traceback at the first publish.
    url: AmqpUrl = Field(description="amqp:// or amqps:// URL, credentials included.")
    mandatory: bool = True
    cloudevents_headers: Literal["amqp", "ce"] = Field(
        "amqp",
        description="amqp: `cloudEvents:` headers (AMQP binding); ce: `ce-` headers (the"
        " RabbitMQ binding of the CloudEvents SDKs).",
    )
    declare_exchanges: list[RabbitMqExchange] = []

    @property
    def header_prefix(self) -> str:
        """How the CloudEvents attributes are named in the message headers."""
        return "cloudEvents:" if self.cloudevents_headers == "amqp" else "ce-"

    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = 10.0

    @model_validator(mode="after")
    def _tls_needs_amqps(self) -> RabbitMqBrokerConfig:
        scheme = self.url.get_secret_value().strip().partition(":")[0].lower()
        if self.tls is not None and scheme != "amqps":
            raise ValueError("tls: needs an amqps:// url")
        return self


class SqsBrokerConfig(Model):
    """Credentials come from the standard AWS chain (environment, profile, role)."""

    type: Literal["sqs"]
    # botocore's own rule for region names; it refuses others when the client is made.
    region: Annotated[str, Field(pattern=r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?$")]
    endpoint_url: str | None = None

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_http(cls, url: str | None) -> str | None:
        if url is not None and not (_HTTP.match(url) and urlsplit(url).hostname):
            raise ValueError("must be an http:// or https:// URL with a host")
        return url

    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = 30.0


def _http_endpoint(url: str) -> str:
    if not (_HTTP.match(url) and urlsplit(url).hostname):
        raise ValueError("must be an http:// or https:// URL with a host")
    return url


# As SqsBrokerConfig's: botocore's rule for region names, and an endpoint that is a URL.
AwsRegion = Annotated[str, Field(pattern=r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?$")]
AwsEndpoint = Annotated[str, AfterValidator(_http_endpoint)]


class SnsBrokerConfig(Model):
    """Amazon SNS topics; credentials come from the standard AWS chain, as for SQS."""

    type: Literal["sns"]
    region: AwsRegion
    endpoint_url: AwsEndpoint | None = Field(
        None, description="Another SNS endpoint (a VPC endpoint, LocalStack, moto)."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(30.0, description="Read timeout of one SNS call.")


class KinesisBrokerConfig(Model):
    """Amazon Kinesis Data Streams; credentials come from the standard AWS chain."""

    type: Literal["kinesis"]
    region: AwsRegion
    endpoint_url: AwsEndpoint | None = Field(
        None, description="Another Kinesis endpoint (a VPC endpoint, LocalStack, moto)."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(30.0, description="Read timeout of one Kinesis call.")


BrokerConfig = Annotated[
    NatsBrokerConfig
    | KafkaBrokerConfig
    | RabbitMqBrokerConfig
    | SqsBrokerConfig
    | SnsBrokerConfig
    | KinesisBrokerConfig,
    Field(discriminator="type"),
]
