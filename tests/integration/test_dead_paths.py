"""A connection whose network path dies under it, in the kernel (tests/support/dead_path.py).

A lane's reads go on a connection of their own, beside the lease session that proves the
lane is held. When only the reader's path dies (a firewall or NAT that forgets the flow,
a route gone), the lease keeps proving itself, so nothing but the reader's own socket can
notice. asyncpg sets no TCP keepalive and no user timeout: the read waited for the
kernel's retransmissions to give up, about 15 minutes, with the lane stalled and `relay
status` saying relaying. (A black-box attack found it with a proxy that stopped
forwarding.) The relay now sets its side of TCP keepalives on every connection.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relay.config import DatabaseConfig, KeepaliveConfig
from relay.postgres.database import Database
from tests.support import postgres
from tests.support.db import append_many, connect
from tests.support.dead_path import DeadPath
from tests.support.delivery import append_backlog, book_lent, event_id, wait_for_checkpoint
from tests.support.lanes import delivered
from tests.support.relay_process import RelayProcess
from tests.support.scenario import (
    config_dict,
    eventually,
    migrate_cli,
    save,
    standing_by_through,
)

pytestmark = pytest.mark.timeout(120)

Start = Callable[..., RelayProcess]


async def port_of(dsn: str, path: DeadPath, role: str, name: str | None = None) -> int:
    """The relay's own port of its one connection of `role` (reader, lease, listener)
    through `path` (of the session whose name is LIKE `name`, if given)."""
    found: list[int] = []

    async def just_one() -> bool:
        async with connect(dsn) as conn:
            rows = await conn.fetch(
                "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE '%:' || $1"
                " AND ($2::text IS NULL OR application_name LIKE $2)",
                role,
                name,
            )
        ports = [path.client_port(r["client_port"]) for r in rows]
        found[:] = [p for p in ports if p is not None]
        return len(found) == 1

    await eventually(just_one, timeout=30)
    return found[0]


async def relaying(
    tmp_path: Path, data: dict[str, Any], relay_process: Start, dsn: str
) -> tuple[RelayProcess, set[str]]:
    """A relay of `data` running, and the ids of a first backlog it is to deliver."""
    config = save(tmp_path, data)
    migrate_cli(config)
    relay = relay_process(["run", "--config", str(config)])
    first = await append_backlog(dsn, 20, aggregates=4)
    return relay, set(first.values())


async def written_later(dsn: str) -> tuple[int, set[str]]:
    """Twenty events of new books: the last position, and their ids."""
    later = [book_lent(f"later-{i}", 1) for i in range(20)]
    async with connect(dsn) as conn:
        positions = await append_many(conn, later)
    return positions[-1], {event_id(e.aggregate_id, 1) for e in later}


async def test_a_lane_whose_reader_path_dies_reconnects_and_delivers_while_its_lease_holds(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    with DeadPath(*postgres.address(events_table)) as path:
        data = config_dict(
            postgres.with_address(events_table, path.host, path.port), nats_url, stream
        )
        relay, first = await relaying(tmp_path, data, relay_process, events_table)
        await delivered(nats_url, stream, first)

        path.kill(await port_of(events_table, path, "reader"))
        _, later = await written_later(events_table)

        await delivered(nats_url, stream, first | later)
        assert relay.returncode is None
        logs = relay.logs()
        assert not [r for r in logs if str(r.get("event", "")).startswith("lease lost")], (
            "the lease, on a live path, held: the reader noticed its own dead path"
        )


async def test_a_lone_replica_whose_lease_path_dies_ends_its_own_orphaned_session(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    """Its lease lost, the replica connects again, but the old session lives on behind the
    proxy (which answers Postgres's keepalives) and holds the lane's lock. Judged by its
    identity, that session was the replica's own: it stood by "for itself" for good. A lost
    session is judged like any other holder, and ended once silent for takeover_after."""
    with DeadPath(*postgres.address(events_table)) as path:
        url = postgres.with_address(events_table, path.host, path.port)
        data = config_dict(url, nats_url, stream)
        data["lease"] = {
            "check_interval": "500ms",
            "check_timeout": "500ms",
            "takeover_after": "2s",
        }
        relay, first = await relaying(tmp_path, data, relay_process, events_table)
        await delivered(nats_url, stream, first)

        path.kill(await port_of(events_table, path, "lease"))
        last, later = await written_later(events_table)

        # The checkpoint is written on the lease connection: it moves only once a live
        # session holds the lane again.
        await wait_for_checkpoint(events_table, "loans", last, timeout=60)
        await delivered(nats_url, stream, first | later)
        assert relay.returncode is None
        ended = [r for r in relay.logs() if r.get("event") == "silent holder's session terminated"]
        assert ended, "the orphaned session was ended by the replica itself"


async def test_every_connection_keeps_tcp_keepalives_on_both_sides(events_table: str) -> None:
    """What the kernel is told, on a real connection: probes after `idle`, every
    `interval`, `count` of them, and data unacknowledged for as long fails it too."""
    keepalives = KeepaliveConfig(idle=7, interval=3, count=4)
    db = Database(DatabaseConfig(url=events_table), "relay:test:1", keepalives)
    conn = await db.connect("reader")
    try:
        sock = conn._transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 19_000
        # And Postgres's side: it ends the backend of a relay whose path died (a reader left
        # behind kept its connection slot for hours, until the kernel's defaults gave up).
        shown = [
            await conn.fetchval(f"SHOW {name}")
            for name in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
        ]
        assert shown == ["7", "3", "4"]
        assert await conn.fetchval("SHOW tcp_user_timeout") in {"19000", "19s"}
    finally:
        await conn.close()


async def test_a_standbys_lease_session_left_behind_a_dead_path_is_ended_by_postgres(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    """A standby holds no lock, so no one judges its lease session. When its path dies, the
    standby connects again, but the old session lives on behind the proxy, whose side
    answers Postgres's keepalives: it kept its connection slot for good, one more at each
    such cut, until the role's connection limit left the relay none. Postgres itself ends a
    lease session that has said nothing for `lease.orphan_after`: twice takeover_after."""
    lease = {"check_interval": "500ms", "check_timeout": "500ms", "takeover_after": "2s"}
    direct = config_dict(events_table, nats_url, stream)
    direct["lease"] = lease
    holder, first = await relaying(tmp_path, direct, relay_process, events_table)
    await delivered(nats_url, stream, first)
    with DeadPath(*postgres.address(events_table)) as path:
        standby = await standing_by_through(
            (path.host, path.port),
            events_table,
            nats_url=nats_url,
            stream=stream,
            tmp_path=tmp_path,
            start=relay_process,
            lease=lease,
        )
        name = f"%:{standby.pid}:lease"

        async def sessions() -> set[int]:
            async with connect(events_table) as conn:
                rows = await conn.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1", name
                )
            return {r["pid"] for r in rows}

        (left,) = await sessions()
        path.kill(await port_of(events_table, path, "lease", name))

        async def the_left_one_ended_and_another_took_its_place() -> bool:
            now = await sessions()
            return left not in now and len(now) == 1

        await eventually(the_left_one_ended_and_another_took_its_place, timeout=40)
        assert standby.returncode is None
        assert holder.returncode is None
