"""The audit's matching (relay/core/audit.py): expected messages against what a destination
holds, with no database and no broker."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from relay.core.audit import STRANGERS_KEPT, Chunk, Expected
from relay.core.readback import Horizon, Stored

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)


def expected(
    position: int, key: str = "b1", destination: str = "loans", **changes: object
) -> Expected:
    fields: dict[str, object] = {
        "id": f"book/{key}@{position}",
        "position": position,
        "destination": destination,
        "key": key,
        "lane": "loans",
        "rule": "",
        "event": f"book/{key}@{position}",
        "time": T0 + timedelta(seconds=position),
    }
    fields.update(changes)
    return Expected(**fields)  # type: ignore[arg-type]


def stored(message: Expected, seconds: float = 1.0, destination: str | None = None) -> Stored:
    assert message.time is not None
    return Stored(
        message.id,
        destination or message.destination,
        message.time + timedelta(seconds=seconds),
        "seq ?",
    )


def held(first: Expected | None = None, **changes: object) -> dict[str, Horizon]:
    horizon = Horizon(T0, None if first is None else first.id, **changes)  # type: ignore[arg-type]
    return {"loans": horizon}


def test_every_message_found_once_is_a_pass() -> None:
    messages = [expected(p, key=f"b{p % 3}") for p in range(1, 11)]
    chunk = Chunk(messages, skew=60)
    for m in messages:
        chunk.see(stored(m))
    tally = chunk.settle(held(messages[0]), NOW, listed=10)
    assert tally.total.expected == tally.total.found == 10
    assert tally.total.missing == tally.total.duplicates == tally.total.order_breaks == 0
    assert tally.missing == []


def test_a_message_not_held_is_missing_with_its_position_and_id() -> None:
    messages = [expected(p) for p in range(1, 6)]
    chunk = Chunk(messages, skew=60)
    for m in messages[:2] + messages[3:]:
        chunk.see(stored(m))
    tally = chunk.settle(held(messages[0]), NOW, listed=10)
    assert [(f.position, f.id, f.destination) for f in tally.missing] == [(3, "book/b1@3", "loans")]
    assert tally.missing[0].reason == "not found"
    assert tally.total.missing == 1 and tally.total.found == 4


def test_copies_beyond_the_first_are_duplicates_not_order_breaks() -> None:
    messages = [expected(p) for p in range(1, 4)]
    chunk = Chunk(messages, skew=60)
    for m in [*messages, *messages]:  # a replay sent all three again, after them
        chunk.see(stored(m))
    tally = chunk.settle(held(messages[0]), NOW, listed=10)
    assert tally.total.duplicates == 3 and tally.total.order_breaks == 0


def test_a_first_copy_stored_after_a_later_version_of_its_key_is_an_order_break() -> None:
    a1, a2, b1 = expected(1, "a"), expected(2, "a"), expected(3, "b")
    chunk = Chunk([a1, a2, b1], skew=60)
    for m in (a2, b1, a1):
        chunk.see(stored(m))
    tally = chunk.settle(held(a1), NOW, listed=10)
    assert tally.total.order_breaks == 1 and tally.total.missing == 0


def test_order_is_judged_per_destination_and_key() -> None:
    one, two = expected(1, "a", "x"), expected(2, "a", "y")
    chunk = Chunk([one, two], skew=60)
    chunk.see(stored(two))
    chunk.see(stored(one))
    assert chunk.settle({}, NOW, listed=10).total.order_breaks == 0


def test_a_message_held_on_another_destination_is_missing_where_it_belongs() -> None:
    message = expected(1)
    chunk = Chunk([message], skew=60)
    chunk.see(stored(message, destination="elsewhere"))
    tally = chunk.settle(held(), NOW, listed=10)
    assert tally.total.missing == 1
    assert tally.missing[0].reason == "stored on 'elsewhere', not on 'loans'"


def test_unexplained_messages_in_the_range_time_are_counted_unless_a_neighbour_explains() -> None:
    mine, neighbours = expected(5), expected(6)
    stranger = Stored("someone-else/1", "loans", T0 + timedelta(seconds=5), "seq 9")
    chunk = Chunk([mine], skew=60)
    chunk.see(stored(mine))
    chunk.see(stored(neighbours))  # the next chunk's event, published within this one's time
    chunk.see(stranger)
    chunk.see(Stored("far/1", "loans", T0 + timedelta(hours=5), "seq 99"))  # outside the span
    chunk.explain([neighbours.id])
    tally = chunk.settle(held(mine), NOW, listed=10)
    assert tally.total.unexplained == 1 and tally.total.missing == 0


def test_strangers_beyond_the_kept_ones_are_still_counted() -> None:
    chunk = Chunk([expected(1)], skew=60)
    for i in range(STRANGERS_KEPT + 5):
        chunk.see(Stored(f"x/{i}", "loans", T0, f"seq {i}"))
    assert chunk.settle(held(), NOW, listed=1).total.unexplained == STRANGERS_KEPT + 5


def test_ids_shared_by_two_events_are_counted_and_one_copy_serves_both() -> None:
    first, second = expected(1, id="same"), expected(2, id="same")
    chunk = Chunk([first, second], skew=60)
    chunk.see(Stored("same", "loans", T0, "seq 1"))
    tally = chunk.settle(held(first), NOW, listed=10)
    assert tally.shared_ids == 2 and tally.total.found == 2 and tally.total.missing == 0


def test_a_message_before_an_oldest_held_at_the_age_limit_is_expired() -> None:
    week = 7 * 86_400.0
    old = expected(1, time=NOW - timedelta(days=9))
    kept = expected(2, time=NOW - timedelta(days=8))  # published late: stored 6.99 days ago
    chunk = Chunk([old, kept], skew=60)
    chunk.see(Stored(kept.id, "loans", NOW - timedelta(days=6.99), "seq 40"))
    horizon = Horizon(NOW - timedelta(days=6.99), kept.id, max_age=week, where="stream L seq 40")
    tally = chunk.settle({"loans": horizon}, NOW, listed=10)
    assert tally.total.expired == 1 and tally.total.missing == 0
    assert tally.expired[0].reason.startswith("expired: older than the destination's max age")


def test_an_old_event_is_not_expired_while_the_oldest_held_is_young() -> None:
    """Expiry is told by the destination, not by the event's time: an event written long
    ago and published recently (a backlog, a backdated created_at) is missing when gone."""
    lost, kept = expected(1, time=NOW - timedelta(days=30)), expected(2)
    chunk = Chunk([lost, kept], skew=60)
    chunk.see(stored(kept))
    tally = chunk.settle(held(kept, max_age=7 * 86_400.0), NOW, listed=10)
    assert tally.total.expired == 0 and tally.total.missing == 1
    assert tally.missing[0].reason.startswith("not found: before the oldest message held")


def test_an_empty_destination_is_expired_only_if_its_newest_aged_out() -> None:
    gone = expected(1, time=NOW - timedelta(days=30))
    purged = {"loans": Horizon(None, max_age=86_400.0, last=NOW - timedelta(minutes=5))}
    aged = {"loans": Horizon(None, max_age=86_400.0, last=NOW - timedelta(days=2))}
    assert Chunk([gone], skew=60).settle(purged, NOW, listed=1).total.missing == 1
    assert Chunk([gone], skew=60).settle(aged, NOW, listed=1).total.expired == 1


def test_events_written_in_the_future_read_the_destination_from_its_oldest() -> None:
    ahead = expected(1, time=datetime.now(UTC) + timedelta(hours=9))
    chunk = Chunk([ahead], skew=60)
    assert chunk.since is None
    chunk.see(Stored(ahead.id, "loans", datetime.now(UTC), "seq 1"))
    assert chunk.settle(held(), NOW, listed=1).total.found == 1


def test_times_at_the_ends_of_a_datetimes_range_do_not_break_the_audit() -> None:
    first = expected(1, time=datetime.min.replace(tzinfo=UTC))
    last = expected(2, time=datetime.max.replace(tzinfo=UTC))
    chunk = Chunk([first, last], skew=60)
    assert chunk.since is None  # no read from a time that cannot be written
    tally = chunk.settle(held(max_age=60.0), NOW, listed=5)
    assert tally.total.expected == 2 and tally.total.missing + tally.total.expired == 2


def test_a_count_limit_that_discarded_is_named_and_stays_missing() -> None:
    messages = [expected(p) for p in range(1, 6)]
    chunk = Chunk(messages, skew=60)
    for m in messages[2:]:
        chunk.see(stored(m))
    tally = chunk.settle(held(messages[2], limits="max_msgs 3", where="seq 3"), NOW, listed=10)
    assert tally.total.missing == 2 and tally.total.expired == 0
    assert all("by max_msgs 3" in f.reason for f in tally.missing)


def test_a_missing_message_after_the_oldest_held_is_not_blamed_on_retention() -> None:
    messages = [expected(p) for p in range(1, 4)]
    chunk = Chunk(messages, skew=60)
    chunk.see(stored(messages[0]))
    chunk.see(stored(messages[2]))
    tally = chunk.settle(held(messages[0], limits="max_msgs 3", max_age=1.0), NOW, listed=10)
    assert [f.reason for f in tally.missing] == ["not found"]


def test_findings_are_listed_up_to_the_limit_and_all_counted() -> None:
    messages = [expected(p) for p in range(1, 8)]
    tally = Chunk(messages, skew=60).settle(held(), NOW, listed=3)
    assert tally.total.missing == 7 and len(tally.missing) == 3


def test_without_created_at_the_read_starts_at_the_oldest_held() -> None:
    chunk = Chunk([expected(1, time=None), expected(2)], skew=60)
    assert chunk.since is None


def test_the_read_starts_a_skew_before_the_first_event() -> None:
    chunk = Chunk([expected(3), expected(1), expected(2)], skew=60)
    assert chunk.since == T0 + timedelta(seconds=1) - timedelta(seconds=60)
