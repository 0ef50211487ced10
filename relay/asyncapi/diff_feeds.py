"""`relay contract diff` on what feeds a message type on a channel: which stored events, under
which conditions, and with which ids, keys and routing keys.

A consumer of OLD must still receive every message it did, once, as it did: the stored events
that fed the channel still do (their aggregates, their conditions), each with the same id
(a consumer that drops duplicates by id), key (order) and routing key (the queues bound to
it). Feeds are compared as sets: their order in the config is no change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from relay.asyncapi.diff_reading import Delivery, Feed, template

Verdict = Literal["breaking", "compatible", "new", "unknown"]
Found = tuple[str, Verdict, str]  # path, verdict, why


def feeds(olds: list[Delivery], news: list[Delivery]) -> Iterator[Found]:
    """Every change to what feeds the channel, each stored event type of OLD by itself."""
    old_feeds, new_feeds = _all(olds), _all(news)
    if old_feeds is None or new_feeds is None:
        yield from _unrecorded(olds, news, "OLD" if old_feeds is None else "NEW")
        return
    for origin, same_old in _by_origin(old_feeds).items():
        outbox, event = origin
        said = f"stored `{event}` events of outbox `{outbox}`"
        same = [f for f in new_feeds if (f.outbox, f.event) == origin]
        if not same:
            yield "$", "breaking", f"{said} no longer publish it here"
            continue
        yield from _aggregates(said, same_old, same)
        yield from _conditions(said, same_old, same)
        yield from _templates(same_old, same)
        yield from _routing(said, same_old, same)
    for origin in _by_origin(new_feeds).keys() - _by_origin(old_feeds).keys():
        why = f"also published here from stored `{origin[1]}` events of outbox `{origin[0]}`"
        yield "$", "compatible", why
    yield from _copies(old_feeds, new_feeds)


def _all(deliveries: list[Delivery]) -> list[Feed] | None:
    found: list[Feed] = []
    for delivery in deliveries:
        if delivery.feeds is None:
            return None
        found += delivery.feeds
    return found


def _by_origin(found: list[Feed]) -> dict[tuple[str, str], list[Feed]]:
    grouped: dict[tuple[str, str], list[Feed]] = {}
    for feed in found:
        grouped.setdefault((feed.outbox, feed.event), []).append(feed)
    return grouped


def _aggregates(said: str, olds: list[Feed], news: list[Feed]) -> Iterator[Found]:
    if any(f.aggregates is None for f in news):
        return
    now = {a for f in news for a in f.aggregates or ()}
    if any(f.aggregates is None for f in olds):
        lost = "every other"
    elif gone := [a for f in olds for a in f.aggregates or () if a not in now]:
        lost = ", ".join(f"`{a}`" for a in dict.fromkeys(gone))
    else:
        return
    yield "$.aggregates", "breaking", f"{said} of aggregate types {lost} no longer publish it here"


def _conditions(said: str, olds: list[Feed], news: list[Feed]) -> Iterator[Found]:
    conditions = [f.condition for f in news]
    if None in conditions:
        return
    for feed in olds:
        if feed.condition in conditions:
            continue
        listed = " or ".join(dict.fromkeys(f"`{f.when}`" for f in news))
        if feed.condition is None:
            why = f"{said} now publish it here only when {listed}: the others no longer arrive"
            yield "$.when", "breaking", why
        else:
            why = (
                f"the condition changed from `{feed.when}` to {listed}: whether every event "
                "the old one took is still taken cannot be decided"
            )
            yield "$.when", "unknown", why


def _templates(olds: list[Feed], news: list[Feed]) -> Iterator[Found]:
    """The ids and keys of these events: another id, or another key, for an event it had."""
    for field, path in (("key", "$.key"), ("id", "$.id")):
        before = {template(getattr(f, field)): getattr(f, field) for f in olds}
        after = {template(getattr(f, field)): getattr(f, field) for f in news}
        if None in before or None in after:
            continue
        if field == "id" and before.keys() <= after.keys():
            continue  # the old ids stay; a second one is a copy, which _copies judges
        if after.keys() - before.keys():
            yield path, "breaking", _template_change(field, before, after)


def _template_change(
    field: str, before: dict[str | None, str | None], after: dict[str | None, str | None]
) -> str:
    was = " or ".join(f"`{t}`" for t in before.values())
    now = " or ".join(f"`{t}`" for t in after.values())
    if field == "key":
        return (
            f"the key changed from {was} to {now}: messages are partitioned and ordered by "
            "another key"
        )
    return (
        f"ids changed from {was} to {now}: a consumer that drops duplicates by id takes a "
        "re-sent event for a new one"
    )


def _routing(said: str, olds: list[Feed], news: list[Feed]) -> Iterator[Found]:
    before = {template(f.routing_key): f.routing_key for f in olds}
    after = {template(f.routing_key): f.routing_key for f in news}
    if None in before or None in after:
        return  # not RabbitMQ, or not recorded: the channel's routing keys are compared
    if gone := [text for key, text in before.items() if key not in after]:
        was = ", ".join(f"`{k}`" for k in gone)
        now = ", ".join(f"`{k}`" for k in after.values())
        why = (
            f"the routing key of {said} changed from {was} to {now}: queues bound to {was} "
            "no longer receive them"
        )
        yield "$.routingKey", "breaking", why
    elif added := [text for key, text in after.items() if key not in before]:
        why = f"{said} are also routed with {', '.join(f'`{k}`' for k in added)}"
        yield "$.routingKey", "compatible", why


def _copies(olds: list[Feed], news: list[Feed]) -> Iterator[Found]:
    """Stored events published twice here under two ids, which NEW does and OLD did not."""
    before = _pairs(olds)
    for found, (verdict, one, other) in _pairs(news).items():
        if found in before and (before[found][0] == "breaking" or verdict == "unknown"):
            continue
        outboxes = dict.fromkeys((one.outbox, other.outbox))
        where = " and ".join(f"`{o}`" for o in outboxes)
        said = f"stored `{one.event}` events of outbox{'es' if len(outboxes) > 1 else ''} {where}"
        twice = f"{said} are published here twice, with ids `{one.id}` and `{other.id}`"
        if verdict == "breaking":
            why = f"{twice}: a consumer that drops duplicates by id processes each event twice"
        else:
            why = (
                f"{twice} when both `{one.when}` and `{other.when}` hold, which cannot be "
                "decided: a consumer that drops duplicates by id would process those twice"
            )
        yield "$.id", verdict, why


def _pairs(found: list[Feed]) -> dict[tuple[str, frozenset[str]], tuple[Verdict, Feed, Feed]]:
    """Two rules that publish one stored event here with two ids: certain (`breaking`) when a
    condition of them takes every event or both are the same, else `unknown`."""
    pairs: dict[tuple[str, frozenset[str]], tuple[Verdict, Feed, Feed]] = {}
    for index, one in enumerate(found):
        for other in found[index + 1 :]:
            ids = template(one.id), template(other.id)
            if one.event != other.event or None in ids or ids[0] == ids[1]:
                continue
            if not _overlap(one.aggregates, other.aggregates):
                continue
            conditions = one.condition, other.condition
            certain = None in conditions or conditions[0] == conditions[1]
            verdict: Verdict = "breaking" if certain else "unknown"
            key = (one.event, frozenset(i for i in ids if i is not None))
            if key not in pairs or verdict == "breaking":
                pairs[key] = (verdict, one, other)
    return pairs


def _overlap(one: tuple[str, ...] | None, other: tuple[str, ...] | None) -> bool:
    return one is None or other is None or bool(set(one) & set(other))


def _unrecorded(olds: list[Delivery], news: list[Delivery], older: str) -> Iterator[Found]:
    """A document written before `x-relay-rules`: its messages' own keys and ids compared."""
    if any(d.conditional for d in [*olds, *news]):
        why = (
            f"{older} was written by a `relay contract` that did not record each channel's "
            "`when` conditions; compare the configs instead"
        )
        yield "$.when", "unknown", why
    for field, path in (("key", "$.key"), ("id", "$.id")):
        before = {template(getattr(d, field)): getattr(d, field) for d in olds}
        after = {template(getattr(d, field)): getattr(d, field) for d in news}
        before.pop(None, None)
        after.pop(None, None)
        if before and after and after.keys() - before.keys():
            yield path, "breaking", _template_change(field, before, after)


def routing_keys(olds: list[Delivery], news: list[Delivery]) -> Iterator[Found]:
    """RabbitMQ, where the rules do not record their routing keys: the channel's `cc`."""
    old_feeds, new_feeds = _all(olds), _all(news)
    recorded = [f.routing_key for f in [*(old_feeds or []), *(new_feeds or [])]]
    if old_feeds is not None and new_feeds is not None and None not in recorded:
        return
    before = {k for d in olds for k in d.routing_keys or ()}
    after = {k for d in news for k in d.routing_keys or ()}
    if gone := sorted(before - after):
        was = ", ".join(f"`{k}`" for k in gone)
        why = (
            f"the exchange no longer receives messages routed with {was}: the queues bound to "
            "it get nothing from here"
        )
        yield "$.routingKey", "breaking", why
