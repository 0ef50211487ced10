"""Opening connections to Postgres, and the one place that classifies its driver's errors.

Every connection carries the replica's identity and timeouts of its own; no error
message carries a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import asyncpg

from relay.config import DatabaseConfig, KeepaliveConfig, RelayConfig
from relay.errors import DatabaseError
from relay.postgres.primary import (
    Host,
    address,
    ask_each,
    hosts,
    no_primary,
    server_of,
    split_brain,
    url_user,
)
from relay.redaction import redact

# How long a split-brain check's verdict (only one host answers as a primary) stands for
# new connections to that same server: lanes connecting together share one check of the
# hosts. A server restarted since, or another one, is always checked.
CHECKED_FOR = 2.0

# The one classifier of driver errors: these mean "the database went away or the
# connection broke", so the caller retries (with backoff) and never crashes. Everything
# else asyncpg raises is a statement the server refused, a bug or a misconfiguration.
CONNECTION_LOST = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,  # the server is starting or stopping
    asyncpg.InterfaceError,
    asyncpg.AdminShutdownError,
    asyncpg.InternalClientError,  # a connection left mid-operation by a cancelled statement
)

# At connect time these mean "not now" too, and are waited for like an unreachable server
# (starting up, shutting down and recovering are CannotConnectNowError, above): no
# connection slot free (max_connections, only the reserved slots left, a role's or
# database's CONNECTION LIMIT: all SQLSTATE 53300, as in a surge rollout that starts new
# replicas before the old ones have gone), or the server short of memory or disk (the rest
# of class 53). During a session, a statement refused for lack of resources is not a lost
# connection: only connecting treats them so.
NOT_NOW = (asyncpg.InsufficientResourcesError,)

# Timeouts set for the database or role are the application's, tuned to its requests: a 20 ms
# statement_timeout would cancel the relay's reads, an idle_session_timeout would close its
# listener. Its connections bring their own; each waits where it must (a lease check has its
# own deadline, in the client).
# The relay writes on every connection (checkpoints, leases, heartbeats), so a database or
# role default of read-only transactions would fail each write: its sessions say otherwise.
_OWN_SETTINGS = {
    "statement_timeout": "0",
    "lock_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "idle_session_timeout": "0",
    "default_transaction_read_only": "off",
}

# Every connection goes to the primary: a standby (in recovery) is passed over, so that a
# multi-host URL, or a DNS name that moves in a failover, finds the primary wherever it is,
# and a relay that reaches only standbys waits for a promotion instead of failing its first
# write. asyncpg asks the server's `in_hot_standby` (PostgreSQL 14+), at no extra round trip.
_PRIMARY = "primary"


class DatabaseUnavailable(DatabaseError):
    """The server cannot be reached now; worth retrying."""


class Database:
    """A connection factory; every connection is named after the replica and its role, and
    keeps its own side of TCP keepalives (`keepalives`, the lease's)."""

    def __init__(
        self,
        config: DatabaseConfig,
        identity: str,
        keepalives: KeepaliveConfig | None = None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.keepalives = keepalives or KeepaliveConfig()
        # The server the hosts were last found to have as their only primary, and when: see
        # `_one_primary`. One check at a time, so that lanes connecting together share it.
        self._sole_primary: tuple[tuple[str, str], float] | None = None
        self._checking = asyncio.Lock()

    @classmethod
    def of(cls, config: RelayConfig, identity: str) -> Database:
        """The connections a relay's config asks for: its database, its keepalives."""
        return cls(config.database, identity, config.lease.keepalives)

    async def connect(
        self, role: str, *, keepalives: KeepaliveConfig | None = None, **server_settings: str
    ) -> asyncpg.Connection:
        """A connection named `role`; `keepalives` instead of this factory's, on both sides."""
        settings = {
            "application_name": f"{self.identity}:{role}"[:63],
            **_OWN_SETTINGS,
            **server_keepalives(keepalives or self.keepalives),
            **server_settings,
        }
        try:
            conn = await asyncpg.connect(
                self.config.url.get_secret_value(),
                timeout=self.config.connect_timeout,
                server_settings=settings,
                target_session_attrs=_PRIMARY,
            )
        except asyncpg.TargetServerAttributeNotMatched:
            raise await self._no_primary() from None
        except (asyncpg.ClientConfigurationError, ValueError):
            # The driver refused the settings before connecting: no retry can fix that, so
            # this is not DatabaseUnavailable. Its text may quote a piece of the URL (and so
            # of the password), so neither it nor its traceback goes any further.
            raise DatabaseError(
                "database.url: the database driver refused the connection settings before "
                "connecting; check the URL's scheme, host and port, its query parameters "
                "(sslmode, sslnegotiation, target_session_attrs, port), that the files they "
                "name (sslrootcert, sslcert, sslkey) exist, and that reserved characters in the "
                "user or password are percent-encoded"
            ) from None
        except CONNECTION_LOST as exc:
            if len(hosts(self.config.url.get_secret_value())) > 1:
                # asyncpg names only the last host it could not reach, even when another
                # answered as a standby: say what each one is.
                raise await self._no_primary() from exc
            raise DatabaseUnavailable(
                f"cannot reach the database at {self.address}: {self._said(exc)}"
            ) from exc
        except NOT_NOW as exc:
            raise DatabaseUnavailable(
                f"the database at {self.address} {_not_now(exc)}: {self._said(exc)}"
                f" (SQLSTATE {exc.sqlstate})"
            ) from exc
        except asyncpg.PostgresError as exc:
            raise DatabaseError(
                f"the database at {self.address} refused the connection: {self._said(exc)}"
            ) from exc
        keep_alive(conn, keepalives or self.keepalives)
        return await self._one_primary(conn)

    def _said(self, exc: BaseException) -> str:
        """The driver's or the server's words, with the URL's user as `***`, as the URL
        itself is shown: the server quotes it (`role "..." does not exist`)."""
        text = driver_text(exc)
        user = url_user(self.config.url.get_secret_value())
        return text.replace(f'"{user}"', '"***"') if user else text

    async def _hosts(self) -> list[Host]:
        """What each host of the URL is now (primary.py)."""
        url = self.config.url.get_secret_value()

        async def open_any(host: str, port: int) -> asyncpg.Connection:
            return await asyncpg.connect(
                url,
                host=host,
                port=port,
                timeout=self.config.connect_timeout,
                server_settings={
                    "application_name": f"{self.identity}:probe"[:63],
                    **server_keepalives(self.keepalives),
                },
                target_session_attrs="any",
            )

        errors = (*CONNECTION_LOST, *NOT_NOW, asyncpg.PostgresError)
        return await ask_each(url, open_any, errors, driver_text)

    async def _no_primary(self) -> DatabaseUnavailable:
        """No host of the URL took the connection as the primary: say what each one is, so
        that the log names the standby waiting for promotion and the host that is down."""
        return DatabaseUnavailable(no_primary(await self._hosts()))

    async def _one_primary(self, conn: asyncpg.Connection) -> asyncpg.Connection:
        """With several hosts, `conn` (to the first primary the driver found) is used only if
        no other host answers as a primary too: after a failover, an old primary started
        again as it was would otherwise get a holder of every lane beside the fleet's."""
        if len(hosts(self.config.url.get_secret_value())) < 2:
            return conn
        try:
            server = await server_of(conn)
        except CONNECTION_LOST as exc:
            conn.terminate()
            raise DatabaseUnavailable(f"the database at {self.address} {describe(exc)}") from exc
        async with self._checking:
            known = self._sole_primary
            loop = asyncio.get_running_loop()
            if known is not None and known[0] == server and loop.time() - known[1] < CHECKED_FOR:
                return conn  # the same server, found the only primary moments ago
            why = split_brain(await self._hosts())
            self._sole_primary = None if why is not None else (server, loop.time())
        if why is None:
            return conn
        conn.terminate()
        raise DatabaseUnavailable(why)

    @property
    def address(self) -> str:
        """`host:port` (or several) of the URL, for messages: never its user or password."""
        return address(self.config.url.get_secret_value())

    @contextlib.asynccontextmanager
    async def one_shot(self, role: str) -> AsyncIterator[asyncpg.Connection]:
        """One connection for a one-shot command; a driver error inside becomes one
        DatabaseError line (the CLI never prints a driver's traceback): DatabaseUnavailable
        when the connection was lost, which a command that refreshes may wait out."""
        conn = await self.connect(role)
        try:
            yield conn
        except CONNECTION_LOST as exc:
            raise DatabaseUnavailable(describe(exc)) from exc
        except asyncpg.PostgresError as exc:
            raise DatabaseError(describe(exc)) from exc
        finally:
            try:
                await asyncio.wait_for(conn.close(), timeout=2)
            except (OSError, TimeoutError, asyncpg.InterfaceError):
                conn.terminate()


class KeptConnection:
    """One connection kept between uses, for reads repeated every second or so (the status
    page's): a connection each time cost a backend's start-up per read. Opened on first use,
    and again after one failed or was cancelled (its state is then unknown); one use at a
    time; driver errors translated as `one_shot` does."""

    def __init__(self, db: Database, role: str) -> None:
        self._db, self._role = db, role
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._lock:
            if self._conn is None or self._conn.is_closed():
                self._conn = await self._db.connect(self._role)
            conn, done = self._conn, False
            try:
                yield conn
                done = True
            except CONNECTION_LOST as exc:
                raise DatabaseUnavailable(describe(exc)) from exc
            except asyncpg.PostgresError as exc:
                raise DatabaseError(describe(exc)) from exc
            finally:
                if not done:
                    self._conn = None
                    conn.terminate()

    async def close(self) -> None:
        async with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await asyncio.wait_for(conn.close(), timeout=2)
            except (OSError, TimeoutError, asyncpg.InterfaceError):
                conn.terminate()


def server_keepalives(k: KeepaliveConfig) -> dict[str, str]:
    """Postgres's side of the keepalives, for every session the relay opens: it ends the
    backend of a relay whose path died, instead of keeping its slot (and its locks) for
    the server's default two hours."""
    return {
        "tcp_keepalives_idle": str(int(k.idle)),
        "tcp_keepalives_interval": str(int(k.interval)),
        "tcp_keepalives_count": str(k.count),
        "tcp_user_timeout": str(int(k.dead_after * 1000)),
    }


def keep_alive(conn: asyncpg.Connection, keepalives: KeepaliveConfig) -> None:
    """The relay's side of TCP keepalives, which asyncpg does not set (asyncpg #606).

    Without them a statement whose path dies (a failover that takes the old primary's
    address away, a firewall or NAT that forgets the flow) waits until the kernel gives up
    on its retransmissions, about 15 minutes, while the lease, on another connection, still
    proves itself: the lane stalls and `status` says relaying. With them the statement fails
    after `dead_after` seconds, as a lost connection, and the caller reconnects. A live
    server's kernel answers the probes, so a statement that is merely slow is not cut.
    A unix socket has no path to lose.
    """
    transport = getattr(conn, "_transport", None)  # asyncpg has no public way to its socket
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None or sock.family not in {socket.AF_INET, socket.AF_INET6}:
        return
    for level, name, value in (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", int(keepalives.idle)),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", int(keepalives.interval)),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", keepalives.count),
        # Also bounds data sent and never acknowledged (a request into a dead path).
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", int(keepalives.dead_after * 1000)),
    ):
        option = getattr(socket, name, None)  # Linux has them all; other systems some
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(level, option, value)


def describe(exc: BaseException) -> str:
    """One line for a driver error that ended a command: what failed, and where to look."""
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return (
            f"the database refused the command: {driver_text(exc)} (`relay check` lists every right"
            " the relay needs, with the GRANT that gives it)"
        )
    if isinstance(exc, CONNECTION_LOST):
        return f"lost the connection to the database: {driver_text(exc)}"
    return f"the database failed the command: {driver_text(exc)}"


def _not_now(exc: asyncpg.PostgresError) -> str:
    if isinstance(exc, asyncpg.TooManyConnectionsError):
        return "has no connection slot free for the relay now"
    return "is short of resources now"


def driver_text(exc: BaseException) -> str:
    """The driver's or the server's words, redacted; in plain words where the driver's are
    its own internals."""
    if isinstance(exc, asyncpg.InternalClientError):
        # asyncpg's "cannot switch to state 12; another operation (2) is in progress": its
        # protocol is still reading the server's last messages. Most often the server has
        # just ended the session (pg_terminate_backend, a restart, idle_session_timeout:
        # asyncpg says so in about 6 statements of 10 sent between the server's last words
        # and the socket's close); else a statement was cancelled part way.
        return (
            "the connection was still taking in the server's last messages (the server had"
            " just ended the session, or a statement was cancelled part way): it is dropped"
        )
    return redact(str(exc)) or type(exc).__name__


def too_old(conn: asyncpg.Connection) -> str | None:
    """Why this server cannot run the relay (older than PostgreSQL 14), else None."""
    version = conn.get_server_version()
    if version.major >= 14:
        return None
    return (
        f"PostgreSQL {version.major} is too old: the relay needs 14 or newer"
        " (client_connection_check_interval frees a dead holder's lease)"
    )


def is_lost_reply(context: dict[str, object]) -> bool:
    """Whether asyncio's report of an unretrieved error is asyncpg's reply waiter, failed by
    the connection's loss after its caller had given up (a statement timed out or was
    cancelled, then the connection dropped). The caller already saw its own error and
    handled it; nothing else can retrieve this one."""
    exc = context.get("exception")
    return (
        context.get("message") == "Future exception was never retrieved"
        and isinstance(exc, ConnectionError)
        and str(exc) == "unexpected connection_lost() call"  # asyncpg's coreproto
    ) or isinstance(exc, asyncpg.ConnectionDoesNotExistError)
