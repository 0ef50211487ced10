"""A checkpoint's skip as this release writes it, and one of a newer release's shape
(postgres/skipping.py): read as none, never misread."""

from __future__ import annotations

import pytest

from relay.postgres.skipping import Layer, Skip, skip_of


def test_the_skip_this_release_writes_is_read_back() -> None:
    skip = Skip((Layer(2, (5, 7)), Layer(3, (1, 2, 3))))
    assert skip_of(skip.as_json()) == (skip, False)
    assert skip_of(None) == (None, False)


@pytest.mark.parametrize(
    "text",
    [
        '{"layers": [{"partitions": 2, "positions": [5, 7]}]}',  # objects, not pairs
        '[[2, [5, 7], "hash"]]',  # a third member
        '[["2", [5, 7]]]',  # a count as text
        "[[2, [5.5, 7]]]",  # a position that is not a whole number
        "[[2, [5, 7, 9]]]",  # positions of another count
        "[[true, [5]]]",
        '"all"',
    ],
)
def test_a_skip_of_another_shape_is_read_as_none_and_said(text: str) -> None:
    """Read as none, what it covers is sent again (a duplicate), never left out by a guess."""
    assert skip_of(text) == (None, True)
