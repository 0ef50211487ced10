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


def settle(lanes: int, replicas: list[str], holding: dict[str, int]) -> dict[str, int]:
    """Run passes (give, then take free lanes) until nothing changes; the final split."""
    holding = {who: holding.get(who, 0) for who in replicas}
    for _ in range(50):
        before = dict(holding)
        for me in replicas:
            plan = balance(lanes=lanes, live=len(replicas), me=me, holding=holding, patient=True)
            holding[me] -= plan.give
            free = lanes - sum(holding.values())
            holding[me] += min(plan.take, free)
        if holding == before:
            return holding
    raise AssertionError(f"no stable split: {holding}")


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
    plans = {me: balance(lanes=4, live=3, me=me, holding=holding, patient=True) for me in "abc"}
    assert plans == {"a": Balance(0, 0), "b": Balance(1, 0), "c": Balance(0, 2)}


def test_an_impatient_replica_takes_a_lane_nobody_else_took() -> None:
    holding = {"a": 1, "b": 1, "c": 0}  # c is alive but takes nothing (its budget is spent)
    assert balance(lanes=3, live=3, me="a", holding=holding, patient=True) == Balance(0, 0)
    assert balance(lanes=3, live=3, me="a", holding=holding, patient=False) == Balance(0, 0)
    holding = {"a": 1, "b": 1, "c": 0}
    assert balance(lanes=4, live=3, me="a", holding=holding, patient=False) == Balance(0, 1)
