"""The webhook adapter against a real HTTP server (aiohttp.web, tests/support/webhook_server):
what every publisher does (base.py), then what only webhooks do: Standard Webhooks signatures
with rotated keys, the status codes, Retry-After, redirects, one request per key in flight,
order through failures, stalls and slow receivers, the body limit, the CloudEvents binding.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.formats.json import JSONFormat
from pydantic import TypeAdapter
from standardwebhooks.webhooks import Webhook

from relay.brokers import create_publisher
from relay.brokers.http import HttpPublisher
from relay.config.brokers import BrokerConfig
from relay.core.publishing import Message, Publisher, to_structured
from relay.errors import PermanentPublishError, TransientPublishError
from tests.contract.brokers import http as http_harness
from tests.contract.brokers.http import HttpHarness
from tests.contract.harness import Consumed
from tests.contract.test_contract import check_per_key_order, loans, relay_config
from tests.integration.publishers import base
from tests.integration.publishers.base import message
from tests.support.db import append_many, connect
from tests.support.nats_tls import write_certificates
from tests.support.net import free_port
from tests.support.scenario import eventually, load_and_migrate, running
from tests.support.webhook_server import OLD_SECRET, SECRET, Answer, WebhookServer


class HttpKit(base.PublisherKit[HttpHarness]):
    name = "http"
    batches = (300,)
    total_order = False  # per key: keys go out side by side
    oversized = 1024 * 1024 + 1  # over max_body_bytes: the relay does not send it
    oversize_keys = ("k", "k", "k")  # what is held back is the rest of the key
    oversize_says = "more than max_body_bytes (1,048,576)"
    invalid_destination = "no spaces allowed"
    invalid_destination_says = "holds a space or a control character"
    connect_reaches_the_broker = False  # the session is made without a request
    time_attribute = "ce-time"
    timed_attributes = {
        "ce-specversion": "1.0",
        "ce-id": "book/b1@1",
        "ce-type": "library.book-lent.v1",
        "ce-source": "/outbox-relay/loans",
        "ce-time": "2026-11-29T08:30:15.250000+00:00",
        "ce-partitionkey": "b1",
        "content-type": "application/json",
    }
    start = staticmethod(http_harness.start)

    def unreachable(self) -> dict[str, Any]:
        return {"url": f"http://127.0.0.1:{free_port()}/{{destination}}"}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'http': ", "cannot connect")

    def carried(self, consumed: Consumed) -> dict[str, str]:
        headers = consumed.raw.headers
        return {n: v for n, v in headers.items() if n.startswith("ce-") or n == "content-type"}

    def content_type(self, consumed: Consumed) -> str:
        return str(consumed.raw.headers["content-type"])

    def check_native(self, consumed: Consumed, sent: Message) -> None:
        assert consumed.raw.headers["webhook-id"] == sent.id
        assert consumed.raw.verified is True


class TestHttpPublisher(base.PublisherTestcase):
    Kit = HttpKit


# -- what only webhooks do ---------------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[WebhookServer]:
    receiver = await WebhookServer().start()
    try:
        yield receiver
    finally:
        await receiver.close()


def config(server: WebhookServer, **options: Any) -> Any:
    raw = {
        "type": "http",
        "url": f"{server.url}/in/{{destination}}",
        "signing_keys": [SECRET],
        "ack_timeout": "5s",
        **options,
    }
    return TypeAdapter(BrokerConfig).validate_python(raw)


@asynccontextmanager
async def publishing(server: WebhookServer, **options: Any) -> AsyncIterator[HttpPublisher]:
    publisher = HttpPublisher("hooks", config(server, **options))
    try:
        yield publisher
    finally:
        await publisher.close()


def books(keys: str, versions: int) -> list[Message]:
    """Interleaved: version 1 of each key, then version 2 of each..."""
    return [message("orders", k, v) for v in range(1, versions + 1) for k in keys]


async def test_every_key_of_a_rotation_verifies_and_the_id_is_the_message_id(
    server: WebhookServer,
) -> None:
    async with publishing(server, signing_keys=[SECRET, OLD_SECRET]) as pub:
        assert await pub.publish([message("orders", "b1")]) == [None]
    (request,) = server.requests
    assert request.headers["webhook-id"] == "book/b1@1"
    signatures = request.headers["webhook-signature"].split(" ")
    assert len(signatures) == 2 and all(s.startswith("v1,") for s in signatures)
    for secret in (SECRET, OLD_SECRET):  # a receiver holding either key accepts it
        assert Webhook(secret).verify(request.body, request.headers) == {"book": "b1", "v": 1}
    stranger = "whsec_" + base64.b64encode(b"a key nobody configured....").decode()
    with pytest.raises(Exception, match="No matching signature"):
        Webhook(stranger).verify(request.body, request.headers)


async def test_headers_from_the_config_are_sent_and_never_shown(server: WebhookServer) -> None:
    async with publishing(server, headers={"Authorization": "Bearer s3cr3t-token"}) as pub:
        assert await pub.publish([message("orders", "b1")]) == [None]
        assert "s3cr3t" not in repr(pub._config)
    assert server.requests[0].headers["authorization"] == "Bearer s3cr3t-token"


async def test_the_url_template_names_destination_key_and_type(server: WebhookServer) -> None:
    url = f"{server.url}/{{destination}}/{{type}}?key={{key}}"
    async with publishing(server, url=url) as pub:
        assert await pub.publish([message("orders", "a b/c")]) == [None]
    assert server.requests[0].path == "/orders/library.book-lent.v1"
    assert server.requests[0].headers["ce-partitionkey"] == "a%20b/c"


async def test_a_key_or_destination_never_moves_a_webhook_to_another_endpoint(
    server: WebhookServer,
) -> None:
    """`.` and `..` (raw or encoded), and a `#`, from the event are refused before sending:
    the client and the receiver would resolve them to another path. Everything else stays
    in its place, a `/` or `%` of the key encoded."""
    by_key = f"{server.url}/x/{{key}}/{{type}}"
    refused_keys = ["..", ".", "a/.."]
    kept_keys = ["...", ".a", "%2E%2E"]  # not a step; `%` encoded, so it stays a name
    async with publishing(server, url=by_key) as pub:
        batch = [message("ignored", key) for key in refused_keys + kept_keys]
        outcomes = await pub.publish(batch)
    for key, outcome in zip(refused_keys, outcomes, strict=False):
        assert isinstance(outcome, PermanentPublishError), key
        assert "path step" in str(outcome) and "another endpoint" in str(outcome)
    assert outcomes[len(refused_keys) :] == [None] * len(kept_keys)
    kept = [f"/x/{key}/library.book-lent.v1" for key in kept_keys]
    assert sorted(r.path for r in server.requests) == sorted(kept)

    refused_destinations = ["hooks/../admin", "hooks/%2e%2E/admin", "hooks/..\\admin", "b1#x"]
    async with publishing(server) as pub:  # url: .../in/{destination}
        batch = [message(d, f"k{i}") for i, d in enumerate(refused_destinations)]
        outcomes = await pub.publish(batch)
        assert all(isinstance(o, PermanentPublishError) for o in outcomes), outcomes
        assert "'..'" in str(outcomes[0]) and "'%2e%2E'" in str(outcomes[1])
        assert "'#'" in str(outcomes[3])
        assert pub.refusal(batch[0]) == str(outcomes[0])
        assert await pub.publish([message("hooks/b1", "k")]) == [None]
    assert sorted(r.path for r in server.requests) == sorted([*kept, "/in/hooks/b1"])


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503])
async def test_transient_statuses_are_retried_and_then_delivered(
    server: WebhookServer, status: int
) -> None:
    sent = message("orders", "b1")
    server.plan[sent.id] = [Answer(status, body=b"busy")]
    async with publishing(server) as pub:
        (outcome,) = await pub.publish([sent])
        assert isinstance(outcome, TransientPublishError)
        assert f"answered {status}" in str(outcome) and "busy" in str(outcome)
        assert await pub.publish([sent]) == [None]
    assert [r.status for r in server.requests] == [status, 204]
    assert server.requests[0].id == server.requests[1].id == sent.id  # one id: dedup on it


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("7", 7.0),
        ("100000", 120.0),  # capped at retry_after_max
        ("soon", None),  # not a number nor a date: the backoff alone decides
    ],
)
async def test_retry_after_in_seconds_is_handed_to_the_backoff_and_capped(
    server: WebhookServer, header: str, expected: float | None
) -> None:
    sent = message("orders", "b1")
    server.plan[sent.id] = [Answer(429, headers={"Retry-After": header})]
    async with publishing(server, retry_after_max="2m") as pub:
        (outcome,) = await pub.publish([sent])
    assert isinstance(outcome, TransientPublishError)
    assert outcome.retry_after == expected


async def test_retry_after_as_an_http_date(server: WebhookServer) -> None:
    sent = message("orders", "b1")
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    server.plan[sent.id] = [Answer(503, headers={"Retry-After": when})]
    async with publishing(server) as pub:
        (outcome,) = await pub.publish([sent])
    assert outcome is not None and outcome.retry_after is not None
    assert 20 < outcome.retry_after <= 30


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422])
async def test_other_4xx_are_permanent_with_the_status_and_the_answer(
    server: WebhookServer, status: int
) -> None:
    sent = message("orders", "b1")
    answer = b'{"error": "unknown field \\"book\\"", "detail": "' + b"x" * 500 + b'"}'
    server.plan[sent.id] = [Answer(status, body=answer)]
    async with publishing(server) as pub:
        (outcome,) = await pub.publish([sent])
    assert isinstance(outcome, PermanentPublishError)
    text = str(outcome)
    assert text.startswith("broker 'hooks': message 'book/b1@1': ")
    assert f"/in/orders' answered {status}" in text
    assert 'unknown field \\"book\\"' in text or 'unknown field "book"' in text
    assert "x" * 300 not in text  # the first bytes only


async def test_a_redirect_is_parked_unless_following_is_configured(
    server: WebhookServer,
) -> None:
    sent = message("orders", "b1")
    moved = Answer(308, headers={"Location": f"{server.url}/moved"})
    server.plan[sent.id] = [moved]
    async with publishing(server) as pub:
        (outcome,) = await pub.publish([sent])
    assert isinstance(outcome, PermanentPublishError)
    assert "answered 308" in str(outcome) and "/moved" in str(outcome)
    assert "follow_redirects" in str(outcome)
    server.plan[sent.id] = [moved]
    async with publishing(server, follow_redirects=True) as pub:
        assert await pub.publish([sent]) == [None]
    assert [(r.path, r.status) for r in server.requests] == [
        ("/in/orders", 308),
        ("/in/orders", 308),
        ("/moved", 204),
    ]
    assert server.requests[-1].verified  # the same body and signature at the new place


async def test_one_request_per_key_in_flight_many_keys_together(server: WebhookServer) -> None:
    server.default = Answer(204, delay=0.05)  # slow: requests overlap if they can
    batch = books("abcdefgh", 4)
    async with publishing(server, max_in_flight=4) as pub:
        assert await pub.publish(batch) == [None] * len(batch)
    assert server.overlaps == []  # never two of one key at once
    assert 2 <= server.most_in_flight <= 4
    order = [(r.id, r.key) for r in server.delivered()]
    assert base.per_key(order) == base.per_key([(m.id, m.key) for m in batch])


async def test_a_failed_key_holds_back_its_own_messages_only_and_the_retry_sends_no_twice(
    server: WebhookServer,
) -> None:
    batch = books("abc", 3)  # a1 b1 c1 a2 b2 c2 a3 b3 c3
    server.plan["book/b@2"] = [Answer(503)]
    async with publishing(server) as pub:
        outcomes = await pub.publish(batch)
        by_id = dict(zip((m.id for m in batch), outcomes, strict=True))
        assert isinstance(by_id["book/b@2"], TransientPublishError)
        assert "not sent" in str(by_id["book/b@3"])  # held back after the failure
        assert all(by_id[f"book/{k}@{v}"] is None for k in "ac" for v in (1, 2, 3))
        # The core sends the rest again from the failed message: b2 and b3 go out, what
        # the receiver already has (c2, a3, c3) is reported delivered without a request.
        rest = batch[batch.index(next(m for m in batch if m.id == "book/b@2")) :]
        assert await pub.publish(rest) == [None] * len(rest)
        assert pub.duplicates == 3
    ids = [r.id for r in server.delivered()]
    assert sorted(ids) == sorted(m.id for m in batch)  # each once
    assert [i for i in ids if i.startswith("book/b")] == ["book/b@1", "book/b@2", "book/b@3"]
    assert server.overlaps == []


async def test_a_429_stops_the_batch_for_every_key_not_yet_started(
    server: WebhookServer,
) -> None:
    """Too Many Requests is about the receiver, not the message: the keys still waiting are
    not sent, and carry its Retry-After to the backoff."""
    batch = books("abcdefgh", 1)
    server.plan["book/a@1"] = [Answer(429, headers={"Retry-After": "3"})]
    async with publishing(server, max_in_flight=1) as pub:  # one at a time: a goes first
        outcomes = await pub.publish(batch)
    assert all(isinstance(o, TransientPublishError) for o in outcomes)
    assert all(o is not None and o.retry_after == 3.0 for o in outcomes)
    assert [r.id for r in server.requests] == ["book/a@1"]


async def test_a_stalled_receiver_times_out_as_transient_then_delivers(
    server: WebhookServer,
) -> None:
    sent = message("orders", "b1")
    async with publishing(server, ack_timeout="300ms") as pub:
        server.hold()
        (outcome,) = await pub.publish([sent])
        assert isinstance(outcome, TransientPublishError)
        assert "no answer within 0.3s" in str(outcome)
        server.release()
        assert await pub.publish([sent]) == [None]
    assert sent.id in [r.id for r in server.delivered()]


async def test_a_slow_receiver_within_the_timeout_is_delivered(server: WebhookServer) -> None:
    server.default = Answer(200, delay=0.3)
    batch = books("ab", 2)
    async with publishing(server, ack_timeout="5s") as pub:
        assert await pub.publish(batch) == [None] * 4
    assert len(server.delivered()) == 4


async def test_a_body_over_the_limit_is_permanent_and_not_sent(server: WebhookServer) -> None:
    batch = [message("orders", "k", 1), message("orders", "k", 2, body=b"x" * 101)]
    async with publishing(server, max_body_bytes=100) as pub:
        first, second = await pub.publish(batch)
    assert first is None
    assert isinstance(second, PermanentPublishError)
    assert "101 bytes, more than max_body_bytes (100)" in str(second)
    assert [r.id for r in server.requests] == ["book/k@1"]


async def test_the_receivers_own_413_is_permanent(server: WebhookServer) -> None:
    small = await WebhookServer(max_body=1024).start()
    try:
        pub = create_publisher("hooks", config(small))
        try:
            (outcome,) = await pub.publish([message("orders", "k", 1, body=b"x" * 4096)])
        finally:
            await pub.close()
    finally:
        await small.close()
    assert isinstance(outcome, PermanentPublishError)
    assert "answered 413 Request Entity Too Large" in str(outcome)


async def test_ids_a_header_would_alter_are_permanent(server: WebhookServer) -> None:
    batch = [message("orders", "k", 1), message("orders", "k", 2, id="book/k\n@2")]
    async with publishing(server) as pub:
        first, second = await pub.publish(batch)
    assert first is None
    assert isinstance(second, PermanentPublishError)
    assert "header webhook-id holds a line feed" in str(second)


@pytest.mark.parametrize("mode", ["binary", "structured"])
async def test_the_cloudevents_sdk_reads_keys_no_header_could_carry_as_written(
    server: WebhookServer, mode: str
) -> None:
    key = 'Zoë "the" 100% reader'
    sent = message("orders", key)
    if mode == "structured":
        sent = replace(sent)
        to_structured(sent)
    async with publishing(server) as pub:
        assert await pub.publish([sent]) == [None]
    (request,) = server.requests
    event = ce_http.from_http(ce_http.HTTPMessage(request.headers, request.body), JSONFormat())
    assert event.get_extension("partitionkey") == key
    assert event.get_id() == sent.id
    if mode == "binary":
        assert request.headers["ce-partitionkey"] == "Zo%C3%AB%20%22the%22%20100%25%20reader"
    else:
        assert request.headers["content-type"] == "application/cloudevents+json"
        assert not any(name.startswith("ce-") for name in request.headers)
        assert json.loads(request.body)["data"] == {"book": key, "v": 1}
    assert request.verified


async def test_https_receivers_are_verified_against_the_ca_file(tmp_path: Path) -> None:
    ca, cert, key = write_certificates(tmp_path)
    server = await WebhookServer(tls=(cert, key)).start()
    try:
        url = f"{server.url}/in/{{destination}}"
        trusting = {"url": url, "tls": {"ca_file": str(ca)}}
        async with publishing(server, url=url) as pub:  # the system's CAs do not know it
            (outcome,) = await pub.publish([message("orders", "b1")])
        assert isinstance(outcome, TransientPublishError)
        assert "certificate verify failed" in str(outcome)
        async with publishing(server, **trusting) as pub:
            assert await pub.publish([message("orders", "b1")]) == [None]
        assert await HttpPublisher("hooks", config(server, **trusting)).probe(["orders"]) == []
        (problem,) = await HttpPublisher("hooks", config(server, url=url)).probe(["orders"])
        assert "certificate verify failed" in problem
    finally:
        await server.close()
    assert [(r.id, r.verified) for r in server.requests] == [("book/b1@1", True)]


async def test_probe_connects_to_each_host_and_sends_nothing(server: WebhookServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}/x"
    publisher: Publisher = HttpPublisher("hooks", config(server, url="{destination}"))
    problems = await publisher.probe([f"{server.url}/a", f"{server.url}/b", dead, "nope"])  # type: ignore[attr-defined]
    assert server.requests == []
    assert len(problems) == 2
    assert problems[0] == "broker 'hooks': 'nope' is not an http:// or https:// URL"
    assert problems[1].startswith(f"broker 'hooks': cannot connect to {dead.removesuffix('/x')}")
    # Destinations known only at run time: the host the config's URL names is still probed.
    fixed_host = HttpPublisher("hooks", config(server, url=f"{dead}/in/{{destination}}"))
    (problem,) = await fixed_host.probe([])
    assert problem.startswith(f"broker 'hooks': cannot connect to {dead.removesuffix('/x')}")
    assert await HttpPublisher("hooks", config(server)).probe([]) == []


# -- the relay's drain, the receiver going down in the middle ----------------------------------


async def test_the_receiver_down_mid_drain_loses_nothing_and_keeps_each_keys_order(
    events_table: str, tmp_path: Path
) -> None:
    """The receiver's process ends while the relay drains a backlog (requests in flight are
    cut, new connections refused), then comes back on the same port: every event arrives,
    each book's versions in order of first arrival, every request signed."""
    first = await WebhookServer().start()
    first.default = Answer(204, delay=0.01)  # slow enough to be stopped in the middle
    harness = HttpHarness(first)
    raw = relay_config(events_table, harness)
    raw["brokers"]["under-test"]["url"] = f"{first.url}/hooks/{{destination}}"
    config = await load_and_migrate(tmp_path, raw)
    events = loans(books=5, versions=30)
    second: WebhookServer | None = None
    try:
        async with connect(events_table) as conn:
            await append_many(conn, events)
        async with running(config) as relay:
            await first.wait_delivered(20)
            await first.close()
            assert len(first.delivered()) < len(events), "the drain ended before the outage"

            def retrying() -> bool:
                return relay.states["loans"].attempts >= 2

            await eventually(retrying, timeout=30)
            second = await WebhookServer(port=first.port).start()
            await eventually(
                lambda: (
                    {r.id for r in first.delivered() + second.delivered()}
                    >= {f"book/{e.aggregate_id}@{e.version}" for e in events}
                ),
                timeout=60,
            )
        received = [http_harness.consumed(r) for r in first.delivered() + second.delivered()]
    finally:
        await first.close()
        if second is not None:
            await second.close()
    check_per_key_order(received)
    assert second.overlaps == [] and first.overlaps == []


async def test_an_aggregate_id_in_the_destination_never_leaves_its_path(
    events_table: str, tmp_path: Path
) -> None:
    """`destination: hooks/{aggregate_id}` under `url: .../in/{destination}`: ids that would
    step out of `hooks/` (`../admin`, `..`, encoded or not) are parked, naming the step,
    and never reach the receiver; the checkpoint goes past them and the others arrive."""
    server = await WebhookServer().start()
    harness = HttpHarness(server)
    raw = relay_config(events_table, harness)
    raw["brokers"]["under-test"]["url"] = f"{server.url}/in/{{destination}}"
    rules = raw["outboxes"]["loans"]["messages"]
    for rule in rules.values():
        rule["destination"] = "hooks/{aggregate_id}"
    raw["outboxes"]["loans"]["park_after"] = 1
    config = await load_and_migrate(tmp_path, raw)
    escaping = {"../admin": "'..'", "..": "'..'", "%2E%2E": "'%2E%2E'", "x/./y": "'.'"}
    events = [("book", book, 1, "BookLent", {"loanId": "l"}) for book in ["b1", *escaping, "b2"]]
    try:
        async with connect(events_table) as conn:
            await append_many(conn, events)
        async with running(config):

            async def settled() -> bool:
                async with connect(events_table) as conn:
                    parked = await conn.fetchval("SELECT count(*) FROM relay.parked")
                return parked == len(escaping) and len(server.delivered()) == 2

            await eventually(settled, timeout=30)
        async with connect(events_table) as conn:
            rows = await conn.fetch("SELECT aggregate_id, error FROM relay.parked ORDER BY id")
            position = await conn.fetchval("SELECT position FROM relay.checkpoints")
    finally:
        await harness.close()
    assert [r.path for r in server.requests] == ["/in/hooks/b1", "/in/hooks/b2"]
    assert [row["aggregate_id"] for row in rows] == list(escaping)
    for row, step in zip(rows, escaping.values(), strict=True):
        assert f"holds the path step {step}" in row["error"], row["error"]
    assert position == len(events)
