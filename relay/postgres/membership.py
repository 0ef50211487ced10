"""Which replicas are alive, from Postgres: one heartbeat row each, tied to its lease session.

A replica counts while its row is fresh (by the database clock) and the session that
wrote it still exists: a killed replica drops out the moment Postgres closes its
session, a paused one once its row is older than `takeover_after`. Rows are per lease
namespace, so two deployments sharing a database do not share their fair share.
"""

from __future__ import annotations

import asyncpg

from relay.postgres.sql import quote


class Membership:
    def __init__(self, schema: str, namespace: str, identity: str) -> None:
        self.table = f"{quote(schema)}.replicas"
        self.namespace = namespace
        self.identity = identity
        self.left = False  # once leaving, a late pass must not say it is alive again
        # $1 identity, $2 namespace, $3 seconds after which a silent replica is not counted
        self._count = (
            f"SELECT 1 + count(*) FROM {self.table} r WHERE r.namespace = $2"
            " AND r.identity <> $1 AND r.seen_at > now() - make_interval(secs => $3)"
            " AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid"
            " AND a.datname = current_database())"
        )
        self._beat = (
            f"WITH me AS (INSERT INTO {self.table} (identity, namespace, pid, seen_at)"
            " VALUES ($1, $2, pg_backend_pid(), now()) ON CONFLICT (identity) DO UPDATE"
            " SET namespace = excluded.namespace, pid = excluded.pid, seen_at = now()),"
            f" gone AS (DELETE FROM {self.table} WHERE seen_at < now() - interval '1 day')"
            f" {self._count}"
        )

    async def beat(self, conn: asyncpg.Connection, stale_after: float) -> int:
        """Say this replica is alive (on its lease session); return how many are."""
        query = self._count if self.left else self._beat
        return int(await conn.fetchval(query, self.identity, self.namespace, stale_after))

    async def leave(self, conn: asyncpg.Connection) -> None:
        """A graceful stop: the others may take this replica's share at once."""
        self.left = True
        await conn.execute(f"DELETE FROM {self.table} WHERE identity = $1", self.identity)
