"""Reading JetStream back for an audit: an ephemeral pull consumer per stream.

Each destination subject is looked up in the stream that captures it; each stream is read
once, from the audit's start time (`deliver_policy: by_start_time`), headers only (the id
is in `Nats-Msg-Id`, in both CloudEvents modes), without acknowledgements, up to the last
message stored when the read began. The consumer is ephemeral (the server deletes it 30 s
after the audit stops asking) and takes nothing from any other consumer. Core NATS
(`jetstream: false`) keeps nothing, and cannot be read back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamInfo

from relay.brokers.nats import captures, open_connection
from relay.config.brokers import NatsBrokerConfig
from relay.core.readback import Horizon, Stored
from relay.errors import CannotReadBack, ReadBackError, TransientPublishError

READ_TIMEOUT = 10.0  # seconds a read waits for the next messages the stream said it holds
FETCH = 1_000  # messages asked for at a time
INACTIVE_AFTER = 30.0  # the server deletes the audit's consumer if the audit went away


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
        if self._nc is not None and self._nc.is_connected:
            return
        try:
            self._nc = await open_connection(self.name, self._config)
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
        js = self._jetstream()
        info = await self._found(stream)
        if info is None or not info.state.messages:
            return
        last = info.state.last_seq
        # One subject: the server filters; several: the whole stream, filtered here (a
        # consumer takes one filter subject before nats-server 2.10).
        only = next(iter(subjects)) if len(subjects) == 1 else None
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
            opt_start_time=None if since is None else since.astimezone(UTC),
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            inactive_threshold=INACTIVE_AFTER,
        )
        try:
            sub = await js.pull_subscribe(only or ">", stream=stream, config=config)
            if (await sub.consumer_info()).num_pending == 0:
                await sub.unsubscribe()
                return
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            raise self._failed(f"cannot read stream {stream!r}", exc) from exc
        try:
            while True:
                try:
                    batch = await sub.fetch(FETCH, timeout=READ_TIMEOUT)
                except (OSError, TimeoutError, nats.errors.Error) as exc:
                    raise self._failed(f"reading stream {stream!r} stopped", exc) from exc
                for msg in batch:
                    meta = msg.metadata
                    sequence = meta.sequence.stream
                    if sequence > last:
                        return
                    if only is not None or msg.subject in subjects:
                        headers = msg.headers or {}
                        yield Stored(
                            headers.get("Nats-Msg-Id"),
                            msg.subject,
                            _utc(meta.timestamp) if meta.timestamp else None,
                            f"stream {stream} seq {sequence}",
                        )
                    if sequence >= last or meta.num_pending == 0:
                        return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _failed(self, what: str, exc: BaseException) -> ReadBackError:
        text = (str(exc) or type(exc).__name__).removeprefix("nats: ")
        return ReadBackError(f"broker {self.name!r}: {what}: {text}")


def _utc(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)
