"""`relay contract diff`: what NEW's contract does to a consumer written against OLD's.

Both sides are documents `relay contract` wrote. Each message type of OLD is looked for in
NEW, on each channel it was sent to: its destination, broker, CloudEvents mode, key and ids,
the stored events and conditions that feed it, and its payload and headers schemas, judged
by what they admit (schema_inclusion.py). A change is `breaking`, `compatible`, `new` or
`unknown`; `unknown` is never taken for compatible.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from relay.asyncapi.document import RULES_EXTENSION
from relay.asyncapi.envelopes import ID_TEXT, KEY_TEXT, RECORD_KEY_TEXT
from relay.asyncapi.schema_inclusion import Inclusion, Side, root_ref
from relay.core.publishing import STRUCTURED
from relay.errors import ContractError

ChangeVerdict = Literal["breaking", "compatible", "new", "unknown"]
_VERSIONED = re.compile(r"^(?P<base>.+)\.v(?P<n>\d+)$")


@dataclass(frozen=True)
class Change:
    message: str  # the integration-event type
    path: str  # a JSON path in the message: $.payload.member.id, $.headers['ce-source']
    verdict: ChangeVerdict
    why: str
    channel: str | None = None  # the destination, where the change is on one of several

    def as_json(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "channel": self.channel,
            "path": self.path,
            "verdict": self.verdict,
            "why": self.why,
        }


@dataclass(frozen=True)
class Feed:
    """A rule that publishes to a channel: stored events of one type from one outbox."""

    outbox: str
    event: str
    aggregates: tuple[str, ...] | None
    when: str | None


@dataclass(frozen=True)
class Delivery:
    """One message type on one channel, as a consumer of that channel sees it."""

    type: str
    component: str  # the key in components.messages
    address: str
    server: str
    endpoint: tuple[str, str, str]  # protocol, host, pathname: what a consumer connects to
    structured: bool
    message: Mapping[str, Any]
    key: str | None
    id: str | None
    feeds: tuple[Feed, ...] | None  # None: the document does not record them
    conditional: bool  # the message's description names a `when`


def deliveries(document: Any) -> list[Delivery]:
    """Every (message type, channel) of a document `relay contract` wrote."""
    messages = _mapping(_mapping(document, "components"), "messages", "components.")
    servers = _mapping(document, "servers")
    found: list[Delivery] = []
    for channel_key, channel in _mapping(document, "channels").items():
        where = f"channels.{channel_key}"
        if not isinstance(channel, Mapping):
            raise ContractError(f"{where}: not a channel")
        address = channel.get("address") or channel.get("title") or channel_key
        server_name = _target(channel.get("servers", [{}])[0], "#/servers/", f"{where}.servers")
        server = servers.get(server_name)
        if not isinstance(server, Mapping):
            raise ContractError(f"{where}.servers: no server {server_name!r} in servers")
        endpoint = (
            str(server.get("protocol", "")),
            str(server.get("host", "")),
            str(server.get("pathname", "")),
        )
        recorded = channel.get(RULES_EXTENSION)
        for name, reference in (channel.get("messages") or {}).items():
            component = _target(reference, "#/components/messages/", f"{where}.messages.{name}")
            message = messages.get(component)
            if not isinstance(message, Mapping) or not isinstance(message.get("name"), str):
                raise ContractError(f"components.messages.{component}: missing or has no name")
            feeds = None
            if isinstance(recorded, list):
                feeds = tuple(_feed(f) for f in recorded if f.get("message") == component)
            found.append(
                Delivery(
                    type=message["name"],
                    component=component,
                    address=str(address),
                    server=server_name,
                    endpoint=endpoint,
                    structured=message.get("contentType") == STRUCTURED,
                    message=message,
                    key=_template(message, (KEY_TEXT, RECORD_KEY_TEXT)),
                    id=_template(message, (ID_TEXT,)),
                    feeds=feeds,
                    conditional=", only when `" in str(message.get("description", "")),
                )
            )
    return found


def diff(old: Any, new: Any) -> list[Change]:
    """Every change NEW makes for a consumer of OLD, in OLD's order, then NEW's new types."""
    before, after = _by_type(deliveries(old)), _by_type(deliveries(new))
    compare = _Comparison(old, new)
    changes: list[Change] = []
    for type_, olds in before.items():
        if type_ not in after:
            why = f"`{type_}` is gone: NEW publishes no such message"
            changes.append(Change(type_, "$", "breaking", why))
            continue
        for delivery in olds:
            changes += compare.delivery(delivery, after[type_])
        seen = {(d.endpoint, d.address) for d in olds} | compare.moved_to
        for added in after[type_]:
            if (added.endpoint, added.address) not in seen:
                seen.add((added.endpoint, added.address))
                why = f"also published to `{added.address}` on server `{added.server}`"
                changes.append(Change(type_, "$", "compatible", why, added.address))
    for type_, news in after.items():
        if type_ not in before:
            changes.append(Change(type_, "$", "new", _new_type(type_, news, before)))
    return changes


def _new_type(type_: str, news: list[Delivery], before: Mapping[str, Any]) -> str:
    places = ", ".join(dict.fromkeys(f"`{d.address}`" for d in news))
    why = f"a new message type, published to {places}"
    if (match := _VERSIONED.match(type_)) is not None:
        siblings = [
            t
            for t in before
            if (m := _VERSIONED.match(t)) and m["base"] == match["base"] and m["n"] != match["n"]
        ]
        if siblings:
            why += (
                f", beside `{siblings[-1]}`: the documented way to make a breaking change"
                " (a new type, while consumers move)"
            )
    return why


class _Comparison:
    def __init__(self, old: Any, new: Any) -> None:
        self.old, self.new = old, new
        self.moved_to: set[tuple[tuple[str, str, str], str]] = set()  # reported as a move

    def delivery(self, old: Delivery, news: list[Delivery]) -> list[Change]:
        type_, where = old.type, old.address
        here = [d for d in news if d.endpoint == old.endpoint and d.address == old.address]
        if not here:
            return [self._moved(old, news)]
        new = next((d for d in here if d.structured == old.structured), here[0])
        if new.structured != old.structured:
            why = (
                "the CloudEvents mode changed from structured to binary: the body is no longer "
                "the whole event, and the attributes are headers"
                if old.structured
                else "the CloudEvents mode changed from binary to structured: the body is the "
                "whole event, the payload under `data`, and the attributes are no longer headers"
            )
            return [Change(type_, "$.contentType", "breaking", why, where)]
        changes: list[Change] = []
        if old.key is not None and new.key is not None and old.key != new.key:
            why = (
                f"the key changed from `{old.key}` to `{new.key}`: messages are partitioned and "
                "ordered by another key"
            )
            changes.append(Change(type_, "$.key", "breaking", why, where))
        if old.id is not None and new.id is not None and old.id != new.id:
            why = (
                f"ids changed from `{old.id}` to `{new.id}`: a consumer that drops duplicates by "
                "id takes a re-sent event for a new one"
            )
            changes.append(Change(type_, "$.id", "breaking", why, where))
        changes += [Change(type_, p, v, w, where) for p, v, w in _feeds(old, new)]
        for part in ("payload", "headers"):
            changes += [Change(type_, p, v, w, where) for p, v, w in self._schema(old, new, part)]
        return changes

    def _moved(self, old: Delivery, news: list[Delivery]) -> Change:
        where = old.address
        same_place = [d for d in news if d.address == old.address]
        same_server = [d for d in news if d.endpoint == old.endpoint]
        if same_place:
            to = same_place[0]
            self.moved_to.add((to.endpoint, to.address))
            why = (
                f"the broker changed: `{where}` is now on server `{to.server}` "
                f"({_endpoint(to.endpoint)}), not `{old.server}` ({_endpoint(old.endpoint)})"
            )
            return Change(old.type, "$.channel.server", "breaking", why, where)
        if same_server:
            to = same_server[0]
            self.moved_to.add((to.endpoint, to.address))
            why = f"the destination changed from `{where}` to `{to.address}`"
            return Change(old.type, "$.channel.address", "breaking", why, where)
        why = f"no longer published to `{where}` on server `{old.server}`"
        return Change(old.type, "$.channel", "breaking", why, where)

    def _schema(
        self, old: Delivery, new: Delivery, part: str
    ) -> Iterator[tuple[str, ChangeVerdict, str]]:
        path = f"$.{part}"
        if part not in old.message:
            return
        if part not in new.message:
            yield path, "unknown", f"NEW's message has no {part} schema; OLD's has"
            return
        old_ref = root_ref(
            old.message[part], f"/components/messages/{_escape(old.component)}/{part}"
        )
        new_ref = root_ref(
            new.message[part], f"/components/messages/{_escape(new.component)}/{part}"
        )
        forward = Inclusion(Side(self.old, "OLD"), Side(self.new, "NEW"))
        found = forward.check([new_ref], [old_ref], path)
        for finding in found:
            yield finding.path, finding.verdict, finding.why
        if found:
            return
        backward = Inclusion(Side(self.new, "NEW"), Side(self.old, "OLD"))
        for finding in backward.check([old_ref], [new_ref], path):
            if finding.verdict == "breaking":
                yield finding.path, "compatible", f"narrower: {finding.why}"
            else:
                why = f"changed; every message NEW admits, OLD admits ({finding.why})"
                yield finding.path, "compatible", why


def _feeds(old: Delivery, new: Delivery) -> Iterator[tuple[str, ChangeVerdict, str]]:
    """Which stored events, and which conditions, feed the channel: a consumer of OLD must
    still receive every message it did."""
    if old.feeds is None or new.feeds is None:
        if old.conditional or new.conditional:
            older = "OLD" if old.feeds is None else "NEW"
            why = (
                f"{older} was written by a `relay contract` that did not record each channel's "
                "`when` conditions; compare the configs instead"
            )
            yield "$.when", "unknown", why
        return
    for feed in old.feeds:
        origin = f"stored `{feed.event}` events of outbox `{feed.outbox}`"
        same = [f for f in new.feeds if (f.outbox, f.event) == (feed.outbox, feed.event)]
        if not same:
            yield "$", "breaking", f"{origin} no longer publish it here"
            continue
        if feed.aggregates is not None or all(f.aggregates is not None for f in same):
            now = {a for f in same for a in f.aggregates or ()}
            gone = [a for a in feed.aggregates or () if a not in now]
            if feed.aggregates is None or gone:
                lost = ", ".join(f"`{a}`" for a in gone) if gone else "every other"
                why = f"{origin} of aggregate types {lost} no longer publish it here"
                yield "$.aggregates", "breaking", why
        whens = [f.when for f in same]
        if None in whens or feed.when in whens:
            continue
        conditions = " or ".join(f"`{w}`" for w in whens)
        if feed.when is None:
            why = (
                f"{origin} now publish it here only when {conditions}: the others no longer arrive"
            )
            yield "$.when", "breaking", why
        else:
            why = (
                f"the condition changed from `{feed.when}` to {conditions}: whether every event "
                "the old one took is still taken cannot be decided"
            )
            yield "$.when", "unknown", why
    for feed in new.feeds:
        if not any((f.outbox, f.event) == (feed.outbox, feed.event) for f in old.feeds):
            why = f"also published here from stored `{feed.event}` events of outbox `{feed.outbox}`"
            yield "$", "compatible", why


def _by_type(found: list[Delivery]) -> dict[str, list[Delivery]]:
    grouped: dict[str, list[Delivery]] = {}
    for delivery in found:
        grouped.setdefault(delivery.type, []).append(delivery)
    return grouped


def _mapping(node: Any, key: str, prefix: str = "") -> Mapping[str, Any]:
    value = node.get(key) if isinstance(node, Mapping) else None
    if not isinstance(value, Mapping):
        raise ContractError(f"{prefix}{key}: missing, or not a mapping")
    return value


def _target(reference: Any, prefix: str, where: str) -> str:
    ref = reference.get("$ref") if isinstance(reference, Mapping) else None
    if not isinstance(ref, str) or not ref.startswith(prefix):
        raise ContractError(f"{where}: not a reference to {prefix}...")
    return ref[len(prefix) :].replace("~1", "/").replace("~0", "~")


def _feed(entry: Any) -> Feed:
    aggregates = entry.get("aggregates")
    return Feed(
        outbox=str(entry.get("outbox")),
        event=str(entry.get("event")),
        aggregates=tuple(aggregates) if isinstance(aggregates, list) else None,
        when=entry.get("when"),
    )


def _template(message: Mapping[str, Any], texts: tuple[str, ...]) -> str | None:
    """A template the document states in a description (KEY_TEXT, ID_TEXT...)."""
    for description in _descriptions(message):
        for text in texts:
            before, after = text.split("{}")
            if description.startswith(before) and description.endswith(after):
                return description[len(before) : len(description) - len(after)]
    ordering = message.get("bindings", {}).get("googlepubsub", {}).get("orderingKey")
    return ordering if isinstance(ordering, str) and KEY_TEXT in texts else None


def _descriptions(message: Mapping[str, Any]) -> Iterator[str]:
    for part in ("headers", "payload"):
        properties = message.get(part, {}).get("properties", {})
        for schema in properties.values() if isinstance(properties, Mapping) else ():
            if isinstance(schema, Mapping) and isinstance(schema.get("description"), str):
                yield schema["description"]
    key = message.get("bindings", {}).get("kafka", {}).get("key", {})
    if isinstance(key, Mapping) and isinstance(key.get("description"), str):
        yield key["description"]


def _endpoint(endpoint: tuple[str, str, str]) -> str:
    protocol, host, pathname = endpoint
    return f"{protocol}://{host}{pathname}"


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
