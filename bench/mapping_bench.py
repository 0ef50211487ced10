"""Mapping cost per event: one rule, a JSON Schema (fast and full), `when`, two rules.

    .venv/bin/python -m bench.mapping_bench [--events 20000] [--compare ../main]

Maps the relay_bench backlog's BookLent events (decoded, in memory: no database, no broker)
as the outbox loop does (`relay.core.delivery.items_of`: the event's rules, each message
built, its body validated) and prints the best of `--repeat` runs in µs of CPU per event. With
`--compare DIR`, the single-rule case also runs on the relay in DIR (for example the main
branch's worktree), in subprocesses alternated with this tree's, and the ratio is printed:
what an outbox without `when` or a schema pays for the rules, against before them.

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

try:
    from bench.backlog import backlog_rows, schema_for
except ImportError:  # `--compare` with a tree from before relay_bench.py was split
    from bench.relay_bench import backlog_rows, schema_for  # type: ignore[attr-defined,no-redef]
from relay.config import OutboxConfig
from relay.core import delivery

try:
    from relay.mapping import mapper as mapping
except ImportError:  # `--compare` with a tree from before mapping had a package of its own
    from relay.core import mapping  # type: ignore[attr-defined,no-redef]
Mapper = mapping.Mapper

try:
    from relay.core.event import Event
except ImportError:  # `--compare` with a tree from before Event had a module of its own
    Event = mapping.Event  # type: ignore[attr-defined,misc]

PAYLOAD = {
    "bookId": "aggregate_id",
    "loanId": "data.loanId",
    "memberId": "data.memberId",
    "version": "version",
}
RULE: dict[str, Any] = {
    "type": "library.book-lent.v1",
    "destination": "bench.{aggregate_type}",
    "payload": PAYLOAD,
}


CASES: dict[str, dict[str, Any]] = {
    "one rule": {"BookLent": RULE},
    "one rule, schema (draft 7: fastjsonschema)": {
        "BookLent": {**RULE, "schema": schema_for("draft7")}
    },
    "one rule, schema (2020-12: jsonschema)": {
        "BookLent": {**RULE, "schema": schema_for("2020-12")}
    },
    "one rule, when (true)": {"BookLent": {**RULE, "when": "data.memberId != null"}},
    "two rules (v1, v2)": {
        "BookLent": [RULE, {**RULE, "type": "library.book-lent.v2", "destination": "bench.v2"}]
    },
}


def events(count: int) -> list[Any]:
    created = datetime(2026, 11, 30, tzinfo=UTC)
    return [
        Event(i + 1, kind, key, version, type_, json.loads(payload), None, created)
        for i, (kind, key, version, type_, payload) in enumerate(backlog_rows(count))
    ]


def mapper_of(messages: dict[str, Any]) -> Callable[[Any], object]:
    """One event mapped as the outbox loop of the relay imported maps it."""
    mapper = Mapper("bench", OutboxConfig.model_validate({"broker": "nats", "messages": messages}))
    items_of = getattr(mapping, "items_of", None) or getattr(delivery, "items_of", None)
    if items_of is None:  # a relay before rules: OutboxRelay._item
        return lambda event: delivery.Item(event, mapper.map(event), None)

    def skipped(_rule: object) -> None:
        """Not counted here."""

    return lambda event: items_of(mapper, event, skipped)


def per_event(messages: dict[str, Any], sample: list[Any], repeat: int) -> float:
    """Best of `repeat` passes over `sample`, in µs per event."""
    map_one = mapper_of(messages)
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()  # CPU time: other processes on the machine cost nothing
        for event in sample:
            map_one(event)
        best = min(best, time.process_time() - started)
    return best / len(sample) * 1e6


def one_rule(count: int, repeat: int) -> float:
    """The single-rule case over `count` events: what `--compare` measures in each tree."""
    return per_event(CASES["one rule"], events(count), repeat)


def compare(tree: Path, count: int, repeat: int, rounds: int) -> tuple[float, float]:
    """The single-rule case on `tree` and on this tree, alternated; the best of each."""
    here = Path(__file__).resolve().parents[1]

    from bench.trees import call_in  # noqa: PLC0415 - the parent's only: a tree may lack it

    def run(root: Path) -> float:
        # `relay` (and bench.backlog) from `root`, this file's code from here.
        return float(call_in(root, __file__, "one_rule", count, repeat))

    theirs, ours = [], []
    for _ in range(rounds):
        theirs.append(run(tree))
        ours.append(run(here))
    return min(theirs), min(ours)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7, help="passes; the best is kept")
    parser.add_argument("--compare", type=Path, help="a relay tree to compare one rule with")
    parser.add_argument("--rounds", type=int, default=3, help="alternated runs with --compare")
    args = parser.parse_args(argv)
    sample = events(args.events)
    print(f"| case ({args.events} events, best of {args.repeat}) | µs/event |")
    print("|---|---|")
    for name, messages in CASES.items():
        print(f"| {name} | {per_event(messages, sample, args.repeat):.2f} |")
    if args.compare:
        theirs, ours = compare(args.compare, args.events, args.repeat, args.rounds)
        print(
            f"\none rule: {args.compare} {theirs:.2f} µs/event, this tree {ours:.2f} µs/event,"
            f" ratio {ours / theirs:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
