"""The NATS JetStream adapter against a real server: what every publisher does (base.py), and
headers, acks, dedup, errors, subjects and TLS as only NATS has them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from relay.brokers._nats_subjects import MAX_SUBJECT_BYTES
from relay.brokers.nats import NatsPublisher
from relay.config import NatsBrokerConfig
from relay.core.publishing import Message
from relay.errors import PermanentPublishError, TransientPublishError
from relay.postgres.store import Store
from tests.contract.brokers import nats as nats_harness
from tests.contract.brokers.nats import NatsHarness
from tests.contract.harness import Consumed
from tests.integration.publishers import base
from tests.support import db
from tests.support.jetstream import connect, create_stream, delete_stream, fetch_all, unique_name
from tests.support.nats_server import NatsServer
from tests.support.nats_tls import TlsNats, write_certificates
from tests.support.net import free_port
from tests.support.proxy import TcpProxy
from tests.support.scenario import config_dict, eventually, load_and_migrate, running


def message(subject: str, n: int, body: bytes = b'{"n":1}') -> Message:
    return base.message(subject, f"b{n}", 1, body, position=n)


def publisher(url: str) -> NatsPublisher:
    return NatsPublisher("nats", NatsBrokerConfig(type="nats", servers=[url], ack_timeout=2.0))


class NatsKit(base.PublisherKit[NatsHarness]):
    name = "nats"
    options = {"ack_timeout": 2.0, "connect_timeout": 2.0}
    oversized = 2 * 1024 * 1024  # above the server's default 1 MB max_payload
    oversize_says = "larger than the server's max_payload"
    invalid_destination = "no spaces allowed"
    invalid_destination_says = "invalid subject 'no spaces allowed'"
    time_attribute = "ce-time"
    timed_attributes = {
        "Nats-Msg-Id": "book/b1@1",  # first: see test_a_header_name_inside_a_value_...
        "ce-specversion": "1.0",
        "ce-id": "book/b1@1",
        "ce-type": "library.book-lent.v1",
        "ce-source": "/outbox-relay/loans",
        "ce-partitionkey": "b1",
        "ce-time": "2026-11-29T08:30:15.250000+00:00",
        "content-type": "application/json",
    }
    missing_destination_says = "no stream"
    counts_duplicates = True
    duplicate_window = 120.0
    start = staticmethod(nats_harness.start)

    def unreachable(self) -> dict[str, Any]:
        return {"servers": [f"nats://127.0.0.1:{free_port()}"]}

    def unreachable_says(self) -> tuple[str, ...]:
        return ("broker 'nats': cannot connect",)

    def carried(self, consumed: Consumed) -> dict[str, str]:
        return dict(consumed.raw.headers)

    def content_type(self, consumed: Consumed) -> str:
        return str(consumed.raw.headers["content-type"])


class TestNatsPublisher(
    base.PublisherTestcase,
    base.DeduplicationTestcase,
    base.MissingDestinationTestcase,
    base.ReadBackTestcase,
):
    Kit = NatsKit


@pytest.mark.parametrize("key", ["Nats-Msg-Id", "x Nats-Msg-Id: forged"])
async def test_a_header_name_inside_a_value_does_not_hide_the_dedup_id(
    nats_url: str, key: str
) -> None:
    """nats-server 2.9 finds a header by the first occurrence of its name in the block: a
    value holding `Nats-Msg-Id` ahead of the real one turned deduplication off for it."""
    stream = unique_name("adapter")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    pub = publisher(nats_url)
    sent = Message(
        id=f"user/{key}@1",
        type="library.user-named.v1",
        destination=f"{stream}.users",
        key=key,
        body=b"{}",
        source="/outbox-relay/users",
        time=None,
        position=1,
    )
    try:
        assert await pub.publish([sent]) == [None]
        assert await pub.publish([sent]) == [None]  # a re-send, as after a lost PubAck
        assert pub.duplicates == 1
        received = await fetch_all(nats_url, stream)
        assert [m.headers["Nats-Msg-Id"] for m in received] == [sent.id]
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


async def test_a_full_stream_answers_an_error_for_that_message_alone(nats_url: str) -> None:
    """The server's error PubAck is read for the one message it refused, naming the cause."""
    stream = unique_name("full")
    async with connect(nats_url) as nc:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=stream, subjects=[f"{stream}.>"], max_msgs=2, discard=DiscardPolicy.NEW
            )
        )
    pub = publisher(nats_url)
    try:
        outcomes = await pub.publish([message(f"{stream}.a", n) for n in (1, 2, 3)])
        assert outcomes[:2] == [None, None]
        assert isinstance(outcomes[2], TransientPublishError)
        assert "maximum messages" in str(outcomes[2])
        assert pub.duplicates == 0
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


async def test_late_pubacks_of_a_timed_out_batch_are_not_taken_for_the_next(
    nats_url: str,
) -> None:
    """PubAcks that come after their batch gave up must not acknowledge the next batch."""
    stream = unique_name("late")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    host, port = nats_url.removeprefix("nats://").split(":")
    with TcpProxy(host, int(port)) as proxy:
        pub = NatsPublisher(
            "nats",
            NatsBrokerConfig(
                type="nats", servers=[f"nats://{proxy.host}:{proxy.port}"], ack_timeout=0.5
            ),
        )
        try:
            await pub.connect()
            first = [message(f"{stream}.a", n) for n in range(1, 51)]
            proxy.pause()
            outcomes = await pub.publish(first)
            assert all(isinstance(o, TransientPublishError) for o in outcomes)
            proxy.resume()  # the first batch reaches the server now; its PubAcks follow
            second = [message(f"{stream}.a", n) for n in range(51, 101)]
            assert await pub.publish(second) == [None] * 50
            assert pub.duplicates == 0
            # The first batch was stored late: sent again, every message is a duplicate.
            assert await pub.publish(first) == [None] * 50
            assert pub.duplicates == 50
        finally:
            await pub.close()
    await delete_stream(nats_url, stream)


async def test_stream_is_created_from_the_config(nats_url: str) -> None:
    name = unique_name("provisioned")
    config = NatsBrokerConfig(
        type="nats",
        servers=[nats_url],
        stream={"name": name, "subjects": [f"{name}.>"], "duplicate_window": 30},
    )
    pub = NatsPublisher("nats", config)
    try:
        assert await pub.publish([message(f"{name}.loans", 1)]) == [None]
        received = await fetch_all(nats_url, name, expected=1)
        assert [m.headers["ce-id"] for m in received] == ["book/b1@1"]
        await pub.close()
        # An existing stream is verified and reused, not recreated (its message stays).
        assert await pub.publish([message(f"{name}.loans", 2)]) == [None]
        assert len(await fetch_all(nats_url, name, expected=2)) == 2
    finally:
        await pub.close()
        await delete_stream(nats_url, name)


async def test_core_nats_publishes_without_acknowledgements(nats_url: str) -> None:
    subject = unique_name("core")
    pub = NatsPublisher("nats", NatsBrokerConfig(type="nats", servers=[nats_url], jetstream=False))
    async with connect(nats_url) as nc:
        sub = await nc.subscribe(f"{subject}.>")
        await nc.flush()
        try:
            batch = [message(f"{subject}.loans", n) for n in range(1, 6)]
            assert await pub.publish(batch) == [None] * 5
            got = [await sub.next_msg(timeout=5) for _ in range(5)]
            assert [m.headers["ce-id"] for m in got if m.headers] == [m.id for m in batch]
        finally:
            await sub.unsubscribe()
            await pub.close()


# -- subjects the client must never send ----------------------------------------------------

INVALID_SUBJECTS = [
    ("{s}.*", "wildcard"),
    ("{s}.>", "wildcard"),
    ("{s}.star*", "wildcard"),
    ("{s}.gt>", "wildcard"),
    ("{s}.a..b", "empty token"),
    ("{s}.", "starts or ends with '.'"),
    (".{s}", "starts or ends with '.'"),
    ("{s}.a b", "whitespace or a control character"),
    ("{s}.a\tb", "whitespace or a control character"),
    ("{s}.a\x00b", "whitespace or a control character"),
    ("{s}.a\x7fb", "whitespace or a control character"),
]


@pytest.mark.parametrize(("template", "rule"), INVALID_SUBJECTS)
async def test_invalid_subject_is_permanent_and_stops_the_rest(
    nats_url: str, template: str, rule: str
) -> None:
    stream = unique_name("subject")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    pub = publisher(nats_url)
    bad = template.format(s=stream)
    try:
        batch = [message(f"{stream}.ok", 1), message(bad, 2), message(f"{stream}.ok", 3)]
        first, refused, later = await pub.publish(batch)
        assert first is None
        assert isinstance(refused, PermanentPublishError)
        assert f"invalid subject {bad!r}" in str(refused)
        assert rule in str(refused)
        assert isinstance(later, TransientPublishError)
        assert "not sent: an earlier message of the batch failed" in str(later)
        received = await fetch_all(nats_url, stream, expected=1)
        assert [(m.subject, m.headers["ce-id"]) for m in received] == [
            (f"{stream}.ok", "book/b1@1")
        ]
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


async def test_unusual_but_valid_subjects_are_published(nats_url: str) -> None:
    stream = unique_name("subject")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    pub = publisher(nats_url)
    subjects = [f"{stream}.book-1_x", f"{stream}.$price", f"{stream}.café", f"{stream}.a/b@2"]
    try:
        batch = [message(subject, n) for n, subject in enumerate(subjects, 1)]
        assert await pub.publish(batch) == [None] * len(batch)
        received = await fetch_all(nats_url, stream, expected=len(batch))
        assert [m.subject for m in received] == subjects
    finally:
        await pub.close()
        await delete_stream(nats_url, stream)


@pytest.mark.parametrize("bad", ["oversized", "wildcard subject"])
async def test_core_nats_refuses_a_bad_message_alone_and_keeps_order(
    nats_url: str, bad: str
) -> None:
    """Messages written before it count as published; it alone is refused (and parked later);
    nothing after it is sent."""
    subject = unique_name("core")
    pub = NatsPublisher("nats", NatsBrokerConfig(type="nats", servers=[nats_url], jetstream=False))
    refusable = (
        message(f"{subject}.ok", 2, body=b"x" * (2 * 1024 * 1024))
        if bad == "oversized"
        else message(f"{subject}.*", 2)
    )
    async with connect(nats_url) as nc:
        sub = await nc.subscribe(f"{subject}.>")
        await nc.flush()
        try:
            batch = [message(f"{subject}.ok", 1), refusable, message(f"{subject}.ok", 3)]
            first, refused, later = await pub.publish(batch)
            assert first is None
            assert isinstance(refused, PermanentPublishError)
            assert isinstance(later, TransientPublishError)
            got = await sub.next_msg(timeout=5)
            await nc.flush()  # anything else the server routed to us has arrived by now
            assert (got.subject, (got.headers or {}).get("ce-id")) == (f"{subject}.ok", "book/b1@1")
            assert sub.pending_msgs == 0
        finally:
            await sub.unsubscribe()
            await pub.close()


async def test_relay_parks_events_whose_id_makes_an_invalid_subject(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """Ids spliced into the subject: the bad ones are parked, the rest go out in order."""
    subject = unique_name("subject")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    messages = {
        "BookLent": {
            "type": "library.book-lent.v1",
            "destination": "{subject}.books.{aggregate_id}",
            "payload": {"bookId": "aggregate_id"},
        }
    }
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, subject, messages=messages)
    )
    longest = "ok-" + "x" * (MAX_SUBJECT_BYTES - len(f"{subject}.books.ok-"))
    ids = ["ok-1", "*", ">", "ok-2", "star*", "gt>", "a..b", "ok-3", longest, longest + "y"]
    invalid = [i for i in ids if not i.startswith("ok-") or len(i) > len(longest)]
    try:
        async with db.connect(events_table) as conn:
            await db.append_many(conn, [("book", i, 1, "BookLent", {}) for i in ids])
        async with running(config):

            async def all_parked() -> bool:
                return len(await parked(events_table)) == len(invalid)

            await eventually(all_parked)
            received = await fetch_all(nats_url, subject, expected=4)
        assert [m.subject for m in received] == [
            f"{subject}.books.ok-1",
            f"{subject}.books.ok-2",
            f"{subject}.books.ok-3",
            f"{subject}.books.{longest}",  # as long as a subject may be
        ]
        assert not any("*" in m.subject or ">" in m.subject for m in received)
        rows = await parked(events_table)
        assert [row["message_id"] for row in rows] == [f"book/{i}@1" for i in invalid]
        assert {row["reason"] for row in rows} == {"rejected"}
        assert all("invalid subject" in str(row["error"]) for row in rows)
    finally:
        await delete_stream(nats_url, subject)


# Ids a user may choose that nats-py would send altered, with what the reason names.
REWRITTEN = {
    "alice\nsmith": "Nats-Msg-Id holds a line feed (\\x0a)",
    "alice\rsmith": "Nats-Msg-Id holds a carriage return (\\x0d)",
    "alice smith ": "ce-partitionkey starts or ends with whitespace",
    "\talice smith": "Nats-Msg-Id holds a tab (\\x09)",
    "alice\x01smith": "Nats-Msg-Id holds a control character (\\x01)",
}


async def test_ids_nats_would_rewrite_are_parked_not_taken_for_duplicates(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """`alice\\nsmith` went out as `alice smith`: JetStream dropped the real `alice smith`."""
    subject = unique_name("rewrite")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    config = await load_and_migrate(tmp_path, config_dict(events_table, nats_url, subject))
    ids = [*REWRITTEN, "alice smith", "al\u00a0ice", "Łódź ok"]
    try:
        async with db.connect(events_table) as conn:
            await db.append_many(conn, [("book", i, 1, "BookLent", {"loanId": i}) for i in ids])
        async with running(config):

            async def all_parked() -> bool:
                return len(await parked(events_table)) == len(REWRITTEN)

            await eventually(all_parked)
            received = await fetch_all(nats_url, subject, expected=3)
        assert [m.headers["Nats-Msg-Id"] for m in received] == [
            "book/alice smith@1",
            "book/al\u00a0ice@1",
            "book/Łódź ok@1",
        ]
        rows = await parked(events_table)
        assert [row["message_id"] for row in rows] == [f"book/{i}@1" for i in REWRITTEN]
        assert {row["reason"] for row in rows} == {"rejected"}
        for row, said in zip(rows, REWRITTEN.values(), strict=True):
            assert f"broker 'nats': header {said}" in str(row["error"]), row["error"]
    finally:
        await delete_stream(nats_url, subject)


async def parked(dsn: str) -> list[dict[str, object]]:
    async with db.connect(dsn) as conn:
        return [asdict(p) for p in await Store("relay").parked(conn, "loans")]


# -- TLS: never a cleartext CONNECT ---------------------------------------------------------

PASSWORD = "s3cret-never-in-cleartext"


@pytest.mark.parametrize(
    ("scheme", "tls"),
    [("tls", {}), ("tls", None), ("nats", {})],
    ids=["tls-url-and-tls-block", "tls-url-only", "tls-block-only"],
)
async def test_tls_refuses_a_server_without_tls_before_sending_credentials(
    nats_factory: Callable[[], NatsServer],
    tcp_proxy: Callable[..., TcpProxy],
    scheme: str,
    tls: dict[str, str] | None,
) -> None:
    """Also guards the hook into nats-py: if it stops being called, CONNECT shows up here."""
    server = nats_factory()
    proxy = tcp_proxy("127.0.0.1", server.port, record=True)
    config = NatsBrokerConfig(
        type="nats",
        servers=[f"{scheme}://127.0.0.1:{proxy.port}"],
        user="relay",
        password=PASSWORD,
        tls=tls,
    )
    pub = NatsPublisher("nats", config)
    try:
        await pub.connect()
    except TransientPublishError as exc:
        error = str(exc)
    else:
        error = "connected"
    finally:
        await pub.close()
    await eventually(lambda: proxy.connections == 0)
    sent = proxy.client_bytes()
    assert b"CONNECT" not in sent
    assert PASSWORD.encode() not in sent
    assert error == (
        f"broker 'nats': cannot connect: server 127.0.0.1:{proxy.port} does not require TLS;"
        " refusing to send credentials in cleartext"
    )


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[TlsNats, Path]]:
    """A nats-server requiring TLS, and the file of the CA that signed its certificate."""
    ca, cert, key = write_certificates(tmp_path)
    server = TlsNats(tmp_path / "nats-tls", cert, key).start()
    try:
        yield server, ca
    finally:
        server.kill()


@pytest.mark.parametrize("scheme", ["tls", "nats"])
async def test_tls_server_verified_with_the_configured_ca(
    tls_server: tuple[TlsNats, Path], scheme: str
) -> None:
    server, ca = tls_server
    name = unique_name("tls")
    config = NatsBrokerConfig(
        type="nats",
        servers=[f"{scheme}://127.0.0.1:{server.port}"],
        user="relay",
        password=PASSWORD,
        tls={"ca_file": ca},
        stream={"name": name, "subjects": [f"{name}.>"]},
    )
    pub = NatsPublisher("nats", config)
    try:
        assert await pub.publish([message(f"{name}.loans", 1)]) == [None]
    finally:
        await pub.close()


async def test_tls_url_without_tls_block_verifies_with_the_system_trust_store(
    tls_server: tuple[TlsNats, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, ca = tls_server
    name = unique_name("tls")
    config = NatsBrokerConfig(
        type="nats",
        servers=[f"tls://127.0.0.1:{server.port}"],
        stream={"name": name, "subjects": [f"{name}.>"]},
    )
    pub = NatsPublisher("nats", config)
    try:
        (untrusted,) = await pub.publish([message(f"{name}.loans", 1)])
        assert isinstance(untrusted, TransientPublishError)
        assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted)
        # The same CA, now in the trust store OpenSSL reads by default: trusted.
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        assert await pub.publish([message(f"{name}.loans", 1)]) == [None]
    finally:
        await pub.close()


async def test_an_id_template_that_is_not_unique_is_warned_about(
    events_table: str, nats_url: str, tmp_path: Path
) -> None:
    """JetStream drops the second event of an aggregate as a duplicate of the first."""
    subject = unique_name("collide")
    await create_stream(nats_url, subject, [f"{subject}.>"])
    messages = {
        "BookLent": {
            "type": "library.book-lent.v1",
            "destination": f"{subject}.loans",
            "id": "{aggregate_type}/{aggregate_id}",  # no version: not unique per event
        }
    }
    config = await load_and_migrate(
        tmp_path, config_dict(events_table, nats_url, subject, messages=messages)
    )
    try:
        async with db.connect(events_table) as conn:
            await db.append_many(
                conn, [("book", "b1", v, "BookLent", {"loanId": f"L{v}"}) for v in (1, 2, 3)]
            )
        async with running(config) as relay:

            def unexpected() -> float:
                sample = relay.metrics.registry.get_sample_value
                return sample("relay_unexpected_duplicates_total", {"outbox": "loans"}) or 0.0

            await eventually(lambda: unexpected() == 2)
        received = await fetch_all(nats_url, subject, expected=1)
        assert [m.headers["Nats-Msg-Id"] for m in received] == ["book/b1"]
    finally:
        await delete_stream(nats_url, subject)


@pytest.mark.parametrize("jetstream", [True, False])
async def test_a_body_under_max_payload_that_headers_push_over_is_refused_alone(
    nats_url: str, jetstream: bool
) -> None:
    """nats-py compares only the body with max_payload; the server counts the headers too, and
    closes the connection on a message over it. Sent, such a message would fail as a lost
    connection on every retry, for ever; it is refused before anything is sent instead."""
    subject = unique_name("payload")
    stream = unique_name("PAYLOAD")
    if jetstream:
        await create_stream(nats_url, stream, [f"{subject}.>"])
    pub = NatsPublisher(
        "nats",
        NatsBrokerConfig(type="nats", servers=[nats_url], jetstream=jetstream, ack_timeout=2.0),
    )
    try:
        await pub.connect()
        limit = connected_max_payload(pub)
        long_id = "i" * 500
        near = base.message(f"{subject}.ok", long_id, 1, b"x" * (limit - 100), position=2)
        batch = [message(f"{subject}.ok", 1), near, message(f"{subject}.ok", 3)]
        first, refused, later = await pub.publish(batch)
        assert first is None
        assert isinstance(refused, PermanentPublishError)
        assert "max_payload" in str(refused)
        assert isinstance(later, TransientPublishError)
        assert pub.refusal(near) == str(refused)  # what `relay check --last` shows
        assert await pub.publish([batch[2]]) == [None]  # the connection is still good
    finally:
        await pub.close()
        if jetstream:
            await delete_stream(nats_url, stream)


def connected_max_payload(pub: NatsPublisher) -> int:
    nc = pub._nc
    assert nc is not None
    return int(nc.max_payload)


async def test_the_audit_reader_leaves_the_cloudevents_headers_unparsed(
    nats_url: str,
) -> None:
    """The reader overrides nats-py's private header parser (half the cost of a read back):
    if nats-py stops calling it, this fails, and the audit is only slower."""
    from relay.brokers.nats_readback import _ReadingClient

    stream = unique_name("ids")
    await create_stream(nats_url, stream, [f"{stream}.>"])
    client = _ReadingClient()
    try:
        await client.connect(nats_url)
        sub = await client.subscribe(f"{stream}.x")
        headers = {"Nats-Msg-Id": "book/b1@1", "ce-id": "book/b1@1", "content-type": "a/b"}
        async with connect(nats_url) as nc:
            await nc.publish(f"{stream}.x", b"{}", headers=headers)
        msg = await sub.next_msg(timeout=5)
        assert msg.headers == {"Nats-Msg-Id": "book/b1@1"}
    finally:
        await client.close()
        await delete_stream(nats_url, stream)


async def test_a_subject_of_the_servers_own_api_is_refused_and_nothing_is_purged(
    nats_url: str,
) -> None:
    """Found by an attack: a destination made from event data of
    `$JS.API.STREAM.PURGE.<stream>` was sent: the server purged the stream, and its API reply
    was taken for a PubAck, so the event counted as published. Subjects starting with `$`
    are the server's (NATS reserves them for the system): refused before sending, for good,
    but for a key-value bucket's `$KV.`, which a stream stores."""
    victim = unique_name("victim")
    await create_stream(nats_url, victim, [f"{victim}.>"])
    pub = publisher(nats_url)
    try:
        await pub.publish([message(f"{victim}.kept", n) for n in (1, 2)])
        reserved = (f"$JS.API.STREAM.PURGE.{victim}", f"$JS.ACK.{victim}.c.1.1.1.1.0", "$SYS.x")
        assert pub.refusal(message("$KV.bucket.key", 3)) is None
        for subject in reserved:
            (refused,) = await pub.publish([message(subject, 3)])
            assert isinstance(refused, PermanentPublishError), (subject, refused)
            assert "the server's own" in str(refused)
            assert pub.refusal(message(subject, 3)) is not None
        assert len(await fetch_all(nats_url, victim, expected=2)) == 2
    finally:
        await pub.close()
        await delete_stream(nats_url, victim)


async def test_a_reply_that_is_not_a_puback_is_not_taken_for_one(nats_url: str) -> None:
    """A service answering on a subject no stream captures (a request-reply responder) sent
    a reply the adapter read as `stored`: the message counted as published and was not."""
    subject = unique_name("responder")
    async with connect(nats_url) as nc:

        async def answer(msg: Any) -> None:
            await msg.respond(b'{"type":"io.example.response","success":true}')

        await nc.subscribe(f"{subject}.>", cb=answer)
        await nc.flush()
        pub = publisher(nats_url)
        try:
            (outcome,) = await pub.publish([message(f"{subject}.x", 1)])
            assert outcome is not None, "a responder's reply was taken for a PubAck"
            assert "not a PubAck" in str(outcome)
        finally:
            await pub.close()
