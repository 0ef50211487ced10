"""Two ways a replica's lanes went unrelayed for good (a black-box attack found both).

A standby whose lease connection runs through a proxy that stops forwarding but keeps its
sockets open: the proxy's kernel acknowledges every packet, so no keepalive fails, and
with no lock held no proof watches the session. Its look at the lanes waited for an
answer for good; it stayed Ready and said nothing while the lane had no holder.

A holder fenced by its lane's row (the epoch moved on: two deployments of other
`lease.namespace`s on one schema fence each other, or an operator's UPDATE): it said the
lease was lost but kept the lock, and stood by for itself for as long as its session lived.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import postgres, scenario
from tests.support.db import connect
from tests.support.delivery import append_backlog
from tests.support.lanes import delivered
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess
from tests.support.scenario import config_dict, eventually, migrate_cli, save

pytestmark = pytest.mark.timeout(120)

Start = Callable[..., RelayProcess]
LEASE = {"check_interval": "500ms", "check_timeout": "500ms", "takeover_after": "2s"}


async def test_a_standby_behind_a_half_open_path_takes_over_when_the_holder_leaves(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    direct = config_dict(events_table, nats_url, stream)
    direct["lease"] = LEASE
    config = save(tmp_path, direct, "direct.yaml")
    migrate_cli(config)
    holder = relay_process(["run", "--config", str(config)])
    first = set((await append_backlog(events_table, 40, 8, "first")).values())
    await delivered(nats_url, stream, first)
    with TcpProxy(*postgres.address(events_table)) as proxy:
        standby = await scenario.standing_by_through(
            proxy.address,
            events_table,
            nats_url=nats_url,
            stream=stream,
            tmp_path=tmp_path,
            start=relay_process,
            lease=LEASE,
        )
        async with connect(events_table) as conn:
            port = await conn.fetchval(
                "SELECT client_port FROM pg_stat_activity WHERE application_name LIKE $1",
                f"%:{standby.pid}:lease",
            )
        assert proxy.hold(port), "the standby's lease connection goes half-open"
        holder.terminate()
        assert await holder.wait_async() == 0
        later = set((await append_backlog(events_table, 40, 8, "later")).values())
        await delivered(nats_url, stream, first | later)
        assert standby.returncode is None


async def test_a_holder_fenced_by_its_lanes_row_lets_the_lock_go_and_relays_again(
    events_table: str, nats_url: str, stream: str, tmp_path: Path, relay_process: Start
) -> None:
    data = config_dict(events_table, nats_url, stream, partitions=2)
    data["lease"] = LEASE
    config = save(tmp_path, data)
    migrate_cli(config)
    replica = relay_process(["run", "--config", str(config)])
    first = set((await append_backlog(events_table, 40, 8, "first")).values())
    await delivered(nats_url, stream, first)
    async with connect(events_table) as conn:
        await conn.execute(
            "UPDATE relay.checkpoints SET epoch = epoch + 1 WHERE outbox = 'loans/0'"
        )
    later = set((await append_backlog(events_table, 40, 8, "later")).values())

    async def fenced() -> bool:
        return any("matched no row" in str(r.get("reason", "")) for r in replica.logs())

    await eventually(fenced, timeout=30)
    last = set((await append_backlog(events_table, 40, 8, "last")).values())  # after the fence
    await delivered(nats_url, stream, first | later | last)
    assert replica.returncode is None
