"""When the fleet changes a split outbox's count over by itself: the one rule that the
replicas act on and the CLI waits for (postgres/membership.py)."""

from __future__ import annotations

from relay.postgres.membership import Member, change_coming, outboxes_of


def member(name: str, **outboxes: int) -> Member:
    return Member(name, outboxes, None)


def test_every_live_replica_saying_one_other_count_changes_it_over() -> None:
    fleet = [member("a", loans=3), member("b", loans=3, orders=1)]
    assert change_coming("loans", 2, False, fleet) == 3


def test_one_replica_of_the_recorded_count_holds_the_change_back() -> None:
    fleet = [member("a", loans=3), member("b", loans=2)]
    assert change_coming("loans", 2, False, fleet) is None


def test_an_operators_pin_holds_every_change_back() -> None:
    assert change_coming("loans", 2, True, [member("a", loans=3)]) is None


def test_replicas_that_do_not_run_the_outbox_have_no_say() -> None:
    fleet = [member("a", loans=3), member("b", orders=2)]
    assert change_coming("loans", 2, False, fleet) == 3
    assert change_coming("loans", 2, False, [member("b", orders=2)]) is None


def test_a_disconnected_replica_still_speaks_for_its_count() -> None:
    """Its row is fresh: it is reconnecting, not gone."""
    away = Member("b", {"loans": 2}, None, connected=False)
    assert change_coming("loans", 2, False, [member("a", loans=3), away]) is None


def test_replicas_agreeing_on_the_recorded_count_change_nothing() -> None:
    assert change_coming("loans", 2, False, [member("a", loans=2)]) is None


def test_a_replica_whose_heartbeat_this_release_cannot_read_holds_every_change_back() -> None:
    """A newer release's shape of `outboxes` may say another count: nothing is changed over
    it, whichever shape, while the counts it can read still count."""
    for text in ['{"loans": {"partitions": 3}}', '["loans"]', '"loans"', '{"loans": 2.0}']:
        counts, unreadable = outboxes_of(text)
        newer = Member("n", counts, None, unreadable=unreadable)
        assert newer.speaks_for("loans"), text
        assert change_coming("loans", 2, False, [member("a", loans=3), newer]) is None, text
    counts, unreadable = outboxes_of('{"loans": 3, "orders": {"partitions": 2}, "fines": true}')
    assert (counts, unreadable) == ({"loans": 3}, frozenset({"orders", "fines"}))
    newer = Member("n", counts, None, unreadable=unreadable)
    assert change_coming("loans", 2, False, [member("a", loans=3), newer]) == 3


def test_a_recorded_count_this_release_cannot_run_is_never_changed_over() -> None:
    assert change_coming("loans", 0, False, [member("a", loans=3)]) is None
