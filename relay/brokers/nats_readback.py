"""Reading JetStream back for an audit: an ephemeral ordered consumer per stream.

Each destination subject is looked up in the stream that captures it; each stream is read
once, from the audit's start time (`deliver_policy: by_start_time`), headers only (the id
is in `Nats-Msg-Id`, in both CloudEvents modes), without acknowledgements, up to the last
message stored when the read began. The consumer is ephemeral (the server deletes it once
the audit unsubscribes or goes away) and takes nothing from any other consumer. Core NATS
(`jetstream: false`) keeps nothing, and cannot be read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Collection
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamInfo

from relay.brokers._nats import TlsOnlyClient, open_connection
from relay.brokers._nats_subjects import captures
from relay.config.brokers import NatsBrokerConfig
from relay.core.readback import Horizon, Stored
from relay.errors import CannotReadBack, ReadBackError, TransientPublishError

READ_TIMEOUT = 10.0  # seconds a read waits for the next messages the stream said it holds
HELD = 10_000  # messages delivered and not yet read, at most


class NatsReader:
    def __init__(self, name: str, config: NatsBrokerConfig) -> None:
        if not config.jetstream:
            raise CannotReadBack(
                f"broker {name!r} publishes with core NATS (jetstream: false), which keeps no"
                " message: there is nothing to read back"
            )
        self.name = name
        self._config = config
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._streams: dict[str, str | None] = {}  # subject -> the stream capturing it

    async def connect(self) -> None:
        self._streams.clear()  # each audit (round) looks the streams up afresh: they change
        if self._nc is not None and self._nc.is_connected:
            return
        try:
            clients = (_ReadingClient, _TlsOnlyReadingClient)
            self._nc = await open_connection(self.name, self._config, clients)
        except TransientPublishError as exc:
            raise ReadBackError(str(exc)) from exc
        self._js = self._nc.jetstream(timeout=self._config.ack_timeout)

    async def read(
        self, destinations: Collection[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        by_stream: dict[str, list[str]] = {}
        for subject in sorted(destinations):
            stream = await self._stream_of(subject)
            if stream is not None:
                by_stream.setdefault(stream, []).append(subject)
        for stream, subjects in sorted(by_stream.items()):
            async for stored in self._read_stream(stream, set(subjects), since):
                yield stored

    async def horizon(self, destination: str) -> Horizon:
        stream = await self._stream_of(destination)
        if stream is None:
            return Horizon(None, problem=f"no stream captures subject {destination!r}")
        info = await self._found(stream)
        if info is None:
            return Horizon(None, problem=f"stream {stream!r} does not exist")
        self._keeps(stream, info)
        config, state = info.config, info.state
        problem = None
        if not any(captures(pattern, destination) for pattern in config.subjects or []):
            problem = f"stream {stream!r} does not capture subject {destination!r} now"
        limits = [
            f"{name} {value}"
            for name, value in (
                ("max_msgs", config.max_msgs),
                ("max_bytes", config.max_bytes),
                ("max_msgs_per_subject", config.max_msgs_per_subject),
            )
            if value is not None and value > 0
        ]
        max_age = config.max_age if config.max_age else None
        first = first_id = None
        if state.messages:
            first, first_id = await self._oldest(stream, state.first_seq)
        return Horizon(
            first,
            first_id,
            max_age=max_age,
            limits=", ".join(limits) or None,
            where=f"stream {stream} seq {state.first_seq}",
            problem=problem,
            last=await self._last_stored(stream) if not state.messages else None,
        )

    async def duplicate_window(self, destination: str) -> float | None:
        stream = await self._stream_of(destination)
        if stream is None:
            return None
        info = await self._found(stream)
        window = None if info is None else info.config.duplicate_window
        return float(window) if window else None

    async def close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()

    def _jetstream(self) -> JetStreamContext:
        if self._js is None:
            raise ReadBackError(f"broker {self.name!r}: not connected")
        return self._js

    async def _stream_of(self, subject: str) -> str | None:
        """The configured stream (`brokers.<name>.stream`): what the operator means its
        consumers to read, whether it captures the subject now or not; else the stream
        that captures it."""
        if subject not in self._streams:
            configured = self._config.stream
            try:
                if configured is not None:
                    found: str | None = (await self._info(configured.name)).config.name
                else:
                    found = await self._jetstream().find_stream_name_by_subject(subject)
            except nats.js.errors.NotFoundError:
                found = None
            except (OSError, TimeoutError, nats.errors.Error) as exc:
                raise self._failed("cannot look up the stream of a subject", exc) from exc
            self._streams[subject] = found
        return self._streams[subject]

    async def _info(self, stream: str) -> StreamInfo:
        try:
            return await self._jetstream().stream_info(stream)
        except nats.js.errors.NotFoundError:
            raise
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise self._failed(f"cannot read stream {stream!r}", exc) from exc

    async def _found(self, stream: str) -> StreamInfo | None:
        try:
            return await self._info(stream)
        except nats.js.errors.NotFoundError:
            return None

    async def _last_stored(self, stream: str) -> datetime | None:
        """When the stream stored its newest message, gone or not: nats-py's stream info
        leaves the server's `last_ts` out, so the API is asked directly. None if unknown."""
        assert self._nc is not None
        try:
            reply = await self._nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)
            stamp = json.loads(reply.data)["state"]["last_ts"]
        except (OSError, TimeoutError, nats.errors.Error, KeyError, ValueError):
            return None
        return _rfc3339(stamp)

    async def _oldest(self, stream: str, sequence: int) -> tuple[datetime | None, str | None]:
        """The time and id of the stream's message at `sequence` (its first)."""
        try:
            message = await self._jetstream().get_msg(stream, seq=sequence)
        except nats.js.errors.NotFoundError:
            return None, None  # removed since the stream's state was read
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise self._failed(f"cannot read stream {stream!r}", exc) from exc
        when = _utc(message.time) if message.time else None
        return when, (message.headers or {}).get("Nats-Msg-Id")

    async def _read_stream(
        self, stream: str, subjects: set[str], since: datetime | None
    ) -> AsyncIterator[Stored]:
        """The stream's messages on `subjects` from `since`, up to its last one now."""
        info = await self._found(stream)
        if info is None or not info.state.messages:
            return
        self._keeps(stream, info)
        # One subject: the server filters; several: the whole stream, filtered here (a
        # consumer takes one filter subject before nats-server 2.10).
        only = next(iter(subjects)) if len(subjects) == 1 else None
        feed = _Feed(stream, only, subjects, info.state.last_seq)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
            opt_start_time=None if since is None else since.astimezone(UTC),
            headers_only=True,
        )
        try:
            sub = await self._jetstream().subscribe(
                only or ">", stream=stream, ordered_consumer=True, cb=feed.take, config=config
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise self._failed(f"cannot read stream {stream!r}", exc) from exc
        try:
            consumer = await sub.consumer_info()
            if consumer.num_pending == 0 and not (
                consumer.delivered and consumer.delivered.consumer_seq
            ):
                return  # nothing since `since`
            while True:
                try:
                    batch = await feed.next(READ_TIMEOUT)
                except TimeoutError as exc:
                    raise self._failed(f"reading stream {stream!r} stopped", exc) from exc
                for stored in batch:
                    yield stored
                if feed.ended and not feed.ready.is_set():
                    return
        except (OSError, nats.errors.Error) as exc:
            raise self._failed(f"cannot read stream {stream!r}", exc) from exc
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _keeps(self, stream: str, info: StreamInfo) -> None:
        """Only a stream that keeps messages by its limits can be audited: one with interest
        or work-queue retention removes a message once its consumers acknowledged it, and a
        consumed message cannot be told from a lost one (nor put back without delivering
        it to them again)."""
        retention = getattr(info.config.retention, "value", info.config.retention)
        if retention not in (None, "limits"):
            raise CannotReadBack(
                f"broker {self.name!r}: stream {stream!r} keeps a message only until its"
                f" consumers acknowledge it (retention: {retention}): an audit cannot tell a"
                " consumed message from a lost one"
            )

    def _failed(self, what: str, exc: BaseException) -> ReadBackError:
        text = (str(exc) or type(exc).__name__).removeprefix("nats: ")
        return ReadBackError(f"broker {self.name!r}: {what}: {text}")


# The relay's own headers, which an audit never reads: the CloudEvents binding's.
_NOT_READ = (b"ce-", b"content-type", b"traceparent", b"tracestate")


class _IdsOnly(Client):
    """nats-py parses every header of every message, a character at a time: nearly half of
    what reading a stream back cost. An audit needs `Nats-Msg-Id`, and the client its own
    (status, heartbeats, flow control, `Nats-Msg-Size`): the CloudEvents headers are left
    unparsed. It overrides a private method of nats-py: a test in test_nats.py fails if a
    new version stops calling it."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line or line.startswith(_NOT_READ):
                continue
            name, sep, value = line.partition(b":")
            if sep:
                key = name.strip().decode("ascii", "replace")
                out[key] = value.strip().decode("utf-8", "replace")
        return out


class _ReadingClient(_IdsOnly):
    pass


class _TlsOnlyReadingClient(_IdsOnly, TlsOnlyClient):
    pass


class _Feed:
    """What an ordered consumer delivers, handed from its callback to the read in batches.

    A callback costs a third of a fetch per message (no task, no wait per message). When the
    read falls `HELD` messages behind, the callback waits for it: the consumer's flow
    control then stops the server, so memory stays bounded."""

    def __init__(self, stream: str, only: str | None, subjects: set[str], last: int) -> None:
        self.stream, self.only, self.subjects, self.last = stream, only, subjects, last
        self.buffer: list[Stored] = []
        self.ready = asyncio.Event()  # something to hand over, or the end
        self.room = asyncio.Event()  # the read took the buffer
        self.room.set()
        self.ended = False

    async def take(self, msg: Msg) -> None:
        if self.ended:
            return
        meta = msg.metadata
        sequence = meta.sequence.stream
        if sequence > self.last:
            self._end()
            return
        if self.only is not None or msg.subject in self.subjects:
            headers = msg.headers or {}
            self.buffer.append(
                Stored(
                    headers.get("Nats-Msg-Id"),
                    msg.subject,
                    _utc(meta.timestamp) if meta.timestamp else None,
                    f"stream {self.stream} seq {sequence}",
                )
            )
            self.ready.set()
        if sequence >= self.last or meta.num_pending == 0:
            self._end()
        elif len(self.buffer) >= HELD:
            self.room.clear()
            await self.room.wait()

    async def next(self, timeout: float) -> list[Stored]:  # noqa: ASYNC109 - between messages
        """The messages delivered since the last call; TimeoutError after `timeout` s of
        nothing, before the end."""
        async with asyncio.timeout(timeout):
            await self.ready.wait()
        batch, self.buffer = self.buffer, []
        self.ready.clear()
        self.room.set()
        return batch

    def _end(self) -> None:
        self.ended = True
        self.ready.set()


def _rfc3339(stamp: str) -> datetime | None:
    """The server's time (nanoseconds, `Z`); None for its zero time, a stream never used."""
    match = re.fullmatch(r"(.+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if match is None:
        return None
    base, fraction, zone = match.groups()
    text = base + (f".{fraction[:6]}" if fraction else "") + ("+00:00" if zone == "Z" else zone)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return None if when.year <= 1 else when


def _utc(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
