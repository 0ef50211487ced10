"""The consumer's checks the integration tests rely on: they must catch what they claim to."""

from __future__ import annotations

from tests.support.delivery import analyse
from tests.support.jetstream import Received


def stored(*ids: str) -> list[Received]:
    return [
        Received("s", b"{}", {"Nats-Msg-Id": i, "ce-id": i}, seq) for seq, i in enumerate(ids, 1)
    ]


def test_an_inversion_among_first_deliveries_is_caught() -> None:
    delivery = analyse(stored("book/1@1", "book/1@3", "book/1@2"))
    assert delivery.order_violations == ["book/1@2 after book/1@3"]


def test_a_re_sent_copy_is_a_duplicate_not_an_inversion() -> None:
    delivery = analyse(stored("book/1@1", "book/1@2", "book/1@2", "book/1@1", "book/1@3"))
    assert delivery.order_violations == []
    assert delivery.duplicates == {"book/1@2": 2, "book/1@1": 2}


def test_aggregates_are_judged_apart() -> None:
    assert analyse(stored("book/1@2", "book/2@1", "book/1@3")).order_violations == []
