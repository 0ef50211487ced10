"""`relay contract diff`: what NEW's contract does to a consumer written against OLD's.

Both sides are documents `relay contract` wrote (read by diff_reading.py). Each message type
of OLD is looked for in NEW, on each channel it was sent to: the server, the CloudEvents mode,
what feeds it (diff_feeds.py: stored events, conditions, ids, keys, routing keys, copies), and
its messages' headers and payload, judged by what they admit (schema_inclusion.py). A type
may have several messages on one channel (two rules, two shapes): each NEW message must be
admitted by OLD's, taken together, and their order is no change. A change is `breaking`,
`compatible`, `new` or `unknown`; `unknown` is never taken for compatible.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from relay.asyncapi.diff_feeds import feeds, routing_keys
from relay.asyncapi.diff_reading import Delivery, deliveries
from relay.asyncapi.schema_inclusion import Finding, Inclusion, Side, member
from relay.asyncapi.schema_shapes import Ref

__all__ = ["Change", "deliveries", "diff"]

ChangeVerdict = Literal["breaking", "compatible", "new", "unknown"]
_VERSIONED = re.compile(r"^(?P<base>.+)\.v(?P<n>\d+)$")
_PARTS = ("headers", "payload")
# Where the comparison puts the schema of a whole message (its headers and payload), in a
# copy of each document, so that `$ref`s and validators read it as part of the document.
_COMPARED = "x-relay-diff"


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
        news = after[type_]
        reached: set[int] = set()  # NEW's messages compared, or reported as moved to
        for place in _places(olds):
            first = place[0]
            here = [
                d for d in news if d.address == first.address and d.endpoint.same(first.endpoint)
            ]
            if not here:
                change, here = compare.moved(first, news)
                changes.append(change)
            else:
                changes += compare.place(place, here)
            reached |= {id(d) for d in here}
        for place in _places([d for d in news if id(d) not in reached]):
            why = f"also published to `{place[0].address}` on server `{place[0].server}`"
            changes.append(Change(type_, "$", "compatible", why, place[0].address))
    for type_, news in after.items():
        if type_ not in before:
            changes += _added(type_, news, before)
    return changes


def _added(type_: str, news: list[Delivery], before: Mapping[str, list[Delivery]]) -> list[Change]:
    """A type OLD did not have: `new` on channels of its own, `unknown` on one OLD carries,
    whose consumers may not filter on the type."""
    found: list[Change] = []
    fresh: list[Delivery] = []
    for place in _places(news):
        first = place[0]
        there = [
            t
            for t, olds in before.items()
            if any(d.address == first.address and d.endpoint.same(first.endpoint) for d in olds)
        ]
        if not there:
            fresh += place
            continue
        carried = ", ".join(f"`{t}`" for t in there)
        why = (
            f"a new message type on `{first.address}`, which OLD already carries ({carried}): "
            "its consumers that do not filter on the type receive a body of another shape; "
            "publish it to a destination of its own"
        )
        found.append(Change(type_, "$", "unknown", why, first.address))
    if fresh:
        found.append(Change(type_, "$", "new", _new_type(type_, fresh, before)))
    return found


def _places(found: list[Delivery]) -> list[list[Delivery]]:
    """One side's messages of a type, by channel: each the same address on the same server."""
    grouped: dict[tuple[object, str], list[Delivery]] = {}
    for delivery in found:
        grouped.setdefault((delivery.endpoint, delivery.address), []).append(delivery)
    return list(grouped.values())


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

    def place(self, olds: list[Delivery], news: list[Delivery]) -> list[Change]:
        """A type's messages on one channel, OLD's and NEW's."""
        type_, where = olds[0].type, olds[0].address

        def changes(found: Iterator[tuple[str, ChangeVerdict, str]]) -> list[Change]:
            return [Change(type_, path, verdict, why, where) for path, verdict, why in found]

        modes = {d.structured for d in olds}
        if moved := [d for d in news if d.structured not in modes]:
            why = (
                "the CloudEvents mode changed from binary to structured: the body is the "
                "whole event, the payload under `data`, and the attributes are no longer headers"
                if moved[0].structured
                else "the CloudEvents mode changed from structured to binary: the body is no "
                "longer the whole event, and the attributes are headers"
            )
            return [Change(type_, "$.contentType", "breaking", why, where)]
        found = changes(_unrecorded_url(olds[0], news[0]))
        found += changes(feeds(olds, news))
        found += changes(routing_keys(olds, news))
        return found + changes(self._schemas(olds, news))

    def moved(self, old: Delivery, news: list[Delivery]) -> tuple[Change, list[Delivery]]:
        """OLD's channel is not in NEW: where its messages went, and NEW's messages there."""
        where = old.address
        same_place = [d for d in news if d.address == old.address]
        same_server = [d for d in news if d.endpoint.same(old.endpoint)]
        if same_place:
            to = same_place[0]
            there = [d for d in news if (d.endpoint, d.address) == (to.endpoint, to.address)]
            webhook = None not in (old.endpoint.url, to.endpoint.url)
            if webhook and (old.endpoint.protocol, old.endpoint.hosts) == (
                to.endpoint.protocol,
                to.endpoint.hosts,
            ):
                why = (
                    f"the webhook URL changed from `{old.endpoint}` to `{to.endpoint}`: its "
                    "receiver gets these messages at another URL"
                )
            else:
                why = (
                    f"the broker changed: `{where}` is now on server `{to.server}` "
                    f"({to.endpoint}), not `{old.server}` ({old.endpoint})"
                )
            return Change(old.type, "$.channel.server", "breaking", why, where), there
        if same_server:
            to = same_server[0]
            there = [d for d in news if (d.endpoint, d.address) == (to.endpoint, to.address)]
            why = f"the destination changed from `{where}` to `{to.address}`"
            return Change(old.type, "$.channel.address", "breaking", why, where), there
        why = f"no longer published to `{where}` on server `{old.server}`"
        return Change(old.type, "$.channel", "breaking", why, where), []

    def _schemas(
        self, olds: list[Delivery], news: list[Delivery]
    ) -> Iterator[tuple[str, ChangeVerdict, str]]:
        """Each NEW message within OLD's: one of them, or (several) all of them together."""
        alone = len(olds) == 1 and len(news) == 1
        for new in news:
            label = "" if len(news) == 1 else f"NEW's message `{new.component}`: "
            for part in _PARTS:
                if part not in new.message and any(part in o.message for o in olds):
                    why = f"{label}NEW's message has no {part} schema; OLD's has"
                    yield f"$.{part}", "unknown", why
            yield from self._message(new, olds, label, alone)
        if not alone:
            for old in olds:
                if all(self._within(old, [new], {}, forward=False) for new in news):
                    why = (
                        f"OLD's message `{old.component}` is within none of NEW's: every "
                        "message NEW sends here, OLD sent"
                    )
                    yield "$", "compatible", why

    def _message(
        self, new: Delivery, olds: list[Delivery], label: str, alone: bool
    ) -> Iterator[tuple[str, ChangeVerdict, str]]:
        unset = _unset(new, olds)
        singles = [self._within(new, [old], unset) for old in olds]
        if any(not found for found in singles):
            for part, names in unset.items():
                for name in names:
                    why = f"{label}no longer sent; OLD's messages have it as optional"
                    yield member(f"$.{part}", name), "compatible", why
            if alone:
                yield from self._narrower(olds[0], new)
            return
        within = ""
        if len(olds) == 1:
            found = singles[0]
        else:
            found = self._within(new, olds, unset)
            named = ", ".join(f"`{o.component}`" for o in olds)
            within = f"within none of OLD's messages {named} of this type here alone: "
        for finding in found:
            why = finding.why
            if within and why.startswith("no single alternative"):  # the union, said plainly
                why = "together they may admit it, which is not decided"
            yield finding.path, finding.verdict, f"{label}{within}{why}"

    def _narrower(self, old: Delivery, new: Delivery) -> Iterator[tuple[str, ChangeVerdict, str]]:
        for finding in self._within(old, [new], {}, forward=False):
            if finding.verdict == "breaking":
                yield finding.path, "compatible", f"narrower: {finding.why}"
            else:
                why = f"changed; every message NEW admits, OLD admits ({finding.why})"
                yield finding.path, "compatible", why

    def _within(
        self,
        message: Delivery,
        others: list[Delivery],
        unset: Mapping[str, list[str]],
        *,
        forward: bool = True,
    ) -> list[Finding]:
        """What keeps `message` (NEW's, or OLD's when not `forward`) from being within
        `others` (the other side's, taken together): their headers and payloads at once."""
        parts = [p for p in _PARTS if p in message.message and all(p in o.message for o in others)]
        if not parts:
            return []
        mine, theirs = (self.new, self.old) if forward else (self.old, self.new)
        names = ("NEW", "OLD") if forward else ("OLD", "NEW")
        node = _whole(message, parts, unset)
        wholes = [_whole(other, parts, {}) for other in others]
        union = wholes[0] if len(wholes) == 1 else {"anyOf": wholes}
        inclusion = Inclusion(
            Side({**theirs, _COMPARED: union}, names[1]),
            Side({**mine, _COMPARED: node}, names[0]),
            reverse=not forward,
        )
        return inclusion.check([Ref(node, f"/{_COMPARED}")], [Ref(union, f"/{_COMPARED}")], "$")


def _whole(message: Delivery, parts: list[str], unset: Mapping[str, list[str]]) -> Any:
    """A message's headers and payload as one schema, each by reference; `unset` names the
    headers (and structured-mode attributes) it does not send."""
    properties: dict[str, Any] = {}
    for part in parts:
        ref = {"$ref": f"#/components/messages/{_escape(message.component)}/{part}"}
        names = unset.get(part)
        properties[part] = (
            {"allOf": [ref, {"properties": dict.fromkeys(names, False)}]} if names else ref
        )
    return {"type": "object", "properties": properties, "required": parts}


def _unset(new: Delivery, olds: list[Delivery]) -> dict[str, list[str]]:
    """What OLD's messages describe and NEW's does not set, where the relay writes every name:
    the headers, and in structured mode the body's attributes. A header NEW's open schema no
    longer names is one the relay no longer sends, not one of any value."""
    found: dict[str, list[str]] = {}
    for part in _PARTS:
        if part == "payload" and not new.structured:
            continue  # the rule's payload: its open schema admits any value for it
        described = _names(new.message.get(part))
        if described is None:
            continue
        gone = [n for o in olds for n in _names(o.message.get(part)) or () if n not in described]
        if gone:
            found[part] = list(dict.fromkeys(gone))
    return found


def _names(schema: Any) -> list[str] | None:
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    return list(properties) if isinstance(properties, Mapping) else None


def _unrecorded_url(old: Delivery, new: Delivery) -> Iterator[tuple[str, ChangeVerdict, str]]:
    if (old.endpoint.url is None) != (new.endpoint.url is None):
        older = "OLD" if old.endpoint.url is None else "NEW"
        why = (
            f"{older} was written by a `relay contract` that did not record the webhook URL "
            "past its first placeholder; compare the configs instead"
        )
        yield "$.channel.server", "unknown", why


def _by_type(found: list[Delivery]) -> dict[str, list[Delivery]]:
    grouped: dict[str, list[Delivery]] = {}
    for delivery in found:
        grouped.setdefault(delivery.type, []).append(delivery)
    return grouped


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
