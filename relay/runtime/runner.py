"""`relay run`: every configured outbox in one process, supervised.

Signal handlers only set an event. Every task is awaited and watched: if one
dies, the others are stopped and the process says why and exits non-zero.
On the first SIGTERM/SIGINT the outboxes stop reading, in-flight batches get
`shutdown.grace_period` to be acknowledged (or are abandoned without moving
the checkpoint), and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
import structlog

from relay import __version__
from relay.brokers import create_publishers
from relay.config import RelayConfig
from relay.core.lane_state import OutboxState
from relay.core.lanes import lanes_of
from relay.core.metrics import Metrics
from relay.core.retry import Backoff
from relay.core.waiting import sleep_unless
from relay.errors import DatabaseError
from relay.fleet.identity import identity
from relay.fleet.snapshot import snapshot
from relay.postgres.command_queue import COMMAND_CHANNEL
from relay.postgres.database import (
    CONNECTION_LOST,
    Database,
    DatabaseUnavailable,
    KeptConnection,
    too_old,
)
from relay.postgres.lease import LEASE_CHANNEL, LeaseBudget, LeaseConnection
from relay.postgres.membership import Membership
from relay.postgres.migrations import ensure_migrated, newer_schema
from relay.postgres.rights import check_rights
from relay.postgres.source import EventSource
from relay.runtime.context import OutboxContext
from relay.runtime.heap import start_up_heap_frozen
from relay.runtime.http import Health, HttpServer
from relay.runtime.log_noise import quiet_lost_replies
from relay.runtime.replica import OutboxReplica
from relay.runtime.status_page import StatusCache, StatusPage

log = structlog.get_logger("relay.runner")


@dataclass
class Relay:
    config: RelayConfig
    identity: str = field(default_factory=identity)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    states: dict[str, OutboxState] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    http_port: int | None = None  # `relay run --http-port` beats `http.port`
    config_file: str | None = None  # for the start-up line

    def __post_init__(self) -> None:
        self._budget = LeaseBudget(self.config.lease.max_per_replica)
        self._tasks: list[asyncio.Task[None]] = []
        self._db_seen = float("-inf")
        self._page: StatusPage | None = None
        self._status_session: KeptConnection | None = None

    async def run(self) -> int:
        """Run until stopped; the process exit code."""
        db = Database.of(self.config, self.identity)
        restore = quiet_lost_replies(asyncio.get_running_loop())
        try:
            return await self._run(db)
        finally:
            restore()

    async def _run(self, db: Database) -> int:
        log.info(
            "relay starting",
            version=__version__,
            replica=self.identity,
            config_file=self.config_file,
            outboxes=list(self.config.outboxes),
        )
        for warning in self.config.warnings():
            log.warning("a costly setting", detail=warning)
        http = self._http(db)
        if http is not None:
            await http.start()  # before the database: liveness must answer during an outage
        try:
            if not await self._preflight(db):
                log.info("stopped before the database could be reached", exit_code=0)
                return 0
            return await self._relay_all(db)
        finally:
            if http is not None:
                await http.close()
            if self._status_session is not None:
                await self._status_session.close()

    async def _relay_all(self, db: Database) -> int:
        config = self.config
        session = LeaseConnection(db, config.lease, config.database.schema_, self.identity)
        membership = Membership(
            config.database.schema_,
            config.lease.namespace,
            self.identity,
            {name: outbox.partitions for name, outbox in config.outboxes.items()},
            self._budget.free,
            version=__version__,
        )
        replicas = [self._replica(db, name, session, membership) for name in config.outboxes]
        contexts = [ctx for replica in replicas for ctx in replica.lanes]
        self.states = {ctx.name: ctx.state for ctx in contexts}
        tasks = {asyncio.create_task(r.run(), name=f"outbox:{r.name}"): r.name for r in replicas}
        self._tasks = [*tasks]
        helpers = [
            asyncio.create_task(self._listen(db, replicas), name="listener"),
            asyncio.create_task(self._probe(db), name="database-probe"),
        ]
        if self._page is not None:
            helpers.append(asyncio.create_task(self._page.sample(self.stop), name="lag-sampler"))
        self._tasks += helpers
        try:
            with start_up_heap_frozen():
                return await self._supervise(tasks, helpers, lambda: _leave(session, membership))
        finally:
            await _leave(session, membership)  # again, if stopping went wrong before it
            await session.close()
            for ctx in contexts:
                await ctx.publisher.close()

    def _replica(
        self, db: Database, name: str, session: LeaseConnection, membership: Membership
    ) -> OutboxReplica:
        """The outbox's lanes (one publisher each, so that they publish side by side)."""
        outbox = self.config.outboxes[name]
        lanes = lanes_of(name, outbox.partitions)
        publishers = create_publishers(
            outbox.broker, self.config.brokers[outbox.broker], len(lanes)
        )
        contexts = [
            OutboxContext.build(
                lane,
                self.config,
                identity=self.identity,
                publisher=publisher,
                metrics=self.metrics,
                shutdown=self.stop,
            )
            for lane, publisher in zip(lanes, publishers, strict=True)
        ]
        return OutboxReplica(
            contexts,
            session=session,
            budget=self._budget,
            db=db,
            reconnect=self.config.database.retry,
            membership=membership,
            stop=self.stop,
        )

    def _http(self, db: Database) -> HttpServer | None:
        c = self.config.http
        if not c.enabled:
            return None
        if c.status_page:
            session = self._status_session = KeptConnection(db, "status")
            read = StatusCache(lambda: snapshot(session, self.config), timeout=c.request_timeout)
            self._page = StatusPage(read, self.identity)
        port = self.http_port if self.http_port is not None else c.port
        health = Health(
            tasks_alive=lambda: all(not t.done() for t in self._tasks),
            database_ok=lambda: time.monotonic() - self._db_seen < c.ready_after_database_silence,
            states=lambda: {n: s.role for n, s in self.states.items()},
        )
        return HttpServer(
            c.host,
            port,
            self.metrics,
            health,
            request_timeout=c.request_timeout,
            max_connections=c.max_connections,
            status_page=self._page,
        )

    async def _probe(self, db: Database) -> None:
        """Readiness: ask the database every few seconds; never fail, never block the loop."""
        interval = self.config.http.database_probe_interval
        while not self.stop.is_set():
            conn = None
            try:
                conn = await db.connect("probe")
                while not self.stop.is_set():
                    async with asyncio.timeout(interval):
                        await conn.fetchval("SELECT 1")
                    self._db_seen = time.monotonic()
                    await sleep_unless(self.stop, interval)
            except (DatabaseError, *CONNECTION_LOST) as exc:
                log.debug("database probe failed", error=str(exc))
                await sleep_unless(self.stop, interval)
            finally:
                if conn is not None:
                    conn.terminate()

    async def _preflight(self, db: Database) -> bool:
        """Refuse to start on what no retry can fix: a missing right or migration, a bad table.

        An unreachable database is waited for, also when it goes away during the checks
        (False if stopped meanwhile).
        """
        backoff, attempt = Backoff(self.config.database.retry), 0
        while True:
            try:
                conn = await db.connect("preflight")
                self._db_seen = time.monotonic()
                try:
                    await self._checks(conn)
                finally:
                    conn.terminate()  # each statement committed on its own: nothing to finish
                return True
            except (DatabaseUnavailable, *CONNECTION_LOST) as exc:
                if self.stop.is_set():
                    return False
                attempt += 1
                log.warning("database unreachable, retrying", error=str(exc), attempt=attempt)
                await sleep_unless(self.stop, backoff.delay(attempt))

    async def _checks(self, conn: asyncpg.Connection) -> None:
        if (why := too_old(conn)) is not None:
            raise DatabaseError(why)
        rights = await check_rights(conn, self.config)
        for missing in rights.degraded:
            log.warning(
                "database right missing", right=missing.what, why=missing.why, fix=missing.fix
            )
        rights.raise_if_required_missing()
        schema = self.config.database.schema_
        if (newer := newer_schema(schema, await ensure_migrated(conn, schema))) is not None:
            log.warning("relay older than its schema", detail=newer)
        source = EventSource(self.config.source)
        await source.check(conn)
        for warning in await source.warnings(conn):
            log.warning("event table allows what the relay skips", detail=warning)

    async def _supervise(
        self,
        tasks: dict[asyncio.Task[None], str],
        helpers: list[asyncio.Task[None]],
        leave: Callable[[], Awaitable[None]],
    ) -> int:
        """Wait for stop, or for any task to die (then stop everything and say why).

        On stop the replica first leaves the live set, so that when its lanes are released
        one by one the others already count one replica fewer and take them at once.
        """
        stopper: asyncio.Task[object] = asyncio.create_task(self.stop.wait(), name="stop")
        pending: set[asyncio.Task[object]] = {*tasks, *helpers, stopper}
        code = 0
        while not self.stop.is_set():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopper}:
                if task.cancelled() or task.exception() is not None:
                    exc = None if task.cancelled() else task.exception()
                    log.error(
                        "task died, stopping the relay",
                        task=task.get_name(),
                        error="cancelled" if exc is None else f"{type(exc).__name__}: {exc}",
                        exc_info=exc,
                    )
                    code = 1
                    self.stop.set()
            if not self.stop.is_set() and all(t.done() for t in tasks):
                log.error("no outbox is relaying any more, stopping")
                code = 1
                self.stop.set()
        grace = self.config.shutdown.grace_period
        log.info("stopping", grace_period=grace)
        await leave()
        _, late = await asyncio.wait(tasks, timeout=grace) if tasks else (set(), set())
        for task in late:
            log.warning("grace period over, abandoning the in-flight batch", task=task.get_name())
            task.cancel()
        for helper in (*helpers, stopper):
            helper.cancel()
        await asyncio.gather(*tasks, *helpers, stopper, return_exceptions=True)
        log.info("stopped", exit_code=code)
        return code

    async def _listen(self, db: Database, replicas: list[OutboxReplica]) -> None:
        """LISTEN for wake-up hints; polling covers any gap while reconnecting.

        New events wake every lane; a released lease wakes that outbox's coordinator; a
        command wakes its lane's holder.
        """
        channel = self.config.source.notify_channel
        by_outbox = {r.name: r.wake for r in replicas}
        lanes = {ctx.name: ctx for r in replicas for ctx in r.lanes}
        namespace = f"{self.config.lease.namespace}/"

        def wake(*_: object) -> None:
            for ctx in lanes.values():
                ctx.wakes.events.set()

        def lease_released(_c: object, _pid: int, _channel: str, payload: str) -> None:
            # `<namespace>/<lane>`: any lane of the outbox, of whatever count (a change-over
            # waits for the last lane of the old count to be let go).
            if payload.startswith(namespace):
                outbox = payload[len(namespace) :].partition("/")[0]
                if outbox in by_outbox:
                    by_outbox[outbox].set()

        def command_sent(_c: object, _pid: int, _channel: str, payload: str) -> None:
            if payload in lanes:
                lanes[payload].wakes.commands.set()

        backoff, attempt = Backoff(self.config.database.retry), 0
        while not self.stop.is_set():
            conn: asyncpg.Connection | None = None
            try:
                conn = await db.connect("listener")
                await conn.add_listener(channel, wake)
                await conn.add_listener(LEASE_CHANNEL, lease_released)
                await conn.add_listener(COMMAND_CHANNEL, command_sent)
                attempt = 0
                lost = asyncio.Event()
                conn.add_termination_listener(_setter(lost))
                while not lost.is_set() and not self.stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), 5.0)
                    if not lost.is_set():
                        await conn.execute("SELECT 1")
            except (DatabaseError, *CONNECTION_LOST) as exc:
                attempt += 1
                log.debug("listener reconnecting", error=str(exc), attempt=attempt)
                await sleep_unless(self.stop, backoff.delay(attempt))
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), timeout=2)


async def _leave(session: LeaseConnection, membership: Membership) -> None:
    """Say goodbye: the others may take this replica's share at once. Best effort."""
    with contextlib.suppress(DatabaseError, *CONNECTION_LOST, TimeoutError):
        async with asyncio.timeout(2), session.statement() as conn:
            await membership.leave(conn)


def _setter(event: asyncio.Event) -> Callable[[object], None]:
    return lambda _conn: event.set()


def install_signal_handlers(relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
    """First signal: graceful stop. Second: exit at once."""

    def handle(sig: signal.Signals) -> None:
        if relay.stop.is_set():
            log.warning("second signal, exiting now", signal=sig.name)
            os._exit(130)
        log.info("signal received, stopping", signal=sig.name)
        relay.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle, sig)
