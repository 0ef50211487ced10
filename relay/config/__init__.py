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
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from relay.config.base import Duration, Identifier, Model, PositiveDuration
from relay.config.brokers import (
    BrokerConfig,
    KafkaBrokerConfig,
    NatsBrokerConfig,
    RabbitMqBrokerConfig,
    SqsBrokerConfig,
)
from relay.errors import ConfigError
from relay.expressions import ExpressionError, compile_expression, compile_template
from relay.yaml_file import YamlDocument, load_yaml

__all__ = [
    "BrokerConfig",
    "ColumnsConfig",
    "KafkaBrokerConfig",
    "NatsBrokerConfig",
    "OutboxConfig",
    "RabbitMqBrokerConfig",
    "RelayConfig",
    "SqsBrokerConfig",
    "load_config",
]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class DatabaseConfig(Model):
    url: SecretStr = Field(description="libpq URL of the database holding the event table.")
    schema_: Identifier = Field(
        "relay", alias="schema", description="Schema of the relay's tables."
    )
    connect_timeout: PositiveDuration = 5.0

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


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


class SourceConfig(Model):
    table: Annotated[
        str, Field(pattern=r"^([A-Za-z_][A-Za-z0-9_$]*\.)?[A-Za-z_][A-Za-z0-9_$]*$")
    ] = "events"
    columns: ColumnsConfig = ColumnsConfig()
    strategy: Literal["barrier"] = "barrier"
    notify_channel: Identifier = "relay_events"
    notify_trigger: bool = False  # `relay migrate` installs a NOTIFY trigger
    poll_interval: PositiveDuration = 1.0
    barrier_report_after: Duration = 1.0


class BatchConfig(Model):
    max_messages: Annotated[int, Field(ge=1, le=10_000)] = 500
    linger: Duration = 0.010


class RetryConfig(Model):
    initial: PositiveDuration = 0.1
    multiplier: Annotated[float, Field(ge=1.0)] = 2.0
    max: PositiveDuration = 30.0
    jitter: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2


def _check_expression(value: str) -> str:
    try:
        compile_expression(value)
    except ExpressionError as exc:
        raise ValueError(str(exc)) from None
    return value


def _check_template(value: str) -> str:
    try:
        compile_template(value)
    except ExpressionError as exc:
        raise ValueError(str(exc)) from None
    return value


TemplateStr = Annotated[str, Field(min_length=1)]


class MessageConfig(Model):
    """How one event type becomes one integration event."""

    type: Annotated[str, Field(min_length=1)]
    destination: TemplateStr
    key: TemplateStr | None = None
    id: TemplateStr | None = None
    routing_key: TemplateStr | None = None  # RabbitMQ only; the message type when absent
    payload: str | dict[str, str] = "data"

    @field_validator("destination", "key", "id", "routing_key")
    @classmethod
    def _templates_compile(cls, value: str | None) -> str | None:
        return None if value is None else _check_template(value)

    @field_validator("payload", mode="after")
    @classmethod
    def _payload_compiles(cls, value: str | dict[str, str]) -> str | dict[str, str]:
        if isinstance(value, str):
            return _check_expression(value)
        errors = []
        for field, expr in value.items():
            try:
                _check_expression(expr)
            except ValueError as exc:
                errors.append(f"{field}: {exc}")
        if errors:
            raise ValueError("; ".join(errors))
        return value


class OutboxConfig(Model):
    broker: str
    aggregates: list[str] | None = Field(
        None, description="Aggregate types to relay; all if absent."
    )
    messages: dict[str, MessageConfig] = Field(min_length=1)
    id: TemplateStr = "{aggregate_type}/{aggregate_id}@{version}"
    key: TemplateStr = "{aggregate_id}"
    cloudevents_source: str | None = None
    batch: BatchConfig = BatchConfig()
    retry: RetryConfig = RetryConfig()
    park_after: Annotated[int, Field(ge=1)] = 10
    start: Literal["beginning", "end"] = "beginning"

    @field_validator("id", "key")
    @classmethod
    def _templates_compile(cls, value: str) -> str:
        return _check_template(value)


def _whole_seconds(value: float) -> float:
    if value < 1 or value != int(value):
        raise ValueError("Postgres takes TCP keepalive times in whole seconds (1s or more)")
    return value


WholeSeconds = Annotated[PositiveDuration, AfterValidator(_whole_seconds)]


class KeepaliveConfig(Model):
    """Server-side TCP settings on the lease connection, so Postgres frees a dead holder's lock."""

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
    """/metrics, /healthz and /readyz."""

    enabled: bool = True
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 9464
    database_probe_interval: PositiveDuration = 5.0
    ready_after_database_silence: PositiveDuration = 15.0


class LoggingConfig(Model):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class ShutdownConfig(Model):
    grace_period: Duration = 10.0


class RelayConfig(BaseSettings):
    """The whole file. Built only through `load_config`, which adds file context."""

    model_config = SettingsConfigDict(
        env_prefix="RELAY_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        populate_by_name=True,
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
        # Environment beats the file, so an operator can override one key.
        return env_settings, init_settings

    @model_validator(mode="after")
    def _brokers_exist(self) -> RelayConfig:
        for name, outbox in self.outboxes.items():
            if outbox.broker not in self.brokers:
                known = ", ".join(sorted(self.brokers))
                raise ValueError(
                    f"outboxes.{name}.broker: unknown broker {outbox.broker!r}"
                    f" (configured: {known})"
                )
        return self


def config_path(path: str | Path | None) -> Path:
    """The file named on the command line, else in RELAY_CONFIG."""
    chosen = path or os.environ.get("RELAY_CONFIG")
    if not chosen:
        raise ConfigError("no config file: pass --config FILE or set RELAY_CONFIG")
    return Path(chosen)


def load_config(path: str | Path | None = None) -> RelayConfig:
    """Load, expand and validate; raise ConfigError naming file, line and key."""
    doc = load_yaml(config_path(path))
    try:
        return RelayConfig(**doc.data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, doc)) from None


def _describe(exc: ValidationError, doc: YamlDocument) -> str:
    lines = []
    for error in exc.errors(include_url=False):
        loc = _clean_loc(error["loc"], doc)
        msg = error["msg"].removeprefix("Value error, ")
        loc, msg = _point_at_field(loc, msg, doc)
        if error["type"] == "extra_forbidden":
            msg = "unknown key"
        elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            field = str(error.get("ctx", {}).get("discriminator", "type")).strip("'")
            loc = (*loc, field)
            expected = error.get("ctx", {}).get("expected_tags", "")
            msg = f"unknown or missing {field} (expected one of: {expected})"
        elif error["type"] == "missing":
            msg = "required key is missing"
        key = ".".join(str(p) for p in loc)
        lines.append(f"{doc.where(loc)}: {key}: {msg}" if key else f"{doc.path}: {msg}")
    count = len(lines)
    head = f"invalid config ({count} error{'s' if count > 1 else ''}):\n  "
    return head + "\n  ".join(lines)


def _point_at_field(
    loc: tuple[str | int, ...], msg: str, doc: YamlDocument
) -> tuple[tuple[str | int, ...], str]:
    """`payload: loanId: bad` becomes `payload.loanId: bad` when loanId is a key there."""
    node: Any = doc.data
    for part in loc:
        node = _child(node, part)
    field, sep, rest = msg.partition(": ")
    if sep and isinstance(node, dict) and field in node:
        return (*loc, field), rest
    return loc, msg


_ABSENT = object()


def _child(node: Any, part: str | int) -> Any:
    if isinstance(node, dict) and part in node:
        return node[part]
    if isinstance(node, list) and isinstance(part, int) and part < len(node):
        return node[part]
    return _ABSENT


def _clean_loc(loc: tuple[str | int, ...], doc: YamlDocument) -> tuple[str | int, ...]:
    """Drop pydantic's internal steps (union tags, `[key]`) that are not in the file."""
    out: list[str | int] = []
    node: Any = doc.data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        child = _child(node, part)
        if child is not _ABSENT:
            out.append(part)
            node = child
        elif last and isinstance(node, dict) and not str(part).startswith("["):
            out.append(part)
        elif isinstance(part, str) and part.startswith("function-"):
            continue
    return tuple(out)
