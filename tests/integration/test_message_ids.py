"""Two events never render one message id: a broker that deduplicates (JetStream here)
would drop the second as a duplicate of the first, and the relay would count it published.

Found by a black-box attack: with the default id `{aggregate_type}/{aggregate_id}@{version}`,
the book `a/b` and the aggregate type `book/a` with id `b` were both `book/a/b@1`.
"""

from __future__ import annotations

from pathlib import Path

from relay.cli.check import run_check
from tests.support.db import append_many, connect
from tests.support.jetstream import fetch_all
from tests.support.scenario import config_dict, eventually, load_and_migrate, running, status

# (aggregate_type, aggregate_id): each pair of these read alike in an unescaped id.
AGGREGATES = [
    ("book", "a/b"),
    ("book/a", "b"),
    ("book%2Fa", "b"),  # what an escaped `book/a` would look like, were `%` left alone
    ("user", "ann@example.org"),
    ("book", "plain"),
]


async def test_events_whose_ids_read_alike_are_all_delivered_with_distinct_ids(
    events_table: str, nats_url: str, stream: str, tmp_path: Path
) -> None:
    database, subject = events_table, stream
    messages = {"BookLent": {"type": "library.book-lent.v1", "destination": f"{subject}.loans"}}
    config = await load_and_migrate(
        tmp_path, config_dict(database, nats_url, subject, messages=messages)
    )
    async with connect(database) as conn:
        await append_many(conn, [(t, i, 1, "BookLent", {}) for t, i in AGGREGATES])
    async with running(config):
        received = await fetch_all(nats_url, subject, expected=len(AGGREGATES))
    ids = [m.headers["Nats-Msg-Id"] for m in received]
    assert ids == [
        "book/a/b@1",
        "book%2Fa/b@1",
        "book%252Fa/b@1",
        "user/ann%40example.org@1",
        "book/plain@1",
    ]


async def test_an_id_over_jetstreams_header_limit_is_parked_and_check_foretells_it(
    events_table: str, nats_url: str, stream: str, tmp_path: Path
) -> None:
    """JetStream refuses a header block over 65,535 bytes (err_code 10097) whatever its
    max_payload; the id goes in two headers. `relay check --last` must say so before
    `relay run` parks it, and the events around it flow in order."""
    messages = {"BookLent": {"type": "library.book-lent.v1", "destination": f"{stream}.loans"}}
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, stream, messages=messages, park_after=1)
    )
    long = "b" * 40_000  # Nats-Msg-Id and ce-id: 80,000 bytes of headers, a 40 kB body
    async with connect(events_table) as conn:
        await append_many(
            conn,
            [(t, i, 1, "BookLent", {}) for t, i in [("book", "a"), ("book", long), ("book", "c")]],
        )
    report = await run_check(config, 3)
    assert {row["id"] for row in report.rows if row.get("parked") == "rejected"} == {
        f"book/{long}@1"
    }
    async with running(config):
        received = await fetch_all(nats_url, stream, expected=2)

        async def parked() -> bool:
            return bool((await status(config))[0]["parked"] == 1)

        await eventually(parked, timeout=30)
    assert [m.headers["Nats-Msg-Id"] for m in received] == ["book/a@1", "book/c@1"]
    async with connect(events_table) as conn:
        error = await conn.fetchval("SELECT error FROM relay.parked")
    assert "bytes of headers, more than JetStream takes (65,535)" in error
    assert len(error) < 400
