"""Metric labels of lanes: a split outbox's series carry `partition`, a whole one's do not."""

from __future__ import annotations

from typing import get_type_hints

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from relay.core.lanes import lanes_of, metric_labels
from relay.core.metrics import BatchHistogram, Metrics, families


def test_lane_labels() -> None:
    assert metric_labels("loans") == ("loans", "")
    assert metric_labels("loans/3") == ("loans", "3")
    assert [lane.labels for lane in lanes_of("loans", 2)] == [("loans", "0"), ("loans", "1")]


def test_an_outbox_of_one_lane_exports_no_partition_label() -> None:
    metrics = Metrics()
    metrics.register_lane(lanes_of("whole", 1)[0].labels)
    for lane in lanes_of("split", 2):
        metrics.register_lane(lane.labels)
    metrics.lease_held.labels("split", "1").set(1)
    text = metrics.render().decode()
    assert 'relay_lease_held{outbox="whole"} 0.0' in text
    assert 'relay_lease_held{outbox="split",partition="0"} 0.0' in text
    assert 'relay_lease_held{outbox="split",partition="1"} 1.0' in text
    assert 'partition=""' not in text
    sample = metrics.registry.get_sample_value
    assert sample("relay_lease_held", {"outbox": "whole"}) == 0.0
    assert sample("relay_lease_held", {"outbox": "split", "partition": "1"}) == 1.0


def test_batch_histogram_writes_what_prometheus_histogram_writes() -> None:
    """The per-event latency is observed a batch at a time; the exposition must not change."""
    values = [0.0, 0.001, 0.005, 0.1, 0.5, 1.0, 2.0, 299.9, 400.0]
    buckets = (0.005, 0.1, 1, 300)
    reference, batched = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("x_seconds", "d", ["outbox"], buckets=buckets, registry=reference)
    for value in values:
        histogram.labels("loans").observe(value)
    latency = BatchHistogram("x_seconds", "d", ["outbox"], buckets, batched)
    latency.labels("loans").observe_many(values[:4])  # two batches, one series
    latency.labels("loans").observe_many(values[4:])
    expected = [
        line for line in generate_latest(reference).decode().splitlines() if "_created" not in line
    ]
    assert generate_latest(batched).decode().splitlines() == expected


def test_every_family_of_metrics_toml_is_an_attribute_of_the_type_declared() -> None:
    """metrics.toml and Metrics' attributes are one list: each table is made as the attribute
    it names, of the class the attribute declares, and no declared attribute lacks a table."""
    declared = get_type_hints(Metrics)
    assert list(declared) == list(families())  # in the order /metrics serves them
    metrics = Metrics()
    for name, kind in declared.items():
        assert type(getattr(metrics, name)) is kind, name
    names = [family["name"] for family in families().values()]
    assert len(set(names)) == len(names)
    assert all(name.startswith("relay_") for name in names)
