"""The filter that thins out client libraries' repeated log lines (relay/runtime/log_noise.py)."""

from __future__ import annotations

import logging

from relay.runtime.log_noise import RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(name: str, msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_one_line_per_kind_per_window_then_the_count_of_those_held_back() -> None:
    clock = Clock()
    noise = RepeatFilter(["aiokafka"], window=60, clock=clock)
    template = "Unable connect to node with id %s: %s"
    passed = []
    for second in range(120):
        clock.now = float(second)
        for node in (1, 2):
            r = record("aiokafka", template, node, "refused")
            if noise.filter(r):
                passed.append((second, r.getMessage()))
    assert passed == [
        (0, "Unable connect to node with id 1: refused"),
        (
            60,
            "Unable connect to node with id 1: refused (119 more like this in the last 60s"
            " were not logged)",
        ),
    ]


def test_kinds_are_told_apart_by_logger_level_and_template() -> None:
    noise = RepeatFilter(["aiokafka"], clock=Clock())
    records = [
        record("aiokafka", "Unable connect to node with id %s: %s", 1, "x"),
        record("aiokafka.producer.sender", "Unable connect to node with id %s: %s", 1, "x"),
        record("aiokafka", "Unable connect to node with id %s: %s", 1, "x", level=logging.WARNING),
        record("aiokafka", "Got error produce response: %s", "NodeNotReadyError"),
    ]
    assert [noise.filter(r) for r in records] == [True] * 4
    assert [noise.filter(r) for r in records] == [False] * 4


def test_other_loggers_pass_untouched() -> None:
    noise = RepeatFilter(["aiokafka"], clock=Clock())
    for name in ("relay.outbox", "aiokafkaesque", "asyncio"):
        assert all(noise.filter(record(name, "same text")) for _ in range(5))
