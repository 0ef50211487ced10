"""What `relay contract diff` reads of a document `relay contract` wrote: each message type on
each channel, the server its consumers connect to, and the rules that feed it.

Kept apart from the comparison (diff.py) so that both sides are read alike, and a document
written before a field existed reads as "not recorded" (None), never as a value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

import jmespath
from jmespath.exceptions import JMESPathError

from relay.asyncapi.document import RULES_EXTENSION
from relay.asyncapi.envelopes import ID_TEXT, KEY_TEXT, RECORD_KEY_TEXT
from relay.asyncapi.servers import URL_EXTENSION, hosts_of, scope_of
from relay.config.broker_identity import canonical_host
from relay.core.publishing import STRUCTURED
from relay.errors import ContractError
from relay.mapping.expressions import ExpressionError, template_pieces


@dataclass(frozen=True)
class Endpoint:
    """What a consumer connects to: a broker's protocol, hosts and path (a webhook's URL),
    and the project, database or region its destinations are names in."""

    protocol: str
    hosts: tuple[str, ...]  # a cluster's: consumers reach it through any of them
    pathname: str
    url: str | None  # a webhook's URL template; None: not recorded, or not a webhook
    scope: str | None = None  # `project p`, `database 3`, `region r`; None: none
    written: str | None = field(default=None, compare=False)  # the URL as the document has it

    def same(self, other: Endpoint) -> bool:
        """The same server: one cluster (a host in common, in any order), the same path, the
        same project, database or region."""
        mine = (self.protocol, self.pathname, self.scope)
        theirs = (other.protocol, other.pathname, other.scope)
        urls = None in (self.url, other.url) or self.url == other.url
        return mine == theirs and urls and bool(set(self.hosts) & set(other.hosts))

    def __str__(self) -> str:
        said = self.written or self.url or f"{self.protocol}://{self.hosts[0]}{self.pathname}"
        return f"{said}, {self.scope}" if self.scope else said


@dataclass(frozen=True)
class Feed:
    """A rule that publishes to a channel: stored events of one type from one outbox."""

    outbox: str
    event: str
    aggregates: tuple[str, ...] | None
    when: str | None  # as written
    condition: str | None  # the `when` as compared: None when it takes every event
    id: str | None  # templates; None: not recorded
    key: str | None
    routing_key: str | None  # RabbitMQ's; None: not recorded, or another broker


@dataclass(frozen=True)
class Delivery:
    """One message of a type on one channel, as a consumer of that channel sees it."""

    type: str
    component: str  # the key in components.messages
    address: str
    server: str
    endpoint: Endpoint
    structured: bool
    message: Mapping[str, Any]
    key: str | None
    id: str | None
    feeds: tuple[Feed, ...] | None  # None: the document does not record them
    conditional: bool  # the message's description names a `when`
    routing_keys: tuple[str, ...] | None  # the channel's (AMQP `cc`); None: not AMQP


def deliveries(document: Any) -> list[Delivery]:
    """Every (message, channel) of a document `relay contract` wrote."""
    messages = _mapping(_mapping(document, "components"), "messages", "components.")
    servers = _mapping(document, "servers")
    routing = _routing_keys(document)
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
        endpoint = _endpoint(server)
        recorded = channel.get(RULES_EXTENSION)
        for name, reference in (channel.get("messages") or {}).items():
            component = _target(reference, "#/components/messages/", f"{where}.messages.{name}")
            message = messages.get(component)
            if not isinstance(message, Mapping) or not isinstance(message.get("name"), str):
                raise ContractError(f"components.messages.{component}: missing or has no name")
            key = _template(message, (KEY_TEXT, RECORD_KEY_TEXT))
            id_ = _template(message, (ID_TEXT,))
            feeds = None
            if isinstance(recorded, list):
                feeds = tuple(
                    _feed(f, key, id_)
                    for f in recorded
                    if isinstance(f, Mapping) and f.get("message") == component
                )
            found.append(
                Delivery(
                    type=message["name"],
                    component=component,
                    address=str(address),
                    server=server_name,
                    endpoint=endpoint,
                    structured=message.get("contentType") == STRUCTURED,
                    message=message,
                    key=key,
                    id=id_,
                    feeds=feeds,
                    conditional=", only when `" in str(message.get("description", "")),
                    routing_keys=routing.get(channel_key),
                )
            )
    return found


def _endpoint(server: Mapping[str, Any]) -> Endpoint:
    """A server as compared: hosts in lower case with their default port, a RabbitMQ vhost
    `/` however written (``, `/`, `/%2F`), a webhook URL's scheme and host alike."""
    protocol = str(server.get("protocol", "")).lower()
    pathname = str(server.get("pathname", ""))
    if protocol in ("amqp", "amqps"):
        vhost = unquote(pathname[1:]) if len(pathname) > 1 else "/"
        pathname = "" if vhost == "/" else "/" + quote(vhost, safe="")
    url = server.get(URL_EXTENSION)
    return Endpoint(
        protocol=protocol,
        hosts=tuple(_host(h, protocol) for h in hosts_of(dict(server))),
        pathname=pathname,
        url=_url(url) if isinstance(url, str) else None,
        scope=scope_of(dict(server)),
        written=url if isinstance(url, str) else None,
    )


def _host(host: str, protocol: str) -> str:
    return host if "{" in host else canonical_host(host, protocol)


def _url(url: str) -> str:
    """A webhook URL template with its scheme and host as compared (not its path)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url  # `{destination}...`: the host is the message's
    host = re.split(r"[/?#{]", rest, maxsplit=1)[0]
    return f"{scheme.lower()}://{_host(host, scheme.lower())}{rest[len(host) :]}"


def template(text: str | None) -> str | None:
    """A `{...}` template as compared: each placeholder's JMESPath tree, `@.` dropped, so that
    `{@.aggregate_id}`, `{ aggregate_id }` and `{aggregate_id}` are one template."""
    if text is None:
        return None
    try:
        pieces, tail = template_pieces(text)
    except ExpressionError:
        return text
    parts: list[Any] = []
    for before, expression in pieces:
        parts += [before, _tree(expression)]
    return json.dumps([*parts, tail], sort_keys=True)


def condition(when: str | None) -> str | None:
    """A `when` as compared: its JMESPath tree; None when it takes every event (`` `true` ``,
    any literal JMESPath holds true)."""
    if when is None:
        return None
    tree = _tree(when)
    if isinstance(tree, Mapping) and tree.get("type") == "literal":
        value = tree.get("value")
        if value is not None and value is not False and value not in ("", [], {}):
            return None
    return json.dumps(tree, sort_keys=True)


def _tree(expression: str) -> Any:
    try:
        return _plain(jmespath.compile(expression.strip()).parsed)
    except JMESPathError:
        return expression.strip()


def _plain(node: Any) -> Any:
    """A JMESPath tree without `@.` in front of a path: `@.a` reads what `a` reads."""
    if not isinstance(node, Mapping):
        return node
    children = [_plain(child) for child in node.get("children", [])]
    current = bool(children) and children[0].get("type") == "current"
    if node.get("type") == "subexpression" and current:
        rest = children[1:]
        return rest[0] if len(rest) == 1 else {**node, "children": rest}
    return {**node, "children": children} if children else dict(node)


def _routing_keys(document: Any) -> dict[str, tuple[str, ...]]:
    """Each channel's AMQP routing keys (`cc` of its send operation)."""
    found: dict[str, tuple[str, ...]] = {}
    operations = document.get("operations") if isinstance(document, Mapping) else None
    for operation in (operations or {}).values():
        if not isinstance(operation, Mapping):
            continue
        channel = operation.get("channel", {}).get("$ref", "")
        cc = operation.get("bindings", {}).get("amqp", {}).get("cc")
        if isinstance(channel, str) and isinstance(cc, list):
            name = channel.removeprefix("#/channels/").replace("~1", "/").replace("~0", "~")
            found[name] = tuple(str(k) for k in cc)
    return found


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


def _feed(entry: Mapping[str, Any], key: str | None, id_: str | None) -> Feed:
    """An `x-relay-rules` entry; a document that does not record a rule's id or key gives its
    message's."""
    aggregates = entry.get("aggregates")
    when = entry.get("when")
    when = when if isinstance(when, str) else None
    routing_key = entry.get("routing_key")
    return Feed(
        outbox=str(entry.get("outbox")),
        event=str(entry.get("event")),
        aggregates=tuple(aggregates) if isinstance(aggregates, list) else None,
        when=when,
        condition=condition(when),
        id=str(entry["id"]) if isinstance(entry.get("id"), str) else id_,
        key=str(entry["key"]) if isinstance(entry.get("key"), str) else key,
        routing_key=routing_key if isinstance(routing_key, str) else None,
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
