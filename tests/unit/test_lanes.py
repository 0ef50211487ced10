"""How lanes are spread over replicas: pure arithmetic, checked on the cases that matter."""

from __future__ import annotations

import pytest

from relay.core.lanes import Balance, Lane, balance, fair_share, lanes_of


def test_lane_names_keep_a_single_lane_named_after_its_outbox() -> None:
    assert [lane.name for lane in lanes_of("loans", 1)] == ["loans"]
    assert [lane.name for lane in lanes_of("loans", 3)] == ["loans/0", "loans/1", "loans/2"]
    assert not Lane("loans", 0, 1).split and Lane("loans", 0, 2).split


def test_fair_share_is_the_ceiling() -> None:
    assert [fair_share(4, r) for r in (0, 1, 2, 3, 4, 5)] == [4, 4, 2, 2, 1, 1]


def settle(
    lanes: int,
    replicas: list[str],
    holding: dict[str, int],
    caps: dict[str, int] | None = None,
    *,
    patient: bool = True,
) -> dict[str, int]:
    """Run passes (give, then take free lanes) until nothing changes; the final split.

    `caps`: a replica's `lease.max_per_replica` (no cap otherwise)."""
    caps = caps or {}
    holding = {who: holding.get(who, 0) for who in replicas}
    for _ in range(50):
        before = dict(holding)
        for me in replicas:
            members = {w: (caps[w] - holding[w]) if w in caps else None for w in replicas}
            plan = balance(lanes=lanes, members=members, me=me, holding=holding, patient=patient)
            holding[me] -= plan.give
            free = lanes - sum(holding.values())
            room = caps.get(me, lanes) - holding[me]
            holding[me] += min(plan.take, free, room)
        if holding == before:
            return holding
    raise AssertionError(f"no stable split: {holding}")


def everyone(*names: str) -> dict[str, int | None]:
    """Members without a cap."""
    return dict.fromkeys(names)


@pytest.mark.parametrize(
    ("lanes", "replicas", "start", "split"),
    [
        (4, ["a", "b", "c"], {"b": 4}, [2, 1, 1]),  # two join a replica holding all
        (4, ["a", "b", "c"], {"a": 2, "b": 2}, [2, 1, 1]),  # a newcomer gets one
        (4, ["a", "b"], {"a": 1}, [2, 2]),  # a replica died: the survivors take its lanes
        (16, ["a", "b", "c", "d"], {"a": 16}, [4, 4, 4, 4]),
        (1, ["a", "b", "c"], {"c": 1}, [1, 0, 0]),  # one lane: nothing moves
        (3, ["a", "b", "c", "d"], {}, [1, 1, 1, 0]),
    ],
)
def test_lanes_settle_into_floor_and_ceiling_shares(
    lanes: int, replicas: list[str], start: dict[str, int], split: list[int]
) -> None:
    final = settle(lanes, replicas, start)
    assert sorted(final.values(), reverse=True) == split
    assert sum(final.values()) == lanes  # every lane held


def test_only_one_replica_at_the_ceiling_gives_a_lane_to_a_newcomer() -> None:
    holding = {"a": 2, "b": 2, "c": 0}
    members = everyone("a", "b", "c")
    plans = {
        me: balance(lanes=4, members=members, me=me, holding=holding, patient=True) for me in "abc"
    }
    assert plans == {"a": Balance(0, 0), "b": Balance(1, 0), "c": Balance(0, 2)}


def test_an_impatient_replica_takes_a_lane_nobody_else_can_take() -> None:
    holding = {"a": 1, "b": 1, "c": 0}
    spent = {"a": None, "b": None, "c": 0}  # c is alive but takes nothing: its cap is reached
    assert balance(lanes=3, members=spent, me="a", holding=holding, patient=True) == Balance(0, 0)
    assert balance(lanes=3, members=spent, me="a", holding=holding, patient=False) == Balance(0, 1)
    roomy = everyone("a", "b", "c")  # c can take it: a leaves it to c
    assert balance(lanes=3, members=roomy, me="a", holding=holding, patient=False) == Balance(0, 0)


def test_a_replica_that_runs_other_outboxes_only_gets_no_share() -> None:
    """b runs other outboxes only, so it is no member: a keeps all four lanes."""
    plan = balance(lanes=4, members=everyone("a"), me="a", holding={"a": 4}, patient=True)
    assert plan == Balance(0, 0)


@pytest.mark.parametrize(
    ("lanes", "caps", "start", "split"),
    [
        (4, {"a": 1}, {"a": 1}, [3, 1]),  # b takes more than its share: a is at its cap
        (4, {"a": 1, "b": 2}, {}, [2, 1]),  # every replica at its cap: one lane stays unheld
        (6, {"a": 1}, {"b": 6}, [3, 2, 1]),  # b gives back only what the others can take
    ],
)
def test_no_lane_stays_unheld_while_a_replica_that_runs_it_has_room(
    lanes: int, caps: dict[str, int], start: dict[str, int], split: list[int]
) -> None:
    replicas = ["a", "b", "c"][: len(split)]
    final = settle(lanes, replicas, start, caps, patient=False)
    assert sorted(final.values(), reverse=True) == split
    room = sum(caps.get(w, lanes) - final[w] for w in replicas)
    assert sum(final.values()) == lanes or room == 0, "a lane unheld while someone has room"


def test_a_replica_over_its_share_keeps_lanes_that_nobody_else_could_take() -> None:
    """a holds three of four because b is capped at one: it gives none back."""
    members = {"a": None, "b": 0}
    plan = balance(lanes=4, members=members, me="a", holding={"a": 3, "b": 1}, patient=False)
    assert plan == Balance(0, 0)
