"""NATS JetStream publisher.

Messages are written to the socket in order and all of a batch's PubAcks are
awaited together, so a batch costs about one round trip. The message id goes
in `Nats-Msg-Id`, so JetStream drops a re-sent message within the stream's
duplicate window; a PubAck marked duplicate counts as published.

The client does not reconnect by itself: a lost connection fails the batch
as transient, and the outbox's backoff decides when to connect again. That
keeps one retry policy, visible in `status`, for every broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from relay.config import NatsBrokerConfig
from relay.errors import PermanentPublishError, PublishError, TransientPublishError
from relay.publishing import Message, Outcome

# JetStream API error codes that no retry can fix.
_PERMANENT_CODES = {
    10054,  # message size exceeds the stream's maximum
}


class NatsPublisher:
    def __init__(self, name: str, config: NatsBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self.duplicates = 0

    async def connect(self) -> None:
        if self._nc is not None and self._nc.is_connected:
            return
        await self.close()
        c = self._config
        options: dict[str, Any] = {
            "servers": c.servers,
            "connect_timeout": c.connect_timeout,
            "allow_reconnect": False,
            # Give up on a server after one retry; the outbox's backoff decides when to
            # try again (nats-py would otherwise try 60 times, 2 s apart, per connect).
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0.1,
            "error_cb": _ignore,
            "name": "outbox-relay",
        }
        if c.user:
            options["user"] = c.user
        if c.password:
            options["password"] = c.password.get_secret_value()
        if c.token:
            options["token"] = c.token.get_secret_value()
        if c.creds_file:
            options["user_credentials"] = c.creds_file
        if c.tls:
            options["tls"] = _tls_context(c)
        nc = Client()
        try:
            await nc.connect(**options)
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            _drop_transport(nc)
            raise TransientPublishError(
                f"broker {self.name!r}: cannot connect: {_text(exc)}"
            ) from exc
        self._nc, self._js = nc, nc.jetstream(timeout=c.ack_timeout)
        try:
            # One API round trip: proves JetStream is on, and sets up reply
            # subscriptions before the first batch so its order is kept.
            await self._js.account_info()
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            await self.close()
            raise TransientPublishError(
                f"broker {self.name!r}: JetStream unavailable: {_text(exc)}"
            ) from exc

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        try:
            await self.connect()
        except TransientPublishError as exc:
            return [exc] * len(messages)
        assert self._js is not None
        futures: list[asyncio.Future[Any]] = []
        outcomes: list[Outcome] = []
        for message in messages:
            try:
                futures.append(
                    await self._js.publish_async(
                        message.destination, message.body, headers=_headers(message)
                    )
                )
            except Exception as exc:
                outcomes = [None] * len(futures) + [self._classify(exc)]
                break
        results = await self._acks(futures)
        if outcomes:
            failed = outcomes[-1]
            not_sent = TransientPublishError("not sent: an earlier message of the batch failed")
            return results + [failed] + [not_sent] * (len(messages) - len(results) - 1)
        return results

    async def _acks(self, futures: list[asyncio.Future[Any]]) -> list[Outcome]:
        if not futures:
            return []
        _, pending = await asyncio.wait(futures, timeout=self._config.ack_timeout)
        for future in pending:
            future.cancel()
        outcomes: list[Outcome] = []
        for future in futures:
            if future in pending:
                outcomes.append(
                    TransientPublishError(f"no PubAck within {self._config.ack_timeout}s")
                )
            elif (exc := future.exception()) is not None:
                outcomes.append(self._classify(exc))
            else:
                outcomes.append(None)
                self.duplicates += bool(future.result().duplicate)
        if pending and self._nc is not None and not self._nc.is_connected:
            await self.close()
        return outcomes

    def _classify(self, exc: BaseException) -> PublishError:
        text = f"broker {self.name!r}: {_text(exc)}"
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PermanentPublishError(f"{text}: message larger than the server's max_payload")
        if isinstance(exc, nats.errors.BadSubjectError):
            return PermanentPublishError(f"{text}: invalid subject")
        if isinstance(exc, nats.js.errors.APIError) and exc.err_code in _PERMANENT_CODES:
            return PermanentPublishError(text)
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            return TransientPublishError(f"{text}: no stream captures this subject")
        return TransientPublishError(text)

    async def close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()


def _headers(message: Message) -> dict[str, str]:
    """CloudEvents NATS binding (binary mode), plus JetStream's dedup id."""
    headers = {
        "Nats-Msg-Id": message.id,
        "ce-specversion": "1.0",
        "ce-id": message.id,
        "ce-type": message.type,
        "ce-source": message.source,
        "ce-partitionkey": message.key,
        "content-type": message.content_type,
    }
    if message.time is not None:
        headers["ce-time"] = message.time.isoformat()
    return headers


def _tls_context(config: NatsBrokerConfig) -> ssl.SSLContext:
    assert config.tls is not None
    context = ssl.create_default_context(
        cafile=str(config.tls.ca_file) if config.tls.ca_file else None
    )
    if config.tls.cert_file:
        context.load_cert_chain(
            str(config.tls.cert_file), str(config.tls.key_file) if config.tls.key_file else None
        )
    return context


def _drop_transport(nc: Client) -> None:
    """nats-py leaves the socket open when the handshake times out (a silent server)."""
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def _text(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).removeprefix("nats: ")


async def _ignore(exc: Exception) -> None:
    """Connection errors surface as failed batches; nats-py need not print them."""
