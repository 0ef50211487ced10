"""`relay demo`: the whole product, in under a minute, on a machine with only Python.

It starts an embedded Postgres and an embedded NATS JetStream (or uses the ones
given), creates a lending library's event table, and runs two real `relay run`
processes against it. Then it tells the story: loans become messages, one per
loan although two replicas run; the holder stops and the standby carries on
from the checkpoint; the broker goes down for a few seconds and the library's
commands never notice. Everything it started is stopped and removed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
from ruamel.yaml import YAML

from relay.config import RelayConfig, load_config
from relay.demo.embedded import EmbeddedNats, EmbeddedPostgres
from relay.errors import RelayError
from relay.fleet.status import status as read_status
from relay.postgres.migrations import migrate

STREAM = "LIBRARY"
MESSAGES = {
    "BookLent": {
        "type": "library.book-lent.v1",
        "destination": "library.loans",
        "payload": {"bookId": "aggregate_id", "loanId": "data.loanId", "memberId": "data.memberId"},
    },
    "BookReturned": {
        "type": "library.book-returned.v1",
        "destination": "library.loans",
        "payload": "{bookId: aggregate_id, loanId: data.loanId, late: data.late}",
    },
}


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Replica:
    """One `relay run` process; its JSON log tells what it does."""

    name: str
    config: Path
    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> None:
        env = dict(os.environ, POD_NAME=self.name)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "relay", "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
            )

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def holds(self) -> bool:
        events = [r["event"] for r in self.records() if r.get("event", "").startswith("lease ")]
        return bool(events) and events[-1] == "lease acquired: relaying"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@dataclass
class Library:
    """The application: its commands only append events, in their own transactions."""

    dsn: str
    table: str
    durations: list[float] = field(default_factory=list)

    async def _append(self, book: str, type_: str, data: dict[str, Any]) -> None:
        started = time.monotonic()
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(
                f"INSERT INTO {self.table} (aggregate_type, aggregate_id, version, type, payload)"
                f" SELECT 'book', $1, coalesce(max(version), 0) + 1, $2, $3::jsonb"
                f" FROM {self.table} WHERE aggregate_type = 'book' AND aggregate_id = $1",
                book,
                type_,
                json.dumps(data),
            )
        finally:
            await conn.close()
        self.durations.append(time.monotonic() - started)

    async def add(self, book: str, title: str) -> None:
        await self._append(book, "BookAdded", {"title": title})

    async def lend(self, book: str, loan: str, member: str) -> None:
        await self._append(book, "BookLent", {"loanId": loan, "memberId": member})

    async def give_back(self, book: str, loan: str, late: bool = False) -> None:
        await self._append(book, "BookReturned", {"loanId": loan, "late": late})


async def received(nats_url: str) -> list[dict[str, Any]]:
    """What a consumer of the stream has: every message, in stream order."""
    nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(STREAM, seq)
            headers = msg.headers or {}
            out.append(
                {
                    "seq": seq,
                    "id": headers.get("ce-id"),
                    "type": headers.get("ce-type"),
                    "body": json.loads(msg.data or b"null"),
                }
            )
        return out
    finally:
        await nc.close()


async def until(check: Callable[[], Any], what: str, within: float = 20.0) -> float:
    """Wait for `check()` (sync or async) to be true; return the seconds it took."""
    started = time.monotonic()
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise RelayError(f"demo: {what} did not happen within {within:g}s")
        await asyncio.sleep(0.05)


class Demo:
    def __init__(self, database_url: str | None, nats_url: str | None) -> None:
        self.given_db, self.given_nats = database_url, nats_url
        self.workdir = Path(tempfile.mkdtemp(prefix="relay-demo-"))
        suffix = uuid.uuid4().hex[:8]
        self.table = f"library_events_{suffix}"
        self.schema = f"relay_demo_{suffix}"
        self.pg: EmbeddedPostgres | None = None
        self.broker: EmbeddedNats | None = None

    @contextlib.asynccontextmanager
    async def services(self) -> AsyncIterator[tuple[str, str]]:
        try:
            dsn = self.given_db or await asyncio.to_thread(self._start_postgres)
            url = self.given_nats or await asyncio.to_thread(self._start_nats)
            yield str(dsn), str(url)
        finally:
            await self._clean_up()

    def _start_postgres(self) -> str:
        self.pg = EmbeddedPostgres()
        return self.pg.start()

    def _start_nats(self) -> str:
        self.broker = EmbeddedNats(self.workdir / "nats")
        return self.broker.start().url

    async def _clean_up(self) -> None:
        if self.given_db:
            with contextlib.suppress(Exception):
                conn = await asyncpg.connect(self.given_db)
                try:
                    await conn.execute(f"DROP TABLE IF EXISTS {self.table}")
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
                finally:
                    await conn.close()
        if self.broker is not None:
            self.broker.stop()
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)
        if not os.environ.get("RELAY_DEMO_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def write_config(self, dsn: str, nats_url: str) -> Path:
        data = {
            "database": {"url": dsn, "schema": self.schema},
            "source": {"table": self.table, "poll_interval": "200ms"},
            "brokers": {
                "nats": {
                    "type": "nats",
                    "servers": [nats_url],
                    "ack_timeout": "1s",
                    "connect_timeout": "1s",
                    "stream": {"name": STREAM, "subjects": ["library.>"]},
                }
            },
            "outboxes": {
                "loans-outbox": {
                    "broker": "nats",
                    "aggregates": ["book"],
                    "messages": MESSAGES,
                    "retry": {"initial": "100ms", "max": "1s"},
                }
            },
            "lease": {"namespace": self.schema},
            "http": {"port": 0, "host": "127.0.0.1"},
            "logging": {"level": "info", "format": "json"},
            "shutdown": {"grace_period": "5s"},
        }
        path = self.workdir / "relay.yaml"
        with path.open("w") as fh:
            YAML(typ="safe", pure=True).dump(data, fh)
        return path

    async def prepare(self, dsn: str, config: RelayConfig) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                f"CREATE TABLE {self.table} ("
                " position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                " aggregate_type text NOT NULL, aggregate_id text NOT NULL,"
                " version bigint NOT NULL, type text NOT NULL, payload jsonb NOT NULL,"
                " metadata jsonb NOT NULL DEFAULT '{}',"
                " created_at timestamptz NOT NULL DEFAULT now(),"
                " UNIQUE (aggregate_type, aggregate_id, version))"
            )
            await migrate(conn, config)
        finally:
            await conn.close()


async def run_demo(database_url: str | None = None, nats_url: str | None = None) -> int:
    started = time.monotonic()
    demo = Demo(database_url, nats_url)
    say("Outbox Relay demo: a lending library whose loans must reach other services.\n")
    async with demo.services() as (dsn, url):
        say(
            f"  Postgres: {'given' if database_url else 'embedded'}; "
            f"NATS JetStream: {'given' if nats_url else 'embedded'}; work dir {demo.workdir}"
        )
        path = demo.write_config(dsn, url)
        config = load_config(path)
        await demo.prepare(dsn, config)
        library = Library(dsn, demo.table)
        a, b = (Replica(name, path, demo.workdir) for name in ("replica-a", "replica-b"))
        try:
            await _story(Scene(demo, library, config, url, path), a, b)
        finally:
            for replica in (a, b):
                replica.stop()
    say(f"\nDone in {time.monotonic() - started:.0f} s; everything the demo started is gone.")
    return 0


@dataclass(frozen=True)
class Scene:
    demo: Demo
    library: Library
    config: RelayConfig
    url: str
    path: Path  # the replicas' config file, which `relay status` reads too


async def _story(scene: Scene, a: Replica, b: Replica) -> None:
    demo, library, config, url = scene.demo, scene.library, scene.config, scene.url
    say("\n1. Two replicas start; one takes the outbox's lease, the other stands by.")
    a.start()
    await until(a.holds, "replica-a taking the lease")
    b.start()
    await until(lambda: any(r.get("event") == "standing by" for r in b.records()), "a standby")
    say("   replica-a holds the lease; replica-b stands by.")

    say("\n2. Books are added and lent. The library's commands only append events.")
    for book, title in (("book-1", "Dune"), ("book-2", "Emma"), ("book-3", "Ulysses")):
        await library.add(book, title)
    for n, book in enumerate(("book-1", "book-2", "book-3"), start=1):
        await library.lend(book, f"loan-{n}", f"member-{n}")
    await until(lambda: _count(url, 3), "3 loans on the stream")
    messages = await received(url)
    say(f"   3 loans -> {len(messages)} messages (BookAdded is not mapped, so not published).")
    say(
        "   Two replicas ran, yet each loan produced one message: "
        f"{len({m['id'] for m in messages})} distinct ids."
    )

    say("\n3. The holder is stopped (SIGTERM). The standby carries on from the checkpoint.")
    stopped = time.monotonic()
    code = a.stop()
    await until(b.holds, "replica-b taking over")
    say(
        f"   replica-a exited {code}; replica-b took the lease "
        f"{(time.monotonic() - stopped) * 1000:.0f} ms after the signal."
    )
    await library.give_back("book-1", "loan-1")
    await library.lend("book-1", "loan-4", "member-4")
    await until(lambda: _count(url, 5), "messages from replica-b")
    say("   Two more commands, published by replica-b: nothing lost, nothing twice.")

    say("\n4. The broker goes down for a few seconds. Commands keep working.")
    await _outage(demo, library, config, url)

    say("\nWhat a consumer received, in order:")
    for m in await received(url):
        say(f"  #{m['seq']:<3} {m['id']:<16} {m['type']:<26} {json.dumps(m['body'])}")
    say(f"\n$ relay status --config {scene.path}")
    for line in await status_table(scene.path):
        say(f"  {line}")


async def status_table(path: Path) -> list[str]:
    """What `relay status` prints: the demo runs the command, so it shows an operator's view."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "relay",
        "status",
        "--config",
        str(path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    if process.returncode != 0:
        raise RelayError(f"demo: `relay status` exited {process.returncode}: {text}")
    return text.splitlines()


async def _outage(demo: Demo, library: Library, config: RelayConfig, url: str) -> None:
    if demo.broker is None:
        say("   (a given broker is not stopped by the demo; this step is skipped)")
        return
    demo.broker.stop()
    library.durations.clear()
    await library.give_back("book-2", "loan-2", late=True)
    await library.give_back("book-3", "loan-3")
    await library.lend("book-2", "loan-5", "member-5")

    async def retrying() -> bool:
        return (await read_status(config))[0].state == "retrying"

    await until(retrying, "status showing retrying")
    row = (await read_status(config))[0]
    slowest = max(library.durations) * 1000
    say(f"   3 commands succeeded while the broker was down (slowest {slowest:.0f} ms).")
    say(f"   relay status: state={row.state}, last_error={row.last_error!r}")
    await asyncio.sleep(2)
    demo.broker.start()
    took = await until(lambda: _count(url, 8), "delivery after the outage")
    say(f"   The broker is back: the relay delivered the backlog {took * 1000:.0f} ms later.")


async def _count(url: str, expected: int) -> bool:
    with contextlib.suppress(Exception):
        return len(await received(url)) >= expected
    return False
