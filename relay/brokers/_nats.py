"""NATS connections, as the publisher and the audit's reader open them: authenticated,
never reconnecting by themselves (the caller's backoff decides when), and with TLS only
ever to a server that requires it."""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client

from relay.config.base import TlsConfig
from relay.config.brokers import NatsBrokerConfig
from relay.errors import TransientPublishError


async def open_connection(
    name: str,
    config: NatsBrokerConfig,
    clients: tuple[type[Client], type[Client]] | None = None,
) -> Client:
    """A connection to broker `name`, authenticated, that never reconnects by itself;
    TransientPublishError when refused or unreachable. The publisher's and the audit's;
    `clients`: the client classes to use without and with TLS (the second must refuse a
    server without TLS, as TlsOnlyClient does)."""
    c = config
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
        # publish() checks each subject with a stricter rule of its own.
        "skip_subject_validation": True,
    }
    if c.user:
        options["user"] = c.user
    if c.password:
        options["password"] = c.password.get_secret_value()
    if c.token:
        options["token"] = c.token.get_secret_value()
    if c.creds_file:
        options["user_credentials"] = c.creds_file
    tls = c.tls is not None or any(urlsplit(url).scheme == "tls" for url in c.servers)
    if tls:
        options["tls"] = (c.tls or TlsConfig()).context()
    plain, secure = clients or (Client, TlsOnlyClient)
    nc = secure() if tls else plain()
    try:
        await nc.connect(**options)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        _drop_transport(nc)
        raise TransientPublishError(f"broker {name!r}: cannot connect: {text_of(exc)}") from exc
    return nc


class TlsOnlyClient(Client):
    """A nats-py client that sends CONNECT only over TLS.

    nats-py upgrades to TLS only when the server's INFO says `tls_required`; any other
    server gets CONNECT, credentials included, in cleartext, even from a tls:// URL.
    `_connect_command` runs after INFO is read and any upgrade is done, just before CONNECT
    is written: raising there sends nothing. It is private to nats-py; the test of a
    server without TLS fails if a new version stops calling it.
    """

    def _connect_command(self) -> bytes:
        assert self._current_server is not None  # set before the INFO was read
        if not self._server_info.get("tls_required"):
            uri = self._current_server.uri
            raise _NoTlsError(
                f"server {uri.hostname}:{uri.port} does not require TLS;"
                " refusing to send credentials in cleartext"
            )
        return super()._connect_command()


class _NoTlsError(nats.errors.Error):
    """A nats-py error, so that connect() fails the way it does for any refused server."""


def _drop_transport(nc: Client) -> None:
    """nats-py leaves the socket open when the handshake times out (a silent server)."""
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def text_of(exc: BaseException) -> str:
    """nats-py's error in one line, without its `nats: ` prefix."""
    return (str(exc) or type(exc).__name__).removeprefix("nats: ")


async def _ignore(exc: Exception) -> None:
    """Connection errors surface as failed batches; nats-py need not print them."""
