"""The long soak: `python -m tests.soak --minutes 10 --broker nats [--seed S] [--lanes K]
[--failover] [--dead-paths] [--max-per-replica N] [--audit report|repair]`.

Prints the verdict and the faults in order; exits 1 when anything was lost, phantom,
inverted or regressed, or the outbox did not drain. The same seed replays the same choices.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
from pathlib import Path

from tests.soak.run import Settings, soak


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--broker",
        default="nats",
        choices=["nats", "kafka", "rabbitmq", "pubsub", "redis", "http"],
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--writers", type=int, default=6)
    parser.add_argument("--partitioned", action="store_true", help="a partitioned event table")
    parser.add_argument("--lanes", type=int, default=1, help="the outbox's `partitions`")
    parser.add_argument(
        "--failover", action="store_true", help="a standby, and Postgres failovers among the faults"
    )
    parser.add_argument(
        "--dead-paths",
        action="store_true",
        help="one connection's network path dies now and then, in the kernel (needs root)",
    )
    parser.add_argument(
        "--max-per-replica",
        type=int,
        default=None,
        help="`lease.max_per_replica`: with 3 replicas, 3 leaves the fleet just enough room"
        " for 5 lanes while one replica is down",
    )
    parser.add_argument(
        "--audit",
        choices=["report", "repair"],
        default=None,
        help="the continuous audit in every replica, and the broker losing messages among the"
        " faults: `report` must find each one, `repair` must also put it back",
    )
    parser.add_argument("--keep", type=Path, help="keep logs and data in this directory")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    settings = Settings(
        seed=seed,
        seconds=args.minutes * 60,
        broker=args.broker,
        replicas=args.replicas,
        writers=args.writers,
        partitioned=args.partitioned,
        lanes=args.lanes,
        failover=args.failover,
        dead_paths=args.dead_paths,
        max_per_replica=args.max_per_replica,
        audit=args.audit,
        keep=args.keep,
    )
    # SIGTERM (timeout, kill) stops it like Ctrl-C: every private server is stopped on the way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(
        f"soak: seed {seed}, {args.minutes:g} min, broker {args.broker}, lanes {args.lanes}"
        + (", failovers" if args.failover else "")
        + (", dead paths" if args.dead_paths else "")
        + (f", max {args.max_per_replica} lanes a replica" if args.max_per_replica else "")
        + (f", audit ({args.audit})" if args.audit else ""),
        flush=True,
    )
    verdict, origin = asyncio.run(soak(settings))
    print(verdict.report(origin))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
