"""Decoding cost per row: `decode_json`, the hot path's first step, on the texts rows hold.

    .venv/bin/python -m bench.decode_bench [--rows 5000] [--compare ../main]

Decodes payload texts as `EventSource.read` does for each row (no database) and prints the
best of `--repeat` passes in µs of CPU per row: the relay_bench backlog's payloads, the same
with a 64 KiB note, and two nested shapes, without a float (the float check walks all of it)
and with floats (the check stops at the first). With `--compare DIR`, each case also runs on
the relay in DIR, in subprocesses alternated with this tree's, and the ratios are printed.

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

try:
    from bench.backlog import backlog_rows
except ImportError:  # `--compare` with a tree from before relay_bench.py was split
    from bench.relay_bench import backlog_rows  # type: ignore[attr-defined,no-redef]

CASES = ["backlog", "backlog, 64 KiB note", "nested, no float", "nested, floats"]


def texts(case: int, count: int) -> list[str]:
    """The payload texts of one case, as the read query returns them."""
    name, rng = CASES[case], random.Random(7)
    if name == "backlog":
        return [row[4] for row in backlog_rows(count)]
    if name == "backlog, 64 KiB note":
        return [row[4] for row in backlog_rows(max(count // 25, 1), payload_bytes=65536)]
    items = [
        {"sku": f"s{j}", "qty": j, **({"price": rng.random()} if "floats" in name else {})}
        for j in range(5)
    ]
    member = {"id": "m", "tags": ["a", "b"], "address": {"city": "c", "zip": "z"}}
    return [json.dumps({"loanId": f"L{i}", "member": member, "items": items}) for i in range(count)]


def per_row(case: int, count: int, repeat: int) -> float:
    """Best of `repeat` passes over one case, in µs per row, with this process's relay."""
    from relay.postgres.source import decode_json  # noqa: PLC0415 - the tree under test's

    sample = texts(case, count)
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        for text in sample:
            decode_json(text)
        best = min(best, time.process_time() - started)
    return best / len(sample) * 1e6


def compare(tree: Path, case: int, count: int, repeat: int, rounds: int) -> tuple[float, float]:
    """One case on `tree` and on this tree, alternated; the best of each."""
    from bench.trees import call_in  # noqa: PLC0415 - the parent's only: a tree may lack it

    here = Path(__file__).resolve().parents[1]
    theirs, ours = [], []
    for _ in range(rounds):
        theirs.append(float(call_in(tree, __file__, "per_row", case, count, repeat)))
        ours.append(float(call_in(here, __file__, "per_row", case, count, repeat)))
    return min(theirs), min(ours)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=7, help="passes; the best is kept")
    parser.add_argument("--compare", type=Path, help="a relay tree to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="alternated runs with --compare")
    args = parser.parse_args(argv)
    if args.compare:
        print(f"| case ({args.rows} rows) | {args.compare} µs/row | this tree µs/row | ratio |")
        print("|---|---|---|---|")
    else:
        print(f"| case ({args.rows} rows, best of {args.repeat}) | µs/row |")
        print("|---|---|")
    for case, name in enumerate(CASES):
        if not args.compare:
            print(f"| {name} | {per_row(case, args.rows, args.repeat):.3f} |")
            continue
        theirs, ours = compare(args.compare, case, args.rows, args.repeat, args.rounds)
        print(f"| {name} | {theirs:.3f} | {ours:.3f} | {ours / theirs:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
