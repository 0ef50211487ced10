"""Prometheus metrics: one registry per relay process, no globals.

The relay's own families are declared as one table, metrics.toml (type, name, labels and
help of each); `Metrics` makes them on its registry, each as the attribute the table names.
Every label value comes from a bounded set: outbox names and destination templates come
from the config, reasons and lease events from fixed lists. A rendered destination (which
may contain an aggregate id) is never a label.

Per-outbox series also carry `partition` (`0`..`K-1`) when the outbox is split into
lanes. For an outbox with one lane it is empty and left out of the output, so that
its series are exactly those of a relay that could not split outboxes.

The registry also carries the client library's standard process and Python collectors
(memory, CPU, open file descriptors, GC), read from /proc at each scrape: nothing is
counted on the hot path.
"""

from __future__ import annotations

import tomllib
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib.resources import files
from itertools import accumulate
from types import MappingProxyType
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from relay import __version__

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
LEASE_EVENTS = ("acquired", "released", "lost", "fenced")
OUTBOX = ("outbox", "partition")
_BUCKETS = {"latency": _LATENCY_BUCKETS, "batch": _BATCH_BUCKETS}


@cache
def families() -> Mapping[str, Mapping[str, Any]]:
    """metrics.toml's tables by attribute: each family's type, name, labels and help."""
    text = files(__package__).joinpath("metrics.toml").read_text(encoding="utf-8")
    return MappingProxyType(tomllib.loads(text))


def _make(family: Mapping[str, Any], registry: CollectorRegistry) -> Collector:
    kind, name, doc = family["type"], family["name"], family["help"]
    labels = list(family.get("labels", OUTBOX))
    buckets = _BUCKETS[family.get("buckets", "latency")]
    match kind:
        case "gauge":
            return Gauge(name, doc, labels, registry=registry)
        case "counter":
            return Counter(name, doc, labels, registry=registry)
        case "histogram":
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)
        case "batch_histogram":
            return BatchHistogram(name, doc, labels, buckets, registry)
    raise ValueError(f"metrics.toml: {name} is of no type the relay makes ({kind!r})")


class Metrics:
    """The relay's series, one registry per relay process: the families of metrics.toml,
    each made as the attribute its table names, and the client library's collectors."""

    build_info: Gauge
    # Leases
    lease_held: Gauge
    partitions_mismatch: Gauge
    lease_transitions: Counter
    # Reading and publishing
    events_read: Counter
    published: Counter
    skipped: Counter
    failures: Counter
    unexpected_duplicates: Counter
    publish_duration: Histogram
    batch_messages: Histogram
    end_to_end: BatchHistogram
    trace_context_invalid: Counter
    # How far behind, and what is stuck
    lag_events: Gauge
    lag_seconds: Gauge
    parked: Gauge
    parked_total: Counter
    retrying: Gauge
    halted: Gauge
    barrier_wait: Histogram
    # source.survive_failover
    replication_wait: Histogram
    standbys_missing: Gauge
    # The continuous audit
    audit_enabled: Gauge
    audit_checked: Counter
    audit_missing: Counter
    audit_position: Gauge
    audit_lag: Gauge

    def __init__(self) -> None:
        self._series = CollectorRegistry(auto_describe=True)
        # What /metrics shows and tests read: the series, without empty partitions.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WithoutEmptyPartition(self._series))
        # process_* and python_*, on this registry (the library's defaults sit on its global one).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        for attribute, family in families().items():
            setattr(self, attribute, _make(family, self._series))
        self.build_info.labels(__version__).set(1)

    def register_lane(self, labels: tuple[str, str]) -> None:
        """Create the lane's series at zero, so alerts see them before the first event."""
        self.lease_held.labels(*labels).set(0)
        self.retrying.labels(*labels).set(0)
        self.halted.labels(*labels).set(0)
        self.events_read.labels(*labels)
        for event in LEASE_EVENTS:
            self.lease_transitions.labels(*labels, event)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BatchHistogram(Collector):
    """A histogram observed a batch of values at a time, for the per-event latency.

    prometheus_client's Histogram takes two locks and scans its buckets for every value;
    observing each event's latency that way cost about 4% of the relay's CPU. Here a batch
    is a bisect per value into plain counters. Scrapes run on the same event loop, so no
    lock is needed. The output is an ordinary Prometheus histogram.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = tuple(float(bound) for bound in buckets)
        self._les = [*map(floatToGoString, self.bounds), "+Inf"]  # as prometheus_client writes
        self._children: dict[tuple[str, ...], BatchHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> BatchHistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = BatchHistogramChild(self.bounds)
        return child

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative = list(accumulate(child.counts))
            buckets = list(zip(self._les, cumulative, strict=True))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class BatchHistogramChild:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is above every bound (+Inf)
        self.sum = 0.0

    def observe_many(self, values: Sequence[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1  # the first bound >= value: le
        self.sum += sum(values)


class _WithoutEmptyPartition(Collector):
    """Drops `partition=""`: the same series to Prometheus, and the output of old."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            family.samples = [
                sample._replace(labels=_without_empty_partition(sample.labels))
                for sample in family.samples
            ]
            yield family


def _without_empty_partition(labels: dict[str, str]) -> dict[str, str]:
    if labels.get("partition") != "":
        return labels
    return {key: value for key, value in labels.items() if key != "partition"}
