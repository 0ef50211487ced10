"""Opening connections to Postgres, with the replica's identity and no secrets in errors."""

from __future__ import annotations

import asyncpg

from relay.config import DatabaseConfig
from relay.errors import DatabaseError
from relay.redaction import redact

_UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
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
        except _UNREACHABLE as exc:
            raise DatabaseUnavailable(f"cannot reach the database: {redact(str(exc))}") from exc
        except asyncpg.PostgresError as exc:
            raise DatabaseError(f"the database refused the connection: {redact(str(exc))}") from exc
