"""Prometheus metrics: one registry per relay process, no globals.

Every label value comes from a bounded set: outbox names and destination
templates come from the config, reasons and lease events from fixed lists.
A rendered destination (which may contain an aggregate id) is never a label.

Per-outbox series also carry `partition` (`0`..`K-1`) when the outbox is split into
lanes. For an outbox with one lane it is empty and left out of the output, so that
its series are exactly those of a relay that could not split outboxes.

The registry also carries the client library's standard process and Python collectors
(memory, CPU, open file descriptors, GC), read from /proc at each scrape: nothing is
counted on the hot path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate

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


class Metrics:
    def __init__(self) -> None:
        self._series = CollectorRegistry(auto_describe=True)
        # What /metrics shows and tests read: the series, without empty partitions.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_WithoutEmptyPartition(self._series))
        # process_* and python_*, on this registry (the library's defaults sit on its global one).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.build_info = self._gauge(
            "relay_build_info", "The relay's version; always 1.", ["version"]
        )
        self.build_info.labels(__version__).set(1)
        # -- leases
        self.lease_held = self._gauge(
            "relay_lease_held", "1 while this replica holds the outbox's lease."
        )
        self.partitions_mismatch = self._gauge(
            "relay_partitions_mismatch",
            "1 while this replica's config gives the outbox another partition count than the"
            " one it runs with: it relays none of its lanes (see `relay status`).",
            ["outbox"],
        )
        self.lease_transitions = self._counter(
            "relay_lease_transitions",
            "Lease acquisitions, releases, losses and fencings.",
            [*OUTBOX, "event"],
        )
        # -- reading and publishing
        self.events_read = self._counter("relay_events_read", "Events read from the event table.")
        self.published = self._counter(
            "relay_messages_published",
            "Messages acknowledged by the broker.",
            [*OUTBOX, "destination"],
        )
        self.skipped = self._counter(
            "relay_messages_skipped",
            "Messages not built because their rule's condition rejected the event, by type.",
            [*OUTBOX, "type", "reason"],
        )
        self.failures = self._counter(
            "relay_publish_failures",
            "Failed publish attempts (the batch's first unacknowledged message), by reason.",
            [*OUTBOX, "reason"],
        )
        self.unexpected_duplicates = self._counter(
            "relay_unexpected_duplicates",
            "Messages the broker dropped as duplicates of another event's message with the"
            " same id, sent in the same or the previous batch.",
            OUTBOX,
        )
        self.publish_duration = self._histogram(
            "relay_publish_duration_seconds", "Time to publish a batch and await its acks."
        )
        self.batch_messages = self._histogram(
            "relay_batch_messages", "Messages per published batch.", _BATCH_BUCKETS
        )
        self.end_to_end = BatchHistogram(
            "relay_end_to_end_latency_seconds",
            "From the event's created_at (database clock) to the broker's ack.",
            OUTBOX,
            _LATENCY_BUCKETS,
            self._series,
        )
        self.trace_context_invalid = self._counter(
            "relay_trace_context_invalid",
            "Trace contexts (traceparent, tracestate) dropped as invalid; the message went"
            " out without them.",
        )
        # -- how far behind, and what is stuck
        self.lag_events = self._gauge(
            "relay_lag_events", "Positions between the checkpoint and the log's head."
        )
        self.lag_seconds = self._gauge(
            "relay_lag_seconds",
            "Age of the oldest event not yet relayed, by the database clock; 0 when caught up.",
        )
        self.parked = self._gauge("relay_parked_messages", "Messages parked now.")
        self.parked_total = self._counter(
            "relay_messages_parked", "Messages parked, by reason.", [*OUTBOX, "reason"]
        )
        self.retrying = self._gauge("relay_retrying", "1 while the outbox retries a failed batch.")
        self.halted = self._gauge(
            "relay_outbox_halted",
            "1 while the outbox is halted: its head went below the checkpoint (see status).",
        )
        self.barrier_wait = self._histogram(
            "relay_barrier_wait_seconds",
            "Time the drain barrier waited for writers' transactions to end.",
        )
        # -- source.survive_failover
        self.replication_wait = self._histogram(
            "relay_replication_wait_seconds",
            "Time events were held back until enough standbys had flushed their commits.",
        )
        self.standbys_missing = self._gauge(
            "relay_standbys_missing",
            "Streaming standbys short of source.survive_failover.standbys; 0 when enough"
            " stream (events are held back, or published without them, meanwhile).",
        )

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = OUTBOX) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self._series)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = OUTBOX) -> Counter:
        return Counter(name, doc, list(labels), registry=self._series)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float] = _LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, doc, list(OUTBOX), buckets=buckets, registry=self._series)

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
