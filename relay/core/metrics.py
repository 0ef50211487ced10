"""Prometheus metrics: one registry per relay process, no globals.

Every label value comes from a bounded set: outbox names and destination
templates come from the config, reasons and lease events from fixed lists.
A rendered destination (which may contain an aggregate id) is never a label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from relay import __version__

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
LEASE_EVENTS = ("acquired", "released", "lost", "fenced")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Gauge(
            "relay_build_info", "The relay's version; always 1.", ["version"], registry=r
        )
        self.build_info.labels(__version__).set(1)
        self.lease_held = Gauge(
            "relay_lease_held",
            "1 while this replica holds the outbox's lease.",
            ["outbox"],
            registry=r,
        )
        self.lease_transitions = Counter(
            "relay_lease_transitions",
            "Lease acquisitions, releases, losses and fencings.",
            ["outbox", "event"],
            registry=r,
        )
        self.events_read = Counter(
            "relay_events_read", "Events read from the event table.", ["outbox"], registry=r
        )
        self.published = Counter(
            "relay_messages_published",
            "Messages acknowledged by the broker.",
            ["outbox", "destination"],
            registry=r,
        )
        self.failures = Counter(
            "relay_publish_failures",
            "Failed publish attempts (the batch's first unacknowledged message), by reason.",
            ["outbox", "reason"],
            registry=r,
        )
        self.publish_duration = Histogram(
            "relay_publish_duration_seconds",
            "Time to publish a batch and await its acks.",
            ["outbox"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_messages = Histogram(
            "relay_batch_messages",
            "Messages per published batch.",
            ["outbox"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "relay_end_to_end_latency_seconds",
            "From the event's created_at (database clock) to the broker's ack.",
            ["outbox"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lag_events = Gauge(
            "relay_lag_events",
            "Positions between the checkpoint and the log's head.",
            ["outbox"],
            registry=r,
        )
        self.lag_seconds = Gauge(
            "relay_lag_seconds",
            "Age of the oldest event not yet relayed, by the database clock; 0 when caught up.",
            ["outbox"],
            registry=r,
        )
        self.parked = Gauge("relay_parked_messages", "Messages parked now.", ["outbox"], registry=r)
        self.parked_total = Counter(
            "relay_messages_parked",
            "Messages parked, by reason.",
            ["outbox", "reason"],
            registry=r,
        )
        self.retrying = Gauge(
            "relay_retrying",
            "1 while the outbox retries a failed batch.",
            ["outbox"],
            registry=r,
        )
        self.halted = Gauge(
            "relay_outbox_halted",
            "1 while the outbox is halted: its head went below the checkpoint (see status).",
            ["outbox"],
            registry=r,
        )
        self.barrier_wait = Histogram(
            "relay_barrier_wait_seconds",
            "Time the drain barrier waited for writers' transactions to end.",
            ["outbox"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def register_outbox(self, outbox: str) -> None:
        """Create the outbox's series at zero, so alerts see them before the first event."""
        self.lease_held.labels(outbox).set(0)
        self.retrying.labels(outbox).set(0)
        self.halted.labels(outbox).set(0)
        self.events_read.labels(outbox)
        for event in LEASE_EVENTS:
            self.lease_transitions.labels(outbox, event)

    def render(self) -> bytes:
        return generate_latest(self.registry)
