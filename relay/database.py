"""Opening connections to Postgres, with the replica's identity and no secrets in errors."""

from __future__ import annotations

import asyncpg

from relay.config import DatabaseConfig
from relay.errors import DatabaseError
from relay.logs import redact

_UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
)


class DatabaseUnavailable(DatabaseError):
    """The server cannot be reached now; worth retrying."""


class Database:
    """A connection factory; every connection is named after the replica and its role."""

    def __init__(self, config: DatabaseConfig, identity: str) -> None:
        self.config = config
        self.identity = identity

    async def connect(self, role: str, **server_settings: str) -> asyncpg.Connection:
        settings = {"application_name": f"{self.identity}:{role}"[:63], **server_settings}
        try:
            return await asyncpg.connect(
                self.config.url.get_secret_value(),
                timeout=self.config.connect_timeout,
                server_settings=settings,
            )
        except _UNREACHABLE as exc:
            raise DatabaseUnavailable(f"cannot reach the database: {redact(str(exc))}") from exc
        except asyncpg.PostgresError as exc:
            raise DatabaseError(f"the database refused the connection: {redact(str(exc))}") from exc
        except ValueError as exc:  # asyncpg's DSN parser
            raise DatabaseError(
                f"database.url: invalid connection URL: {redact(str(exc))}"
            ) from exc
