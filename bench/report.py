"""What relay_bench measured, as data (the result classes) and as the Markdown summary
and JSON it prints; apart from the measuring, so that each stays readable. Also `say`, how
every bench prints a line as it goes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.memory import RSS_PERIOD

PROGRESS = (25, 50, 75, 100)
HEADLINE_GOAL = 0.85  # relay / mean publish_async reference


@dataclass
class Throughput:
    count: int
    seconds: float
    stored: int = -1  # messages in the stream afterwards (it is purged before each phase)
    cpu_seconds: float = 0.0  # this process's CPU (user + system) over the same timed span
    body_bytes: int = 0  # message bodies sent, in all (0: not counted)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_us_per_msg(self) -> float:
        return self.cpu_seconds / self.count * 1e6 if self.count else 0.0

    @property
    def cpu_share(self) -> float:
        """CPU seconds per wall second: near 1.0 means one core was busy all along."""
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RelayRun:
    throughput: Throughput  # its cpu_seconds: the whole drain's, start-up included
    maxrss_before_kib: int
    maxrss_after_kib: int
    vmrss_start_kib: int
    vmrss_at_kib: dict[int, int]  # progress percent -> VmRSS
    vmrss_peak_kib: int  # the peak during the drain: the kernel's VmHWM or the samples' max
    stored: int  # messages in the stream afterwards
    vmrss_samples: int = 0  # how many times the sampler read VmRSS
    vmrss_max_gap_ms: float = 0.0  # the longest time between two of its readings
    vmrss_late: int = 0  # gaps between two readings longer than 50 ms
    vmrss_sampled_peak_kib: int = 0  # the highest VmRSS the sampler (and the poll loop) read
    vmhwm_kib: int = 0  # the kernel's peak (VmHWM), reset at the drain's start (0: not reset)

    @property
    def vmrss_growth_kib(self) -> int:
        """Peak during the drain minus VmRSS at its start: what the relay itself added."""
        return self.vmrss_peak_kib - self.vmrss_start_kib


@dataclass
class Latency:
    mode: str
    rate_target: float
    rate_achieved: float
    sent: int
    measured: int
    missing: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


@dataclass
class Results:
    events: int
    batch: int
    payload_bytes: int = 0  # the `note` in each backlog event's payload (0: none)
    max_bytes: int | None = None  # the relay's batch.max_bytes (None: not set)
    machine: dict[str, str] = field(default_factory=dict)
    insert_seconds: float = 0.0
    ceiling_before: Throughput | None = None
    ceiling_after: Throughput | None = None
    pipelined_before: Throughput | None = None  # reference: publish_async, the relay's path
    pipelined_after: Throughput | None = None
    relay: RelayRun | None = None
    latency: list[Latency] = field(default_factory=list)

    @property
    def ceiling_mean(self) -> float:
        return mean_of([t.rate for t in self.ceilings])

    @property
    def ratio(self) -> float:
        """Relay / mean `js.publish` ceiling: for information (the headline used to be this)."""
        mean = self.ceiling_mean
        return self.relay.throughput.rate / mean if self.relay and mean else 0.0

    @property
    def pipelined_mean(self) -> float:
        return mean_of([t.rate for t in self.references])

    @property
    def pipelined_ratio(self) -> float:
        mean = self.pipelined_mean
        return self.relay.throughput.rate / mean if self.relay and mean else 0.0

    @property
    def headline_ratio(self) -> float:
        """Relay / mean `publish_async` reference: the client sending the way the relay does."""
        return self.pipelined_ratio

    @property
    def ceilings(self) -> list[Throughput]:
        return [t for t in (self.ceiling_before, self.ceiling_after) if t is not None]

    @property
    def references(self) -> list[Throughput]:
        return [t for t in (self.pipelined_before, self.pipelined_after) if t is not None]


def say(text: str) -> None:
    """Print a line now (flushed): a bench's progress shows while it runs, even piped."""
    print(text, flush=True)


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def summary(r: Results) -> str:
    rows: list[tuple[str, str]] = [
        ("events in backlog", f"{r.events:,}"),
        ("batch (relay max_messages / client chunk)", str(r.batch)),
        ("payload note per event (--payload-bytes)", f"{r.payload_bytes:,} bytes"),
        (
            "relay batch.max_bytes (--max-bytes)",
            "not set" if r.max_bytes is None else str(r.max_bytes),
        ),
        ("backlog insert (COPY)", f"{r.insert_seconds:.1f} s"),
    ]
    if r.relay and r.references and r.ceilings:
        rows += throughput_rows(r) + cpu_rows(r) + memory_rows(r.relay)
    for lat in r.latency:
        rows.append(
            (
                f"commit-to-broker latency, {lat.mode}",
                f"p50 {lat.p50_ms:.1f} ms, p99 {lat.p99_ms:.1f} ms, max {lat.max_ms:.1f} ms "
                f"({lat.measured:,} events at {lat.rate_achieved:,.0f}/s, {lat.missing} missing)",
            )
        )
    rows += [(f"machine: {k}", v) for k, v in r.machine.items()]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def throughput_rows(r: Results) -> list[tuple[str, str]]:
    """The headline (relay / publish_async reference) and, for information, the ceiling."""
    assert r.relay is not None
    drain = r.relay.throughput
    met = "met" if r.headline_ratio >= HEADLINE_GOAL else "NOT met"
    body = r.references[0]
    return [
        ("message body, mean", f"{body.body_bytes / body.count:,.0f} bytes" if body.count else "?"),
        *(
            (f"reference {when}, nats-py publish_async pipelined", f"{t.rate:,.0f} msgs/s")
            for when, t in (("before", r.pipelined_before), ("after", r.pipelined_after))
            if t is not None
        ),
        ("reference, mean", f"{r.pipelined_mean:,.0f} msgs/s"),
        ("relay, backlog drain", f"{drain.rate:,.0f} events/s ({drain.seconds:.2f} s)"),
        (
            f"**ratio relay / publish_async reference** (goal >= {HEADLINE_GOAL})",
            f"**{r.headline_ratio:.2f}** ({met})",
        ),
        *(
            (f"ceiling {when}, nats-py js.publish (for information)", f"{t.rate:,.0f} msgs/s")
            for when, t in (("before", r.ceiling_before), ("after", r.ceiling_after))
            if t is not None
        ),
        ("ceiling, mean (for information)", f"{r.ceiling_mean:,.0f} msgs/s"),
        ("ratio relay / js.publish ceiling (for information)", f"{r.ratio:.2f}"),
    ]


def cpu_rows(r: Results) -> list[tuple[str, str]]:
    """CPU per message: the relay's whole drain against the clients' publishing alone."""
    assert r.relay is not None

    def per_msg(runs: list[Throughput]) -> str:
        each = " / ".join(f"{t.cpu_us_per_msg:.1f}" for t in runs)
        mean = mean_of([t.cpu_us_per_msg for t in runs])
        return f"{mean:.1f} µs (runs: {each})"

    drain = r.relay.throughput
    return [
        (
            "relay CPU per event, backlog drain (process user + sys: read, map, publish, "
            "checkpoint)",
            f"{drain.cpu_us_per_msg:.1f} µs ({drain.cpu_share:.0%} of one core)",
        ),
        (
            "client CPU per message, publish_async reference (publishing only)",
            per_msg(r.references),
        ),
        ("client CPU per message, js.publish ceiling (for information)", per_msg(r.ceilings)),
    ]


def memory_rows(run: RelayRun) -> list[tuple[str, str]]:
    """ru_maxrss counts the phases before the drain too; the VmRSS figures are the drain's."""
    return [
        (
            "peak RSS (ru_maxrss) before relay run (earlier phases included)",
            mib(run.maxrss_before_kib),
        ),
        ("peak RSS (ru_maxrss) after relay run", mib(run.maxrss_after_kib)),
        ("VmRSS at start of relay run (after gc and malloc_trim)", mib(run.vmrss_start_kib)),
        *((f"VmRSS at {pct}% of backlog", mib(run.vmrss_at_kib.get(pct, 0))) for pct in PROGRESS),
        ("VmRSS peak during relay run", mib(run.vmrss_peak_kib)),
        (
            "VmRSS peak, kernel's VmHWM (reset at the start of the run)",
            mib(run.vmhwm_kib) if run.vmhwm_kib else "not available",
        ),
        (
            "VmRSS peak, sampled",
            f"{mib(run.vmrss_sampled_peak_kib)} ({run.vmrss_samples:,} samples every "
            f"{RSS_PERIOD * 1000:.0f} ms, longest gap {run.vmrss_max_gap_ms:.0f} ms, "
            f"{run.vmrss_late} over 50 ms)",
        ),
        ("VmRSS growth during relay run (peak - start)", mib(run.vmrss_growth_kib)),
        ("messages stored by relay run", f"{run.stored:,}"),
    ]


def to_json(r: Results) -> dict[str, Any]:
    data = asdict(r)
    data.update(
        ceiling_mean=r.ceiling_mean,
        ratio=r.ratio,  # relay / js.publish ceiling: for information since the headline changed
        ceiling_ratio=r.ratio,
        pipelined_mean=r.pipelined_mean,
        pipelined_ratio=r.pipelined_ratio,
        headline_ratio=r.headline_ratio,
        headline_goal=HEADLINE_GOAL,
        headline_denominator="mean of the two js.publish_async reference runs",
        pipelined_cpu_us_per_msg=mean_of([t.cpu_us_per_msg for t in r.references]),
        ceiling_cpu_us_per_msg=mean_of([t.cpu_us_per_msg for t in r.ceilings]),
    )
    if r.relay:
        data["relay"]["rate"] = r.relay.throughput.rate
        data["relay"]["cpu_us_per_event"] = r.relay.throughput.cpu_us_per_msg
        data["relay"]["cpu_share"] = r.relay.throughput.cpu_share
        data["relay"]["vmrss_growth_kib"] = r.relay.vmrss_growth_kib
        data["relay_cpu_us_per_event"] = r.relay.throughput.cpu_us_per_msg
    for key in ("ceiling_before", "ceiling_after", "pipelined_before", "pipelined_after"):
        value = getattr(r, key)
        if value:
            data[key]["rate"] = value.rate
            data[key]["cpu_us_per_msg"] = value.cpu_us_per_msg
    return data
