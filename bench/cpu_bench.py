"""The relay's CPU per event in a backlog drain, alone, against another tree, taking turns.

    .venv/bin/python -m bench.cpu_bench --compare ../before --rounds 6 [--events 100000]

Each drain is a fresh process: a database and a JetStream stream of their own, a backlog of
`--events` BookLent events (relay_bench's set-up: bench/backlog.py), then the real relay
draining it (relay_bench's relay phase alone, bench/measure.py: no reference, no latency),
and everything removed. The figure is that process's CPU (user + system) over the drain,
start-up included, per event: Postgres and nats-server are other processes. With `--compare
DIR`, the drains alternate between DIR's relay and this tree's (DIR first in odd rounds, this
tree first in even ones), so that drift on the machine falls on both, and the ratio of the
means is printed; this file's code runs in both (as `mapping_bench --compare` does), with the
bench library of the tree under test. Importing it has no side effects.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from statistics import mean

HERE = Path(__file__).resolve().parents[1]


async def drain(events: int) -> dict[str, float]:
    """One drain by the relay importable here; its CPU per event and rate."""
    from bench.report import Results  # noqa: PLC0415 - the bench of the tree on the path

    try:
        from bench import backlog, measure  # noqa: PLC0415
    except ImportError:  # a tree from before relay_bench.py was split: it held both
        from bench import relay_bench as backlog  # type: ignore[no-redef]  # noqa: PLC0415
        from bench import relay_bench as measure  # type: ignore[no-redef]  # noqa: PLC0415

        # Its set-up took its command line's options.
        options = backlog.parse_args(["--events", str(events)])  # type: ignore[attr-defined]
    else:
        options = backlog.RunOptions(events=events)

    try:
        from relay.runtime.logs import configure  # noqa: PLC0415
    except ImportError:  # a tree from before relay/ops/ was split
        from relay.ops.logs import configure  # type: ignore[import-not-found,no-redef]  # noqa: PLC0415

    configure("warning", "json")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = backlog.with_database(options.pg, name)
    results = Results(events=events, batch=options.batch)
    try:
        last = await backlog.set_up(options, dsn, name, results)
        config = backlog.bench_config(options, dsn, name)
        run = await measure.relay_backlog(
            config, last, None, lambda: backlog.stored_messages(options.nats, name)
        )
    finally:
        await backlog.cleanup(options, name)
    t = run.throughput
    if t.stored != events:
        raise SystemExit(f"cpu_bench: the stream holds {t.stored} messages, not {events}")
    return {"cpu_us": t.cpu_us_per_msg, "rate": t.rate}


def drain_now(events: int) -> dict[str, float]:
    """One drain, in this process (the child of `call_in`)."""
    return asyncio.run(drain(events))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3, help="drains of each tree")
    parser.add_argument("--compare", type=Path, help="another relay tree, e.g. a worktree")
    args = parser.parse_args(argv)
    from bench.trees import call_in  # noqa: PLC0415 - the parent's only: a tree may lack it

    trees = [("this tree", HERE)]
    if args.compare:
        trees.insert(0, (str(args.compare), args.compare.resolve()))
    cpu: dict[str, list[float]] = {label: [] for label, _ in trees}
    print("| round | tree | CPU µs per event | events/s |\n|---|---|---|---|")
    for n in range(1, args.rounds + 1):
        for label, tree in trees if n % 2 else trees[::-1]:
            result = call_in(tree, __file__, "drain_now", args.events)
            cpu[label].append(result["cpu_us"])
            print(f"| {n} | {label} | {result['cpu_us']:.1f} | {result['rate']:,.0f} |", flush=True)
    for label, values in cpu.items():
        print(f"\n{label}: mean {mean(values):.1f} µs per event ({len(values)} drains)", end="")
    if args.compare:
        theirs, ours = (mean(cpu[label]) for label, _ in trees)
        print(f"\n\nthis tree / {args.compare}: {ours / theirs:.3f}")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
