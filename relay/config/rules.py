"""Message rules: how one event type becomes one or more integration events.

`messages.<EventType>` is one rule (a mapping) or a list of rules. Each rule has a
name that identifies it in the parked table and the retry count: empty for the
single-rule form, else its integration `type` (with its id template when two rules
of the event share a type). Names and default ids depend on what a rule says, not
on where it stands in the list, so adding or reordering rules changes neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from relay.config.base import HeaderText, Model
from relay.config.yaml_file import plain
from relay.mapping.expressions import (
    SUFFIX_SEPARATOR,
    ExpressionError,
    compile_expression,
    compile_template,
    normalized,
)
from relay.mapping.message_schemas import SchemaError, load_schema

TemplateStr = Annotated[str, Field(min_length=1)]


def _compiles(compile_: Callable[[str], object]) -> Callable[[str], str]:
    """A validator: the value must compile, else its compiler's message is the error."""

    def check(value: str) -> str:
        try:
            compile_(value)
        except ExpressionError as exc:
            raise ValueError(str(exc)) from None
        return value

    return check


check_expression = _compiles(compile_expression)
check_template = _compiles(compile_template)
check_id_template = _compiles(partial(compile_template, distinct=True))


class MessageConfig(Model):
    """How one event type becomes one integration event."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, hide_input_in_errors=True, populate_by_name=True
    )

    type: Annotated[HeaderText, Field(min_length=1)]
    destination: TemplateStr
    key: TemplateStr | None = None
    id: TemplateStr | None = None
    routing_key: TemplateStr | None = None  # RabbitMQ only; the message type when absent
    payload: str | dict[str, str] = "data"
    when: str | None = None  # JMESPath; a falsy result skips the event for this rule
    # A file (made absolute by load_config, relative to the config file) or the schema inline.
    schema_: str | dict[str, Any] | None = Field(None, alias="schema")

    @field_validator("destination", "key", "routing_key")
    @classmethod
    def _templates_compile(cls, value: str | None) -> str | None:
        return None if value is None else check_template(value)

    @field_validator("id")
    @classmethod
    def _id_compiles(cls, value: str | None) -> str | None:
        return None if value is None else check_id_template(value)

    @field_validator("when")
    @classmethod
    def _when_compiles(cls, value: str | None) -> str | None:
        return None if value is None else check_expression(value)

    @field_validator("schema_")
    @classmethod
    def _schema_loads(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is not None:
            try:
                load_schema(value)
            except SchemaError as exc:
                raise ValueError(str(exc)) from None
        return plain(value) if isinstance(value, dict) else value

    @field_validator("payload", mode="after")
    @classmethod
    def _payload_compiles(cls, value: str | dict[str, str]) -> str | dict[str, str]:
        if isinstance(value, str):
            return check_expression(value)
        errors = []
        for field, expr in value.items():
            try:
                check_expression(expr)
            except ValueError as exc:
                errors.append(f"{field}: {exc}")
        if errors:
            raise ValueError("; ".join(errors))
        return value


def _form(value: Any) -> str:
    return "rules" if isinstance(value, list) else "rule"


# A callable discriminator: an error inside a list names that list's item, not also a
# complaint that the list is not a mapping (as a plain union would).
Messages = dict[
    str,
    Annotated[
        Annotated[MessageConfig, Tag("rule")]
        | Annotated[list[MessageConfig], Field(min_length=1), Tag("rules")],
        Discriminator(_form),
    ],
]


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of an event type, with what the config around it decides."""

    event_type: str
    config: MessageConfig
    name: str  # "" for the single-rule form; stable when siblings are added or reordered
    where: str  # its dotted key, for errors: outboxes.loans.messages.BookLent.1
    id: str  # the id template it renders
    key: str  # the key template it renders: its own, else the outbox's
    id_suffix: str  # appended to the rendered id: "/<type>" for a list rule without its own id

    @property
    def id_text(self) -> str:
        """The id template as compared between rules: the template and its suffix, its
        placeholders written alike (`{ version }` renders as `{version}` does)."""
        return normalized(self.id) + self.id_suffix

    @property
    def key_text(self) -> str:
        """The key template as compared between rules, its placeholders written alike."""
        return normalized(self.key)


def rules_of(
    outbox: str,
    messages: Mapping[str, MessageConfig | list[MessageConfig]],
    default_id: str,
    default_key: str,
) -> dict[str, tuple[Rule, ...]]:
    """Every event type's rules, named, with the id and key each one gets."""
    out: dict[str, tuple[Rule, ...]] = {}
    for event_type, given in messages.items():
        base = f"outboxes.{outbox}.messages.{event_type}"
        if isinstance(given, MessageConfig):
            id_, key = given.id or default_id, given.key or default_key
            out[event_type] = (Rule(event_type, given, "", base, id_, key, ""),)
            continue
        types = [m.type for m in given]
        rules = []
        for index, m in enumerate(given):
            id_ = m.id or default_id
            suffix = "" if m.id else SUFFIX_SEPARATOR + m.type
            shared = types.count(m.type) > 1
            name = f"{m.type} {id_ + suffix}" if shared else m.type
            key = m.key or default_key
            rules.append(Rule(event_type, m, name, f"{base}.{index}", id_, key, suffix))
        out[event_type] = tuple(rules)
    return out


def duplicate_ids(rules: Mapping[str, tuple[Rule, ...]]) -> str | None:
    """Two rules of one event type whose messages would get the same ids, worded; else None.

    Same ids for one event: JetStream's Nats-Msg-Id, an SQS FIFO queue or the consumers
    would drop the second message as a duplicate of the first, without a word.
    """
    for event_type, siblings in rules.items():
        seen: dict[str, Rule] = {}
        for rule in siblings:
            first = seen.setdefault(rule.id_text, rule)
            if first is not rule:
                key = f"{rule.where}.id" if rule.config.id else rule.where
                return (
                    f"{key}: rules {first.where} and {rule.where} give each {event_type} event"
                    f" the same message id (template {rule.id_text!r}): the broker or the"
                    " consumers would drop one as a duplicate of the other; give one of them"
                    " its own `id` (without one, a rule of a list gets the outbox's id followed"
                    " by / and its type)"
                )
    return None


def absolute_schema_paths(data: dict[str, Any], base: Path) -> None:
    """Make each rule's `schema:` file path absolute, relative to the config file's folder.

    Done on the parsed file before validation, so a relative path does not depend on the
    directory the relay is started from.
    """
    outboxes = data.get("outboxes")
    if not isinstance(outboxes, dict):
        return
    for outbox in outboxes.values():
        messages = outbox.get("messages") if isinstance(outbox, dict) else None
        if not isinstance(messages, dict):
            continue
        for given in messages.values():
            for rule in given if isinstance(given, list) else [given]:
                if isinstance(rule, dict) and isinstance(rule.get("schema"), str):
                    rule["schema"] = str(base / rule["schema"])
