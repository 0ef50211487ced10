"""A seeded chaos soak: relay replicas, writers and faults together, judged by a consumer.

`python -m tests.soak --minutes N --broker nats|kafka --seed S` runs a long soak; the short
one is `tests/soak/test_soak.py`, part of `python3 dev.py test`. See docs/reliability.md.
"""
