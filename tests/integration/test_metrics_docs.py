"""The metrics the docs and the chart name are the metrics a running relay serves.

One real `relay run` with enough going on that every family exists: a split outbox that
retries for ever (its subject has no stream), and an outbox that publishes and parks. Its
/metrics is then held against docs/ (every `relay_...` name), docs/metrics.md's table (every
served `relay_` family, with its type and labels) and the chart (rules, dashboard, rule
tests). The same run checks what the docs say about the gauges: they keep moving while a
batch is retried or the barrier waits, and `relay parked drop` lowers the parked gauge with
no change of lease.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.db import append, append_many, connect
from tests.support.http import get, http_port
from tests.support.jetstream import create_stream, delete_stream, unique_name
from tests.support.relay_process import run_cli
from tests.support.scenario import (
    LIBRARY_MESSAGES,
    OVERSIZED_LOAN,
    config_dict,
    eventually,
    loans,
    save,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CHART = ROOT / "helm" / "outbox-relay"

# `relay_...` words in docs/ that are not metrics: NOTIFY channels, the benchmark script.
NOT_METRICS = {"relay_events", "relay_lease", "relay_commands", "relay_bench"}
NAME = re.compile(r"\b(?:relay|process|python|kube)_[a-z0-9_]*[a-z0-9]\b")
# Sample name suffixes of a family, by type.
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


class Scrape:
    """One /metrics text, parsed: families by name, and every sample."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels: str) -> float | None:
        for sample in self.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
        return None

    def values(self, name: str, **labels: str) -> list[float]:
        """Every sample of `name` whose labels include `labels` (any partition)."""
        return [
            float(s.value)
            for s in self.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]

    def is_created(self, name: str) -> bool:
        """A `<counter or histogram>_created` family, which the text format carries apart."""
        base = self.families.get(name.removesuffix("_created"))
        return name.endswith("_created") and base is not None and base.type != "gauge"

    def queryable(self) -> set[str]:
        """What PromQL can name: sample names, and a histogram's or gauge's family name."""
        names = {s.name for s in self.samples}
        names |= {n for n, f in self.families.items() if f.type in ("gauge", "histogram")}
        return names


def metric_names(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Metric-like names in these files: {name: files that name it}."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            if name not in NOT_METRICS and not name.startswith("relay_notify_"):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented_table() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's table: {metric: (type, labels)}; labels leave out `partition`."""
    rows = re.findall(
        r"^\| `(relay_[a-z_]+)` \| (\w+) \| ([^|]*) \|", (DOCS / "metrics.md").read_text(), re.M
    )
    return {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def served_name(family: Any) -> str:
    """The name operators query: a counter's with `_total`."""
    return f"{family.name}_total" if family.type == "counter" else str(family.name)


async def test_docs_and_chart_name_only_served_metrics_and_every_metric_is_documented(
    events_table: str, nats_url: str, tmp_path: Path, relay_process: Any
) -> None:
    stream = unique_name("docs")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    data = config_dict(events_table, nats_url, stream, aggregates=["book"])
    # The continuous audit's series exist on the holder of an audited outbox.
    data["outboxes"]["loans"]["audit"] = {"enabled": True, "delay": "100ms", "every": "100ms"}
    # Its series exist; no standby streams here, so events go out without one.
    data["source"]["survive_failover"] = {"standbys": 1, "without_standbys": "publish"}
    nowhere = unique_name("nostream")  # no stream captures it: retried for ever
    data["outboxes"]["stuck"] = {
        "broker": "nats",
        "aggregates": ["dvd"],
        "partitions": 2,
        "retry": {"initial": "20ms", "max": "200ms"},
        "trace_context": True,  # its relay_trace_context_invalid_total series exists
        "messages": {
            "BookLent": {**LIBRARY_MESSAGES["BookLent"], "destination": f"{nowhere}.dvds"},
            # A condition: its skipped-messages series exists from the start, at zero.
            "BookReturned": {
                **LIBRARY_MESSAGES["BookReturned"],
                "destination": f"{nowhere}.returns",
                "when": "data.late",
            },
        },
    }
    config = save(tmp_path, data)
    assert run_cli(["migrate", "--config", str(config)]).returncode == 0
    try:
        async with connect(events_table) as conn:
            await append_many(conn, [*loans(5), OVERSIZED_LOAN, *loans(8, "dvd")])
        relay = relay_process(["run", "--config", str(config)])
        port = await http_port(relay)

        async def scrape() -> Scrape:
            status, text = await get(port, "/metrics")
            assert status == 200, text
            return Scrape(text)

        # The lag of an outbox that retries keeps rising (it is measured while retrying).
        async def all_families_and_a_rising_lag() -> bool:
            now = await scrape()
            return (
                now.value("relay_parked_messages", outbox="loans") == 1
                and now.value("relay_audit_position", outbox="loans") is not None
                and 1.0 in now.values("relay_retrying", outbox="stuck")
                and max(now.values("relay_lag_seconds", outbox="stuck"), default=0) > 2.0
            )

        await eventually(all_families_and_a_rising_lag, timeout=40)
        served = await scrape()
        check_names(served)
        check_partition_label(served)

        # `relay parked drop` lowers the gauge on the holder, with no change of lease.
        dropped = run_cli(
            ["parked", "drop", "--all", "--yes", "--outbox", "loans", "--config", str(config)]
        )
        assert dropped.returncode == 0, dropped.stdout + dropped.stderr

        async def parked_gauge_lowered() -> bool:
            return (await scrape()).value("relay_parked_messages", outbox="loans") == 0

        await eventually(parked_gauge_lowered, timeout=20)
        acquired = {"outbox": "loans", "event": "acquired"}
        assert (await scrape()).value("relay_lease_transitions_total", **acquired) == 1

        # While the barrier waits for a writer's transaction, the lag is measured too: the
        # positions it took count in relay_lag_events, and an event committed after it
        # ages in relay_lag_seconds.
        async with (
            connect(events_table) as blocker,
            connect(events_table) as writer,
            blocker.transaction(),
        ):
            await append(blocker, "book", "held", 1, "BookLent", {"loanId": "H"})
            await append(writer, "book", "after", 1, "BookLent", {"loanId": "A"})

            async def lag_rises_behind_the_transaction() -> bool:
                now = await scrape()
                return (now.value("relay_lag_events", outbox="loans") or 0) >= 2 and (
                    now.value("relay_lag_seconds", outbox="loans") or 0
                ) > 1.0

            await eventually(lag_rises_behind_the_transaction, timeout=20)
            await relay.wait_for_log("waiting for a transaction that holds the event table")
        assert relay.returncode is None
    finally:
        await delete_stream(nats_url, stream)


def check_names(served: Scrape) -> None:
    queryable = served.queryable()
    # Named in docs/ (or the README): served.
    in_docs = metric_names([*DOCS.rglob("*.md"), ROOT / "README.md"])
    missing = {n: sorted(f) for n, f in in_docs.items() if not n.startswith("kube_")}
    missing = {n: f for n, f in missing.items() if n not in queryable}
    assert not missing, f"named in the docs, not served by /metrics: {missing}"
    # Named in the chart (rules, dashboard, rule tests): served, or kube-state-metrics' own
    # and then said so in docs/metrics.md.
    in_chart = metric_names(p for p in CHART.rglob("*") if p.is_file() and p.suffix != ".png")
    assert in_chart, "no metric found in the chart"
    metrics_md = (DOCS / "metrics.md").read_text()
    for name, files in in_chart.items():
        if name.startswith("kube_"):
            assert f"`{name}`" in metrics_md and "kube-state-metrics" in metrics_md, name
        else:
            assert name in queryable, f"{name} ({sorted(files)}) is not served by /metrics"
    # Served: in docs/metrics.md's table with its type and labels (relay_), or named there
    # (the standard process_ and python_ collectors).
    table = documented_table()
    for family in served.families.values():
        name = served_name(family)
        if served.is_created(family.name):
            continue  # the client library's own `_created` gauge, documented as such
        if not name.startswith("relay_"):
            assert f"`{name}`" in metrics_md, f"{name} is served but not in docs/metrics.md"
            continue
        assert name in table, f"{name} is served but not in docs/metrics.md's table"
        kind, labels = table[name]
        assert kind == family.type, f"{name}: docs say {kind}, served as {family.type}"
        served_labels = {k for s in family.samples for k in s.labels} - {"partition", "le"}
        assert labels == served_labels, f"{name}: docs say {labels}, served {served_labels}"
        assert all(
            s.name.removeprefix(family.name) in SUFFIXES[family.type] for s in family.samples
        )
    assert "`_created` gauge" in metrics_md
    assert set(table) <= {served_name(f) for f in served.families.values()}


def check_partition_label(served: Scrape) -> None:
    """A split outbox's series carry `partition`; an outbox of one partition's do not, nor
    do the outbox's own (its partition count)."""
    for sample in served.samples:
        outbox = sample.labels.get("outbox")
        if sample.name == "relay_partitions_mismatch":
            assert "partition" not in sample.labels, sample
        elif outbox == "stuck":
            assert sample.labels.get("partition") in {"0", "1"}, sample
        elif outbox == "loans":
            assert "partition" not in sample.labels, sample
