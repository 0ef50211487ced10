"""Opening connections to Postgres, and the one place that classifies its driver's errors.

Every connection carries the replica's identity and timeouts of its own; no error
message carries a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg

from relay.config import DatabaseConfig
from relay.errors import DatabaseError
from relay.redaction import redact

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


# Timeouts set for the database or role are the application's, tuned to its requests: a 20 ms
# statement_timeout would cancel the relay's reads, an idle_session_timeout would close its
# listener. Its connections bring their own; each waits where it must (a lease check has its
# own deadline, in the client).
_OWN_TIMEOUTS = {
    "statement_timeout": "0",
    "lock_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "idle_session_timeout": "0",
}


class DatabaseUnavailable(DatabaseError):
    """The server cannot be reached now; worth retrying."""


class Database:
    """A connection factory; every connection is named after the replica and its role."""

    def __init__(self, config: DatabaseConfig, identity: str) -> None:
        self.config = config
        self.identity = identity

    async def connect(self, role: str, **server_settings: str) -> asyncpg.Connection:
        settings = {
            "application_name": f"{self.identity}:{role}"[:63],
            **_OWN_TIMEOUTS,
            **server_settings,
        }
        try:
            return await asyncpg.connect(
                self.config.url.get_secret_value(),
                timeout=self.config.connect_timeout,
                server_settings=settings,
            )
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
            raise DatabaseUnavailable(f"cannot reach the database: {redact(str(exc))}") from exc
        except asyncpg.PostgresError as exc:
            raise DatabaseError(f"the database refused the connection: {redact(str(exc))}") from exc

    @contextlib.asynccontextmanager
    async def session(self, role: str) -> AsyncIterator[asyncpg.Connection]:
        """One connection for a one-shot command; a driver error inside becomes one
        DatabaseError line (the CLI never prints a driver's traceback)."""
        conn = await self.connect(role)
        try:
            yield conn
        except (asyncpg.PostgresError, *CONNECTION_LOST) as exc:
            raise DatabaseError(f"the database failed the command: {redact(str(exc))}") from exc
        finally:
            try:
                await asyncio.wait_for(conn.close(), timeout=2)
            except (OSError, TimeoutError, asyncpg.InterfaceError):
                conn.terminate()
