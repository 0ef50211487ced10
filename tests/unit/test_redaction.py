"""`redact` in time linear in its text, hiding what the plain regex of its rule would hide;
and the driver's words as errors quote them.

The rule reads best as a regex, `scheme://` then everything to the last `@` before
whitespace, but that regex backtracks over every letter of a long word: a 70 KB aggregate
id in a log line took 19 s. The linear version is held to the regex on short texts.
"""

from __future__ import annotations

import random
import re

import asyncpg
import pytest

from relay.postgres.database import driver_text
from relay.redaction import redact

_RULE = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)\S*@", re.I)
_KV = re.compile(r"(?P<key>password|passwd|pwd|token|secret)\s*=\s*(?P<val>[^\s&;]+)", re.I)
PIECES = [*"ab1+.-:/@ \t#?xZ", "://", "postgresql://", "nats://u:p@", "password=", "é", "\n"]


def by_the_rule(text: str) -> str:
    return _KV.sub(r"\g<key>=***", _RULE.sub(r"\g<scheme>***@", text))


@pytest.mark.parametrize("seed", range(4))
def test_redact_hides_exactly_what_the_rule_hides(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(5_000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        assert redact(text) == by_the_rule(text), repr(text)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a://b://c@d", "a://***@d"),
        ("x postgresql://u:p/w@h:5432/db y", "x postgresql://***@h:5432/db y"),
        ("nats://h:4222 and amqp://u:p@mq", "nats://h:4222 and amqp://***@mq"),
        ("1://u:p@h", "1://u:p@h"),  # a scheme starts with a letter
        ("9a.b+c-d://u:p@h", "9a.b+c-d://***@h"),
    ],
)
def test_redact_cases(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_a_huge_word_is_redacted_like_a_short_one() -> None:
    word = "book/" + "i" * 70_000 + "@1"
    assert redact(word) == word
    assert redact(f"{word} postgresql://relay:pw@db/app") == f"{word} postgresql://***@db/app"


def test_the_drivers_own_internals_are_said_in_plain_words() -> None:
    """A lease was lost "because" `cannot switch to state 12`: asyncpg's words for a
    statement sent while it still reads the server's last messages, most often those of a
    session the server has just ended (a black-box attack found the words said it had
    been cancelled, which it had not)."""
    said = driver_text(
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        )
    )
    assert "state 12" not in said
    assert "the server had just ended the session" in said
