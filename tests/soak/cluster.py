"""The soak's private world: a Postgres it can crash or fail over, replicas behind proxies.

Nothing here touches the machine's shared services: the Postgres cluster, the broker and
every relay process belong to the soak, and each replica reaches the database through a
TCP proxy of its own, so one replica's link can be black-holed or cut on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from relay.demo.embedded import EmbeddedPostgres
from tests.support import postgres
from tests.support.config import write_config
from tests.support.dead_path import DeadPath
from tests.support.postgres import EVENTS_SQL, address, with_address, with_database
from tests.support.proxy import TcpProxy
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.replication import PRIMARY_SETTINGS, promote, stream_from
from tests.support.scenario import eventually

DATABASE = "soak"
OUTBOX = "soak"
SIDE = "side"  # an outbox of nothing: added to, or left alone in, a replica's config
# The outbox's one checkpoint, or one per lane (`soak/0`, ...) when split; with when its
# partition count last changed, since a change starts the new lanes afresh.
CHECKPOINTS = (
    "SELECT c.outbox, c.position, o.updated_at FROM relay.checkpoints c"
    " LEFT JOIN relay.outboxes o ON o.outbox = $1"
    " WHERE c.outbox = $1 OR c.outbox LIKE $1 || '/%'"
)
# The outbox's partition count as it runs (its config's before the first claim).
RECORDED = "SELECT partitions FROM relay.outboxes WHERE outbox = $1"

# Fast enough to see many faults in a short run, within the relay's own rules:
# check_interval + check_timeout < keepalive budget (1 + 1 x 2 = 3 s), < takeover_after.
LEASE = {
    "retry_interval": "250ms",
    "check_interval": "500ms",
    "check_timeout": "500ms",
    "takeover_after": "2s",
    "keepalives": {
        "idle": "1s",
        "interval": "1s",
        "count": 2,
        "connection_check_interval": "500ms",
    },
}
TAKEOVER_AFTER = 2.0
# The continuous audit, fast: a window once 3 s old (a LOSE fault deletes a message stored
# within the last second, before any round can have read it), a round every second.
AUDIT = {"enabled": True, "delay": "3s", "every": "1s", "clock_skew": "5s"}
# Where the audit has read the broker back to, and the messages it found missing, by id.
AUDITED = "SELECT position FROM relay.audits WHERE outbox = $1"

_COLUMNS = """
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  version        bigint      NOT NULL,
  type           text        NOT NULL,
  payload        jsonb       NOT NULL,
  metadata       jsonb       NOT NULL DEFAULT '{}',
  created_at     timestamptz NOT NULL DEFAULT now()"""
EVENTS = EVENTS_SQL.read_text()  # the example table, as applications have it
# Partitioned by time, as archives are; writers also insert into `events_live` directly.
PARTITIONED_EVENTS = f"""
CREATE TABLE events (position bigserial, {_COLUMNS}) PARTITION BY RANGE (created_at);
CREATE TABLE events_archive PARTITION OF events FOR VALUES FROM (MINVALUE) TO ('2000-01-01');
CREATE TABLE events_live PARTITION OF events FOR VALUES FROM ('2000-01-01') TO (MAXVALUE);
"""


class Database:
    """The soak's own Postgres: crashed with an immediate stop, then started again.

    With `standby`, a second server streams from it (asynchronously, through a proxy that a
    failover freezes first), and `failover` kills the primary and promotes the standby, as
    Patroni would; the old primary then rejoins as the new one's standby. `dsn` always names
    the current primary.
    """

    def __init__(self, *, standby: bool = False) -> None:
        # fsync off: the soak crashes the server process, never the machine, so the OS keeps
        # every write a commit returned for; max_prepared_transactions for two-phase writers.
        settings = {"max_prepared_transactions": "64", "fsync": "off"}
        if standby:
            settings |= PRIMARY_SETTINGS
        self.servers = [postgres.server(settings) for _ in range(2 if standby else 1)]
        self.primary = 0  # which of `servers` takes writes now
        self.link: TcpProxy | None = None  # the standby's replication stream
        self.failovers = 0  # how many times the primary has moved
        # From a failover's start to its end (wall clock): commits acknowledged then may be
        # gone from the new primary; any acknowledged earlier were on the standby.
        self.unreplicated: list[tuple[float, float]] = []
        self.admin_dsn = ""
        self.dsn = ""

    async def start(self, partitioned: bool) -> None:
        self.admin_dsn = await asyncio.to_thread(self.servers[0].start)
        self.dsn = with_database(self.admin_dsn, DATABASE)
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await conn.execute(f"CREATE DATABASE {DATABASE}")
        finally:
            await conn.close()
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(PARTITIONED_EVENTS if partitioned else EVENTS)
        finally:
            await conn.close()
        if self.standby is not None:
            await asyncio.to_thread(self._follow, self.standby)

    @property
    def standby(self) -> EmbeddedPostgres | None:
        return self.servers[1 - self.primary] if len(self.servers) > 1 else None

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every server's host and port, in a fixed order (a replica's URL lists them all)."""
        return [address(server.dsn) for server in self.servers]

    async def crash(self) -> None:
        await asyncio.to_thread(self.servers[self.primary].halt, "immediate")

    async def restart(self) -> None:
        await asyncio.to_thread(self.servers[self.primary].resume)

    async def failover(self, frozen: float) -> str:
        """Wait for the standby to catch up, freeze replication for `frozen` seconds while
        writers commit, kill the primary, promote the standby, and rebuild the old primary
        as its standby."""
        old, new, link = self.servers[self.primary], self.standby, self.link
        assert new is not None and link is not None, "a failover needs Database(standby=True)"
        since = time.time()  # every commit acknowledged before this is on the standby:
        caught_up = await self._caught_up()
        link.pause()  # the standby falls behind: what it never gets, the failover takes back
        await asyncio.sleep(frozen)
        await asyncio.to_thread(old.halt, "immediate")
        link.cut()
        await asyncio.to_thread(promote, new)
        self.primary = self.servers.index(new)
        self.admin_dsn = new.dsn
        self.dsn = with_database(new.dsn, DATABASE)
        self.failovers += 1
        self.unreplicated.append((since, time.time()))
        started = time.monotonic()
        await asyncio.to_thread(self._follow, old)
        rebuilt = time.monotonic() - started
        return (
            f"standby caught up in {caught_up:.1f}s, link frozen {frozen:.1f}s,"
            f" port {new.port} promoted, old rebuilt in {rebuilt:.1f}s"
        )

    async def _caught_up(self, timeout: float = 30.0) -> float:  # noqa: ASYNC109
        """Seconds until the standby has replayed all the primary had written when asked:
        after a crash of the primary, or a rebuild, it may still be reconnecting."""
        started = time.monotonic()
        async with self.connection() as conn:
            written = await conn.fetchval("SELECT pg_current_wal_lsn()")

            async def replayed_all() -> bool:
                replayed = await conn.fetchval(
                    "SELECT max(replay_lsn) FROM pg_stat_replication WHERE state = 'streaming'"
                )
                return replayed is not None and bool(replayed >= written)

            try:
                await eventually(replayed_all, timeout)
            except AssertionError:
                raise RuntimeError(f"the standby did not catch up within {timeout:.0f}s") from None
        return time.monotonic() - started

    def _follow(self, server: EmbeddedPostgres) -> None:
        """`server` streams from the primary through a fresh link."""
        if self.link is not None:
            self.link.close()
        self.link = TcpProxy("127.0.0.1", self.servers[self.primary].port)
        stream_from(server, self.link.port)

    def stop(self) -> None:
        if self.link is not None:
            self.link.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()

    @contextlib.asynccontextmanager
    async def connection(self) -> Any:
        conn = await asyncpg.connect(self.dsn, timeout=5)
        try:
            yield conn
        finally:
            conn.terminate()


class Links:
    """A replica's way to each database server: one proxy per server, faulted together.

    With `dead_paths`, each proxy sits behind a path on which one connection can die in
    the kernel (tests/support/dead_path.py)."""

    def __init__(self, addresses: list[tuple[str, int]], *, dead_paths: bool = False) -> None:
        self.paths = [DeadPath(host, port) for host, port in addresses] if dead_paths else []
        self.proxies = (
            [path.proxy for path in self.paths]
            if dead_paths
            else [TcpProxy(host, port) for host, port in addresses]
        )

    def path_of(self, server_port: int) -> tuple[DeadPath, int] | None:
        """The path and the replica's own port of the connection the server sees coming
        from `server_port` (pg_stat_activity's client_port), if it is one of these."""
        for path in self.paths:
            port = path.client_port(server_port)
            if port is not None:
                return path, port
        return None

    def url(self, dsn: str) -> str:
        """`dsn` reached through these proxies: one host, or every one listed."""
        first = with_address(dsn, self.proxies[0].host, self.proxies[0].port)
        if len(self.proxies) == 1:
            return first
        scheme, _, rest = first.partition("://")
        auth, _, tail = rest.rpartition("@")
        hosts = ",".join(f"{p.host}:{p.port}" for p in self.proxies)
        return f"{scheme}://{auth}@{hosts}{tail[tail.index('/') :]}"

    def pause(self) -> None:
        self._each(TcpProxy.pause)

    def resume(self) -> None:
        self._each(TcpProxy.resume)

    def cut(self) -> None:
        self._each(TcpProxy.cut)

    def close(self) -> None:
        for path in self.paths:
            path.close()  # its proxy with it
        self._each(TcpProxy.close)

    def _each(self, action: Callable[[TcpProxy], None]) -> None:
        for proxy in self.proxies:
            action(proxy)


@dataclass
class Replica:
    """One `relay run` as Kubernetes would run it: restarted whenever it exits."""

    index: int
    config: Path
    proxy: Links
    log_root: Path
    process: RelayProcess | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)
    away_until: float = 0.0  # by the monotonic clock (the loop's): not restarted before

    def hold_out(self, seconds: float) -> None:
        self.away_until = time.monotonic() + seconds

    def reconfigure(self, config: Path) -> None:
        """The config its next start runs with (a rollout)."""
        self.config = config

    def start(self) -> None:
        self.starts += 1
        log_dir = self.log_root / f"replica-{self.index}-run-{self.starts}"
        self.process = RelayProcess(["run", "--config", str(self.config)], log_dir)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def signal(self, signum: int) -> None:
        """SIGKILL, SIGTERM, SIGSTOP or SIGCONT to the running process, if any."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        send = {
            signal.SIGKILL: process.kill,
            signal.SIGTERM: process.terminate,
            signal.SIGSTOP: process.pause,
            signal.SIGCONT: process.resume,
        }[signal.Signals(signum)]
        with contextlib.suppress(ProcessLookupError):
            send()

    def audit_findings(self) -> list[str]:
        """The message ids this replica's audits logged as missing, every run of it."""
        return [
            str(r.get("message_id"))
            for r in self.logs()
            if r.get("event") == "audit: message missing from the broker"
        ]

    def logs(self) -> Iterator[dict[str, Any]]:
        for run in range(1, self.starts + 1):
            path = self.log_root / f"replica-{self.index}-run-{run}" / "stderr.log"
            if path.exists():
                yield from _json_lines(path)


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                yield record


class Replicas:
    """N replicas, each reaching Postgres through its own proxy, restarted when they exit."""

    def __init__(
        self,
        count: int,
        db: Database,
        root: Path,
        broker_config: dict[str, Any],
        rule: dict[str, str],
        *,
        lanes: int = 1,
        dead_paths: bool = False,
        max_per_replica: int | None = None,
        audit: str | None = None,
    ) -> None:
        self.db = db
        # The continuous audit: "report" finds, "repair" also puts back (None: off).
        self.audit = audit
        self.lease = (
            LEASE if max_per_replica is None else {**LEASE, "max_per_replica": max_per_replica}
        )
        self.lanes = lanes  # the partitions the fleet's config gives the outbox now
        self.root = root
        self.broker_config = broker_config
        self.rule = rule  # destination (and routing key) of the outbox's messages
        self.members: list[Replica] = []
        for index in range(count):
            links = Links(db.addresses, dead_paths=dead_paths)
            self.members.append(Replica(index, Path(), links, root / "logs"))
            self.members[-1].reconfigure(self.config_file(index, lanes))

    def config_file(self, index: int, lanes: int, outboxes: str = "soak") -> Path:
        """Replica `index`'s config with `lanes` partitions; `outboxes`: `soak` alone,
        `both` (with the side outbox added) or `side` (the soak outbox removed)."""
        links = self.members[index].proxy
        path = self.root / f"replica-{index}-{outboxes}-{lanes}.yaml"
        return write_config(path, self._config(links, lanes, outboxes))

    def _config(self, links: Links, lanes: int, outboxes: str) -> dict[str, Any]:
        rule = {"type": "soak.item-added.v1", "payload": "data", **self.rule}
        soak: dict[str, Any] = {
            "broker": "broker",
            "messages": {"ItemAdded": rule},
            "batch": {"max_messages": 200, "linger": "5ms"},
            "retry": {"initial": "50ms", "max": "1s"},
            "park_after": 3,
            "partitions": lanes,
        }
        if self.audit is not None:
            soak["audit"] = AUDIT | {"repair": self.audit == "repair"}
        side = {**soak, "messages": {"NeverWritten": rule}}
        chosen = {"soak": {OUTBOX: soak}, "both": {OUTBOX: soak, SIDE: side}, "side": {SIDE: side}}
        source: dict[str, Any] = {"poll_interval": "100ms", "barrier_report_after": "500ms"}
        if self.db.standby is not None:  # publish nothing a failover can take back
            source["survive_failover"] = {"standbys": 1, "without_standbys": "wait"}
        return {
            "database": {"url": links.url(self.db.dsn), "connect_timeout": "2s"},
            "source": source,
            "brokers": {"broker": self.broker_config},
            "outboxes": chosen[outboxes],
            "lease": self.lease,
            "http": {"port": 0, "host": "127.0.0.1"},
            "logging": {"level": "info", "format": "json"},
            "shutdown": {"grace_period": "2s"},
        }

    def migrate(self) -> None:
        result = run_cli(["migrate", "--config", str(self.members[0].config)])
        if result.returncode != 0:
            raise RuntimeError(f"relay migrate failed: {result.stderr}")

    def start(self) -> None:
        for replica in self.members:
            replica.start()

    async def supervise(self, stop: asyncio.Event, rng: random.Random) -> None:
        """Restart exited replicas after a short pause, as a Deployment's pods are."""
        due: dict[int, float] = {}
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            for replica in self.members:
                if replica.process is None or replica.running:
                    continue
                if replica.index not in due:
                    code = replica.process.returncode
                    replica.exits.append(code if code is not None else 0)
                    due[replica.index] = loop.time() + rng.uniform(0.3, 1.0)
                elif loop.time() >= max(due[replica.index], replica.away_until):
                    del due[replica.index]
                    replica.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    async def holder(self) -> Replica | None:
        """A replica whose session holds one of the outbox's leases now, by pg_locks."""
        try:
            conn = await asyncpg.connect(self.db.dsn, timeout=2)
        except (OSError, TimeoutError, asyncpg.PostgresError):
            return None
        try:
            name = await conn.fetchval(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a"
                " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
                " AND a.application_name LIKE 'relay:%:lease' LIMIT 1"
            )
        finally:
            conn.terminate()
        if name is None:
            return None
        pid = int(str(name).split(":")[2])
        return next((r for r in self.members if r.pid == pid), None)

    def stop(self) -> None:
        for replica in self.members:
            replica.signal(signal.SIGCONT)
            replica.signal(signal.SIGKILL)
            if replica.process is not None:
                with contextlib.suppress(Exception):
                    replica.process.wait(10)
            replica.proxy.close()

    def log_records(self) -> Iterator[dict[str, Any]]:
        for replica in self.members:
            yield from replica.logs()
