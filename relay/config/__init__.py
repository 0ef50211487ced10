"""Typed configuration: pydantic models, frozen once loaded, no globals.

Sources, strongest first: `RELAY_*` environment variables (nested keys joined
by `__`, e.g. `RELAY_DATABASE__URL`), then the YAML file, then the defaults
written here. Every error names the file, the line and the dotted key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from relay.config.audit import AuditConfig
from relay.config.base import (
    ByteSize,
    Duration,
    HeaderText,
    Identifier,
    Model,
    PositiveDuration,
    PostgresUrl,
)
from relay.config.brokers import (
    BrokerConfig,
    HttpBrokerConfig,
    KafkaBrokerConfig,
    KinesisBrokerConfig,
    NatsBrokerConfig,
    PubSubBrokerConfig,
    RabbitMqBrokerConfig,
    RedisBrokerConfig,
    SnsBrokerConfig,
    SqsBrokerConfig,
)
from relay.config.overrides import NotJson, read_overrides
from relay.config.rules import (
    MessageConfig,
    Messages,
    Rule,
    TemplateStr,
    absolute_schema_paths,
    check_expression,
    check_id_template,
    check_template,
    duplicate_ids,
    rules_of,
)
from relay.config.yaml_file import load_yaml
from relay.errors import ConfigError

__all__ = [
    "BrokerConfig",
    "ColumnsConfig",
    "HttpBrokerConfig",
    "KafkaBrokerConfig",
    "KinesisBrokerConfig",
    "MessageConfig",
    "NatsBrokerConfig",
    "OutboxConfig",
    "PubSubBrokerConfig",
    "RabbitMqBrokerConfig",
    "RedisBrokerConfig",
    "RelayConfig",
    "Rule",
    "SnsBrokerConfig",
    "SqsBrokerConfig",
    "TraceContextConfig",
    "load_config",
]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class RetryConfig(Model):
    """Backoff between attempts: initial, x multiplier each time, capped at max, jittered."""

    initial: PositiveDuration = 0.1
    multiplier: Annotated[float, Field(ge=1.0)] = 2.0
    max: PositiveDuration = 30.0
    jitter: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2


class DatabaseConfig(Model):
    # Checked at load: a URL the driver cannot read would otherwise be retried for ever as an
    # outage, and the driver's error text can quote a piece of the password.
    url: PostgresUrl = Field(description="libpq URL of the database holding the event table.")
    schema_: Identifier = Field(
        "relay", alias="schema", description="Schema of the relay's tables."
    )
    connect_timeout: PositiveDuration = 5.0
    # Reconnecting after the database went away: its own pace, not any outbox's publishing.
    retry: RetryConfig = RetryConfig()

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, hide_input_in_errors=True
    )


class ColumnsConfig(Model):
    """Column names of the event table; `metadata` and `created_at` may be null (absent)."""

    position: Identifier = "position"
    aggregate_type: Identifier = "aggregate_type"
    aggregate_id: Identifier = "aggregate_id"
    version: Identifier = "version"
    type: Identifier = "type"
    payload: Identifier = "payload"
    metadata: Identifier | None = "metadata"
    created_at: Identifier | None = "created_at"


MIN_POLL_INTERVAL = 0.010
COSTLY_POLL_INTERVAL = 0.100


def _poll_floor(value: float) -> float:
    """Each poll of an idle table runs the drain barrier and a read; 1ms kept 34% of a core busy."""
    if value < MIN_POLL_INTERVAL * (1 - 1e-9):
        raise ValueError(
            "must be at least 10ms: even on an idle table every poll runs the drain barrier "
            "and a read, so a shorter interval keeps a CPU core busy in the relay and in the "
            "database; for low latency set source.notify_trigger: true (and run relay migrate), "
            "which wakes the relay at each insert, and keep poll_interval as the fallback (1s)"
        )
    return value


PollInterval = Annotated[PositiveDuration, AfterValidator(_poll_floor)]


NOTIFY_CHANNEL_MAX = 63 - len("relay_notify_")


class SurviveFailoverConfig(Model):
    """Publish an event only once its commit is on standbys: with asynchronous replication,
    a failover can take back commits the standby never got, and a message already sent for
    one would announce an event the database no longer has."""

    standbys: Annotated[int, Field(ge=1, le=32)] = Field(
        1, description="How many streaming standbys must have flushed an event's commit."
    )
    without_standbys: Literal["wait", "publish"] = Field(
        "wait",
        description="Fewer standbys streaming than `standbys`: hold every event back (wait),"
        " or publish without them (publish).",
    )


class SourceConfig(Model):
    table: Annotated[
        str, Field(pattern=r"^([A-Za-z_][A-Za-z0-9_$]*\.)?[A-Za-z_][A-Za-z0-9_$]*$")
    ] = "events"
    columns: ColumnsConfig = ColumnsConfig()
    strategy: Literal["barrier"] = "barrier"
    notify_channel: Identifier = "relay_events"
    notify_trigger: bool = False  # `relay migrate` installs a NOTIFY trigger
    poll_interval: PollInterval = 1.0
    barrier_report_after: Duration = 1.0
    survive_failover: SurviveFailoverConfig | None = None  # off: publish once committed

    @field_validator("notify_channel")
    @classmethod
    def _channel_names_fit(cls, channel: str) -> str:
        """The trigger is named relay_notify_<channel>; Postgres cuts names at 63 bytes."""
        if len(channel) > NOTIFY_CHANNEL_MAX:
            raise ValueError(
                f"at most {NOTIFY_CHANNEL_MAX} characters (it has {len(channel)}): the "
                "trigger relay migrate installs, relay_notify_<channel>, must fit Postgres's "
                "63-byte names"
            )
        return channel


class BatchConfig(Model):
    max_messages: Annotated[int, Field(ge=1, le=10_000)] = 500
    # A batch holds bodies of at most this many bytes; an event larger on its own goes alone.
    # It bounds memory: at most two batches are held at once (one sent, one read ahead).
    max_bytes: ByteSize = 4 * 1024 * 1024
    linger: Duration = 0.010


class TraceContextConfig(Model):
    """Where an event holds its W3C trace context: JMESPath expressions over the envelope."""

    traceparent: Annotated[str, Field(min_length=1)] = "metadata.traceparent"
    tracestate: Annotated[str, Field(min_length=1)] | None = "metadata.tracestate"

    @field_validator("traceparent", "tracestate")
    @classmethod
    def _expressions_compile(cls, value: str | None) -> str | None:
        return None if value is None else check_expression(value)

    def expressions(self) -> list[str]:
        return [self.traceparent, *([self.tracestate] if self.tracestate else [])]


def _trace_context_switch(value: Any) -> Any:
    """`trace_context: true` reads the defaults (metadata.traceparent, metadata.tracestate)."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


class OutboxConfig(Model):
    broker: str
    aggregates: list[str] | None = Field(
        None, description="Aggregate types to relay; all if absent."
    )
    messages: Messages = Field(min_length=1)
    id: TemplateStr = "{aggregate_type}/{aggregate_id}@{version}"
    key: TemplateStr = "{aggregate_id}"
    cloudevents_source: HeaderText | None = None
    cloudevents: Literal["binary", "structured"] = Field(
        "binary",
        description="binary: attributes in headers, the payload as the body; structured: the"
        " whole event as the body (application/cloudevents+json).",
    )
    trace_context: Annotated[TraceContextConfig | None, BeforeValidator(_trace_context_switch)] = (
        Field(None, description="Carry each event's W3C traceparent/tracestate (or `true`).")
    )
    batch: BatchConfig = BatchConfig()
    retry: RetryConfig = RetryConfig()
    park_after: Annotated[int, Field(ge=1)] = 10
    start: Literal["beginning", "end"] = "beginning"
    partitions: Annotated[int, Field(ge=1, le=1024)] = Field(
        1,
        description="Lanes the outbox is split into, by a stable hash of each aggregate; each"
        " lane has its own lease and checkpoint, so replicas share the work. Change it with"
        " `relay repartition`.",
    )
    audit: AuditConfig = AuditConfig()

    @field_validator("key")
    @classmethod
    def _key_compiles(cls, value: str) -> str:
        return check_template(value)

    @field_validator("id")
    @classmethod
    def _id_compiles(cls, value: str) -> str:
        return check_id_template(value)

    def rules(self, name: str) -> dict[str, tuple[Rule, ...]]:
        """Each event type's rules, named; `name` is this outbox's, for their dotted keys."""
        return rules_of(name, self.messages, self.id, self.key)

    def source(self, name: str) -> str:
        """The CloudEvents `source` of this outbox's messages (`name` is the outbox's)."""
        return self.cloudevents_source or f"/outbox-relay/{name}"


def _whole_seconds(value: float) -> float:
    if value < 1 or value != int(value):
        raise ValueError("Postgres takes TCP keepalive times in whole seconds (1s or more)")
    return value


WholeSeconds = Annotated[PositiveDuration, AfterValidator(_whole_seconds)]


class KeepaliveConfig(Model):
    """TCP keepalives: server settings on the lease connection, so Postgres frees a dead
    holder's lock; and the relay's side of every connection, so a dead path fails a statement."""

    idle: WholeSeconds = 5.0
    interval: WholeSeconds = 2.0
    count: Annotated[int, Field(ge=1)] = 3
    connection_check_interval: PositiveDuration = 1.0

    @property
    def dead_after(self) -> float:
        """Seconds after which the server drops a silent peer."""
        return self.idle + self.interval * self.count


class LeaseConfig(Model):
    """One advisory lock per outbox decides which replica relays it."""

    namespace: Annotated[str, Field(min_length=1, max_length=63)] = "relay"
    retry_interval: PositiveDuration = 1.0
    check_interval: PositiveDuration = 1.0
    check_timeout: PositiveDuration = 1.0
    takeover_after: PositiveDuration = 5.0
    max_per_replica: Annotated[int, Field(ge=1)] | None = None
    keepalives: KeepaliveConfig = KeepaliveConfig()

    @property
    def orphan_after(self) -> float:
        """Seconds after which Postgres itself ends a lease session that has sent nothing.

        A live one never waits that long (it proves its locks every `check_interval`, or
        looks at the lanes every `retry_interval`); one whose client is gone behind a proxy
        that keeps the server's side open would otherwise keep its connection slot for good.
        """
        return 2 * max(self.takeover_after, self.retry_interval, self.check_interval)

    @model_validator(mode="after")
    def _holder_fences_itself_first(self) -> LeaseConfig:
        fenced_by = self.check_interval + self.check_timeout
        if fenced_by >= self.keepalives.dead_after:
            raise ValueError(
                f"check_interval + check_timeout ({fenced_by:g}s) must stay below what the "
                f"keepalives allow (idle + interval x count = {self.keepalives.dead_after:g}s), "
                "so that a cut-off holder stops itself before the server frees its lock"
            )
        if fenced_by >= self.takeover_after:
            raise ValueError(
                f"takeover_after ({self.takeover_after:g}s) must exceed check_interval + "
                f"check_timeout ({fenced_by:g}s)"
            )
        return self


class HttpConfig(Model):
    """/metrics, /healthz, /readyz and the status page."""

    enabled: bool = True
    # The read-only status page (`/`, `/status.json`): the whole fleet, from Postgres.
    status_page: bool = True
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 9464
    database_probe_interval: PositiveDuration = 5.0
    ready_after_database_silence: PositiveDuration = 15.0
    # A scraper that sends half a request, or never reads the answer, costs a file
    # descriptor: each connection gets this long to send its request, and again to take
    # the response; past max_connections the oldest is closed.
    request_timeout: PositiveDuration = 5.0
    max_connections: Annotated[int, Field(ge=1)] = 64


class LoggingConfig(Model):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class ShutdownConfig(Model):
    grace_period: Duration = 10.0


# The broker types an audit cannot read back, and why (relay/brokers/__init__.py's readers).
UNREADABLE_BROKERS = {
    "sqs": "a queue hands each message to one consumer",
    "sns": "a topic keeps no message once delivered",
    "http": "a webhook receiver keeps what it received",
}


def _unauditable(broker: BrokerConfig) -> str | None:
    """Why an audit cannot read this broker back, known from its config alone."""
    if broker.type in UNREADABLE_BROKERS:
        return f"({broker.type}) cannot be read back ({UNREADABLE_BROKERS[broker.type]})"
    if broker.type == "pubsub" and broker.audit_subscription is None:
        return "(pubsub) names no audit_subscription for the audit to read each topic through"
    if broker.type == "rabbitmq" and not broker.audit_streams:
        return "(rabbitmq) names no audit_streams: only a stream queue can be read back"
    if broker.type == "nats" and not broker.jetstream:
        return "(nats) publishes with core NATS (jetstream: false), which keeps nothing"
    return None


class RelayConfig(BaseSettings):
    """The whole file. Built only through `load_config`, which adds file context."""

    model_config = SettingsConfigDict(
        env_prefix="RELAY_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        populate_by_name=True,
        hide_input_in_errors=True,  # errors are worded by load_config; inputs may be secrets
    )

    database: DatabaseConfig
    source: SourceConfig = SourceConfig()
    brokers: dict[Annotated[str, Field(pattern=_NAME)], BrokerConfig] = Field(min_length=1)
    outboxes: dict[Annotated[str, Field(pattern=_NAME)], OutboxConfig] = Field(min_length=1)
    lease: LeaseConfig = LeaseConfig()
    http: HttpConfig = HttpConfig()
    logging: LoggingConfig = LoggingConfig()
    shutdown: ShutdownConfig = ShutdownConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment beats the file, but load_config applies it (relay.config.overrides):
        # a variable replaces the key it names, where pydantic-settings would merge into it.
        return (init_settings,)

    def outbox(self, name: str) -> OutboxConfig:
        """The named outbox; a ConfigError naming the configured ones otherwise."""
        if name not in self.outboxes:
            known = ", ".join(sorted(self.outboxes))
            raise ConfigError(f"unknown outbox {name!r} (configured: {known})")
        return self.outboxes[name]

    @model_validator(mode="after")
    def _brokers_exist(self) -> RelayConfig:
        for name, outbox in self.outboxes.items():
            if outbox.broker not in self.brokers:
                known = ", ".join(sorted(self.brokers))
                raise ValueError(
                    f"outboxes.{name}.broker: unknown broker {outbox.broker!r}"
                    f" (configured: {known})"
                )
            if outbox.audit.enabled and (why := _unauditable(self.brokers[outbox.broker])):
                raise ValueError(
                    f"outboxes.{name}.audit.enabled: broker {outbox.broker!r} {why}: no audit"
                    " can prove its delivery"
                )
        return self

    @model_validator(mode="after")
    def _ids_do_not_collide(self) -> RelayConfig:
        """Refuse two outboxes that would send the same event with the same id to one place.

        Both read the same row, so both messages carry the same id; the broker (JetStream's
        Nats-Msg-Id, an SQS FIFO queue) or the consumers drop the second as a duplicate, and
        one outbox silently delivers nothing.
        """
        for name, outbox in self.outboxes.items():
            if clash := duplicate_ids(outbox.rules(name)):
                raise ValueError(clash)
        names = list(self.outboxes)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                if clash := _clash(first, self.outboxes[first], second, self.outboxes[second]):
                    raise ValueError(clash)
        return self

    def warnings(self) -> list[str]:
        """Settings that are legal but cost more than they are likely worth, in words.

        Not errors: a short poll is a valid trade of CPU for latency. The commands decide where
        to show these (`relay check`, the log of `relay run`).
        """
        found: list[str] = []
        poll = self.source.poll_interval
        if poll < COSTLY_POLL_INTERVAL:
            # An idle outbox waits poll_interval, lingers, then runs one barrier pass and a read.
            linger = min(outbox.batch.linger for outbox in self.outboxes.values())
            rate = 1 / (poll + linger)
            passes = f"an idle outbox makes about {rate:.0f} barrier passes a second"
            if len(self.outboxes) > 1:
                passes += f" ({len(self.outboxes)} outboxes: about {rate * len(self.outboxes):.0f})"
            if self.source.notify_trigger:
                found.append(
                    f"source.poll_interval is {poll * 1000:g}ms: with source.notify_trigger on, "
                    f"polling is only the fallback for a missed NOTIFY, yet {passes}; "
                    "1s is usually enough"
                )
            else:
                found.append(
                    f"source.poll_interval is {poll * 1000:g}ms and source.notify_trigger is "
                    f"off: {passes}, each a few queries, even when nothing is written; for low "
                    "latency set source.notify_trigger: true (and run relay migrate) and keep "
                    "poll_interval at 1s"
                )
        return found


def _may_share_events(a: list[str] | None, b: list[str] | None) -> bool:
    """Whether one event can pass both aggregate filters (None lets every aggregate through)."""
    if a is None:
        return b is None or bool(b)
    if b is None:
        return bool(a)
    return bool({*a} & {*b})


def _clash(first: str, a: OutboxConfig, second: str, b: OutboxConfig) -> str | None:
    """Why `a` and `b` would publish the same ids to the same place, or None if they cannot."""
    if a.broker != b.broker:
        return None
    if not _may_share_events(a.aggregates, b.aggregates):
        return None
    rules_a, rules_b = a.rules(first), b.rules(second)
    for event_type, siblings in rules_b.items():
        for rb in siblings:
            for ra in rules_a.get(event_type, ()):
                if ra.config.destination != rb.config.destination or ra.id_text != rb.id_text:
                    continue
                if _same_messages(ra, a, rb, b):
                    continue  # a copy (a backfill's outbox): the one dropped is the other
                if rb.config.id is not None:
                    where = f"{rb.where}.id"
                elif "id" in b.model_fields_set:
                    where = f"outboxes.{second}.id"
                else:
                    where = rb.where
                return (
                    f"{where}: outboxes {first!r} and {second!r} both publish event type "
                    f"{event_type!r} to destination {ra.config.destination!r} on broker "
                    f"{a.broker!r} with the id template {ra.id_text!r}: the broker or the "
                    "consumers would drop one outbox's messages as duplicates of the other's; "
                    "give one of them a different `id` template, for example "
                    f"{ra.id + '/' + second!r}"
                )
    return None


def _same_messages(ra: Rule, a: OutboxConfig, rb: Rule, b: OutboxConfig) -> bool:
    """Whether two outboxes' rules make each event's message alike: same rule (its own `id`
    aside, compared rendered), same key, same CloudEvents mode. A broker dropping one as a
    duplicate of the other then loses nothing, as contracts.md's backfill relies on."""
    return (
        ra.config.model_copy(update={"id": None}) == rb.config.model_copy(update={"id": None})
        and ra.key_text == rb.key_text
        and a.cloudevents == b.cloudevents
    )


def config_path(path: str | Path | None) -> Path:
    """The file named on the command line, else in RELAY_CONFIG."""
    chosen = path or os.environ.get("RELAY_CONFIG")
    if not chosen:
        raise ConfigError("no config file: pass --config FILE or set RELAY_CONFIG")
    return Path(chosen)


def load_config(path: str | Path | None = None) -> RelayConfig:
    """Load, expand and validate; raise ConfigError naming file, line and key."""
    doc = load_yaml(config_path(path))
    absolute_schema_paths(doc.data, doc.path.parent)
    try:
        overrides = read_overrides(RelayConfig, doc.data)
    except NotJson as exc:
        raise ConfigError(f"{doc.path}: {exc}") from None
    try:
        return RelayConfig(**overrides.merged)
    except ValidationError as exc:
        raise ConfigError(doc.describe(exc, overrides)) from None
