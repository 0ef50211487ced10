"""Metric labels of lanes: a split outbox's series carry `partition`, a whole one's do not."""

from __future__ import annotations

from relay.core.lanes import lanes_of, metric_labels
from relay.core.metrics import Metrics


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
