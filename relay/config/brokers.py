"""Broker connection settings: a union of models chosen by the `type` field.

Secrets are SecretStr (never printed) and are usually written as `${VAR}` so
that they come from the environment, not the file.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import re
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
    ByteSize,
    ExistingFile,
    Model,
    PositiveDuration,
    RedisUrl,
    TlsConfig,
    UrlError,
    check_nats_url,
    path_step,
)

_NATS_SCHEMES = ("nats", "tls", "ws", "wss")
_HTTP = re.compile(r"^https?://", re.IGNORECASE)
# A Pub/Sub subscription id (as a topic id), or a subscription's full name.
_SUBSCRIPTION_ID = re.compile(r"(?!goog)[A-Za-z][A-Za-z0-9._~+%-]{2,254}")
_SUBSCRIPTION_PATH = re.compile(
    r"projects/[^/]+/subscriptions/(?!goog)[A-Za-z][A-Za-z0-9._~+%-]{2,254}"
)
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


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
    creds_file: ExistingFile | None = Field(None, description="A .creds file (NKey and JWT).")
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


def _short_string(name: str) -> str:
    """AMQP names a queue in a short string: 255 bytes at most."""
    if len(name.encode()) > 255:
        raise ValueError("a queue name is 255 bytes at most")
    return name


QueueName = Annotated[str, Field(min_length=1), AfterValidator(_short_string)]


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
    audit_streams: dict[str, QueueName] = Field(
        {},
        description="For the audit: the stream queue (x-queue-type: stream) it reads back for"
        ' each exchange, by exchange name ("" for the default exchange).',
    )

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


def _http_endpoint(url: str) -> str:
    if not (_HTTP.match(url) and urlsplit(url).hostname):
        raise ValueError("must be an http:// or https:// URL with a host")
    return url


class AwsConfig(Model):
    """What SQS, SNS and Kinesis share: credentials come from the standard AWS chain
    (environment, profile, role)."""

    # botocore's own rule for region names; it refuses others when the client is made.
    region: Annotated[str, Field(pattern=r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-]{0,61}[a-zA-Z0-9])?$")]
    endpoint_url: Annotated[str, AfterValidator(_http_endpoint)] | None = Field(
        None, description="Another endpoint of the service (a VPC endpoint, LocalStack, moto)."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(
        30.0, description="Read timeout of one call: seconds, or 10ms, 30s, 2m."
    )


class SqsBrokerConfig(AwsConfig):
    """Amazon SQS queues."""

    type: Literal["sqs"]


class PubSubBrokerConfig(Model):
    """Google Cloud Pub/Sub. Credentials: `credentials_file`, else Application Default
    Credentials (GOOGLE_APPLICATION_CREDENTIALS, workload identity, the metadata server)."""

    type: Literal["pubsub"]
    # A project id (6-30 characters), or a domain-scoped one (`example.com:my-project`).
    project: Annotated[
        str, Field(pattern=r"^(?:[a-z0-9][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    ]
    emulator_host: str | None = Field(
        None, description="host:port of a Pub/Sub emulator: plaintext, no credentials."
    )
    endpoint: str | None = Field(
        None, description="host:port of another API endpoint, e.g. a regional one."
    )
    credentials_file: ExistingFile | None = Field(
        None, description="A service account key file; without it, Application Default Credentials."
    )
    max_messages: Annotated[int, Field(ge=1, le=1000)] = Field(
        100, description="Messages per Publish call (Pub/Sub takes up to 1,000)."
    )
    max_bytes: Annotated[int, Field(ge=1024, le=10_000_000)] = Field(
        1_000_000, description="Bytes per Publish call (Pub/Sub takes up to 10 MB)."
    )
    max_latency: PositiveDuration = Field(
        0.01, description="How long the client waits to fill a Publish call."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(
        30.0, description="How long a batch waits for every Publish call it makes."
    )
    audit_subscription: str | None = Field(
        None,
        description="For the audit: the subscription it reads each topic back through, with"
        ' {topic} for the topic id ("{topic}-audit"); it needs retain_acked_messages.',
    )

    @field_validator("audit_subscription")
    @classmethod
    def _subscription_template(cls, template: str | None) -> str | None:
        if template is None:
            return None
        for name in _PLACEHOLDER.findall(template):
            if name != "topic":
                raise ValueError(f"{{{name}}} is not known; {{topic}} is the topic id")
        rendered = template.replace("{topic}", "loans")
        if not (_SUBSCRIPTION_ID.fullmatch(rendered) or _SUBSCRIPTION_PATH.fullmatch(rendered)):
            raise ValueError(
                "must make a subscription id (3-255 letters, digits or - _ . ~ + %, a letter"
                " first, not 'goog') or projects/<project>/subscriptions/<id>"
            )
        return template

    @field_validator("emulator_host", "endpoint")
    @classmethod
    def _host_and_port(cls, address: str | None) -> str | None:
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or "/" in address or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("must be host:port, without a scheme, for example 127.0.0.1:8085")
        return address

    @model_validator(mode="after")
    def _emulator_alone(self) -> PubSubBrokerConfig:
        if self.emulator_host is not None and (self.endpoint or self.credentials_file):
            raise ValueError(
                "emulator_host: the emulator takes no endpoint and no credentials_file;"
                " remove them or emulator_host"
            )
        return self


REDIS_MAX_BULK = 512 * 1024 * 1024  # Redis's proto-max-bulk-len by default: one field's limit


class RedisBrokerConfig(TlsCapable):
    """One Redis server (a primary); a destination is a stream key (docs/brokers/redis.md)."""

    type: Literal["redis"]
    url: RedisUrl = Field(
        description="redis:// or rediss:// (TLS) URL: host, port, database number."
    )
    username: str | None = Field(None, description="An ACL user; with `password`.")
    password: SecretStr | None = Field(None, description="Write it as ${VAR}.")
    maxlen: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Trim each stream to about this many entries (XADD MAXLEN ~)."
    )
    dedup_window: PositiveDuration = Field(
        120.0, description="How long an id is remembered per stream, to drop a re-send."
    )
    dedup_key_prefix: Annotated[str, Field(min_length=1)] = Field(
        "outbox-relay:dedup:", description="Each stream's set of recent ids: this + stream."
    )
    max_message_bytes: Annotated[ByteSize, Field(le=REDIS_MAX_BULK)] = Field(
        1024 * 1024, description="A bigger entry (fields and values) is parked, not sent."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(10.0, description="How long one batch call may take.")

    @model_validator(mode="after")
    def _tls_and_credentials(self) -> RedisBrokerConfig:
        url = self.url.get_secret_value().strip()
        if self.tls is not None and not url.lower().startswith("rediss://"):
            raise ValueError("tls: needs a rediss:// url")
        userinfo, at, _ = url.partition("://")[2].rpartition("@")
        if self.password is not None and at and ":" in userinfo:
            raise ValueError("password: the url has one too; give it in one place")
        if self.username is not None and self.password is None:
            raise ValueError("username: needs a password")
        return self


# What `url` may name: the message's destination as written, its key and type encoded.
HTTP_URL_FIELDS = ("destination", "key", "type")
_URL_FIELD = re.compile(r"\{([^{}]*)\}")
# A header name (RFC 9110 token), and the names the relay writes itself.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_RELAY_HEADERS = ("content-type", "content-length", "host", "idempotency-key", "transfer-encoding")
_RELAY_PREFIXES = ("webhook-", "ce-")


def _signing_key(secret: SecretStr) -> SecretStr:
    """A Standard Webhooks secret: `whsec_` and base64 of at least 24 bytes (never quoted)."""
    text = secret.get_secret_value()
    if not text.startswith("whsec_"):
        raise ValueError("a signing key starts with whsec_ (Standard Webhooks)")
    try:
        key = base64.b64decode(text.removeprefix("whsec_"), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a signing key is whsec_ then base64; this one is not base64") from None
    if len(key) < 24:
        raise ValueError(f"a signing key needs at least 24 bytes of key; this one has {len(key)}")
    return secret


SigningKey = Annotated[SecretStr, AfterValidator(_signing_key)]


class HttpBrokerConfig(TlsCapable):
    """Webhooks: a POST per message, signed as Standard Webhooks say (docs/brokers/http.md)."""

    type: Literal["http"]
    url: str = Field(
        "{destination}",
        description="http(s):// URL; may name {destination} (as written), {key} and {type}"
        " (percent-encoded).",
    )
    headers: dict[str, SecretStr] = Field(
        {}, description="Sent with every request; values are secret: write them as ${VAR}."
    )
    signing_keys: list[SigningKey] = Field(
        [], description="whsec_ keys; one signature per key, so that a key can be rotated."
    )
    max_in_flight: Annotated[int, Field(ge=1, le=1024)] = Field(
        16, description="Requests in flight together; never two of one key."
    )
    max_body_bytes: Annotated[int, Field(ge=1)] = Field(
        1_048_576, description="A bigger body is not sent: parked."
    )
    follow_redirects: bool = Field(False, description="Else a 3xx answer is parked.")
    retry_after_max: PositiveDuration = Field(
        300.0, description="Retry-After longer than this is cut to it."
    )
    connect_timeout: PositiveDuration = 5.0
    ack_timeout: PositiveDuration = Field(10.0, description="How long a request may take.")

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str) -> str:
        for name in _URL_FIELD.findall(url):
            if name not in HTTP_URL_FIELDS:
                raise ValueError(
                    f"{{{name}}} is not a field of a message; use"
                    f" {', '.join('{' + f + '}' for f in HTTP_URL_FIELDS)}"
                )
        rendered = urlsplit(_URL_FIELD.sub("x", url))
        if (step := path_step(rendered.path)) is not None or "#" in url:
            # Every request would be refused for it (relay.brokers.http).
            what = f"the path step {step!r}" if step is not None else "a '#'"
            raise ValueError(f"holds {what}: write the URL the requests go to as it is")
        if url.startswith("{destination}"):
            return url  # the destination brings the scheme and host: checked per message
        if not (_HTTP.match(url) and rendered.hostname):
            raise ValueError("must be an http:// or https:// URL with a host, or {destination}")
        return url

    @field_validator("headers")
    @classmethod
    def _headers_are_the_operators(cls, headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, value in headers.items():
            lower = name.lower()
            if not _TOKEN.match(name):
                raise ValueError(f"{name!r} is not a header name")
            if lower in _RELAY_HEADERS or lower.startswith(_RELAY_PREFIXES):
                raise ValueError(f"{name}: the relay writes this header itself")
            text = value.get_secret_value()
            if not text.isprintable() or text != text.strip():
                raise ValueError(  # the value is not quoted: it may be a secret
                    f"{name}: no control characters and no whitespace at either end"
                )
        return headers


class SnsBrokerConfig(AwsConfig):
    """Amazon SNS topics."""

    type: Literal["sns"]


class KinesisBrokerConfig(AwsConfig):
    """Amazon Kinesis Data Streams."""

    type: Literal["kinesis"]


BrokerConfig = Annotated[
    NatsBrokerConfig
    | KafkaBrokerConfig
    | RabbitMqBrokerConfig
    | SqsBrokerConfig
    | PubSubBrokerConfig
    | RedisBrokerConfig
    | HttpBrokerConfig
    | SnsBrokerConfig
    | KinesisBrokerConfig,
    Field(discriminator="type"),
]
