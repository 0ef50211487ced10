"""`relay check` finds, before `relay run` does, what would stop the relay: each missing database
right with the GRANT that gives it, a broker that refuses the login, and a destination that does
not exist; and the CLI's errors are one line, never a traceback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from nats.js.errors import NotFoundError

from relay.postgres.lease import lock_key
from tests.contract.brokers.kinesis import kinesis_client
from tests.contract.brokers.kinesis import unique_stream as unique_kinesis_stream
from tests.contract.brokers.sns import sns_client, subscribed_queue
from tests.contract.brokers.sns import unique_topic as unique_sns_topic
from tests.support import postgres, pubsub_server
from tests.support.db import append_many, connect
from tests.support.jetstream import connect as nats_connect
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.kafka_server import TansuServer, consume, create_topic, unique_topic
from tests.support.nats_server import NatsServerWithAuth
from tests.support.net import free_port
from tests.support.postgres import as_role
from tests.support.rabbitmq_server import QueueReader, create_topology, delete_topology
from tests.support.redis_server import DEDUP_PREFIX, redis_client, unique_stream
from tests.support.redis_server import delete_stream as delete_redis_stream
from tests.support.relay_process import RelayProcess, run_cli
from tests.support.scenario import config_dict, save
from tests.support.sqs_server import REGION, create_queue, receive_all, sqs_client, unique_queue
from tests.support.webhook_server import SECRET, WebhookServer

OUTBOX = "loans"
FULL_GRANTS = """
GRANT SELECT ON events TO {role};
GRANT SELECT ON SEQUENCE events_position_seq TO {role};
GRANT USAGE ON SCHEMA relay TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA relay TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA relay TO {role};
GRANT pg_read_all_stats, pg_signal_backend TO {role};
"""


async def admin(dsn: str, sql: str) -> None:
    async with connect(dsn) as conn:
        await conn.execute(sql)


@pytest.fixture
async def migrated(events_table: str, tmp_path: Path) -> str:
    """The example event table, and the relay's tables migrated by the superuser."""
    result = await asyncio.to_thread(
        run_cli,
        [
            "migrate",
            "--config",
            str(save(tmp_path, config_dict(events_table, "nats://127.0.0.1:1", "s"))),
        ],
    )
    assert result.returncode == 0, result.stderr
    return events_table


@pytest.fixture
async def roles(migrated: str, pg_admin_dsn: str) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """`await roles(revoke=SQL)`: a login role with every right the relay needs, less `revoke`
    (`{role}` in it is the role); the DSN that logs in as it. Dropped afterwards."""
    made: list[str] = []

    async def make(revoke: str = "") -> str:
        role = f"relay_check_{uuid.uuid4().hex[:10]}"
        made.append(role)
        await admin(pg_admin_dsn, f"CREATE ROLE {role} LOGIN")
        await admin(migrated, FULL_GRANTS.format(role=role) + revoke.format(role=role))
        return as_role(migrated, role)

    yield make
    for role in made:
        await admin(migrated, f"DROP OWNED BY {role}")
        await admin(pg_admin_dsn, f"DROP ROLE {role}")


def check(dsn: str, tmp_path: Path, *extra: str, nats_url: str = "nats://127.0.0.1:1") -> Any:
    path = save(tmp_path, config_dict(dsn, nats_url, "library"), f"{uuid.uuid4().hex}.yaml")
    return run_cli(["check", "--config", str(path), "--offline", *extra])


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# What each missing right makes `relay check` and `relay run` say, and the GRANT in it.
MISSING = {
    "SELECT on the event table": (
        "REVOKE SELECT ON events FROM {role}",
        "SELECT on table public.events: the relay reads the events from it;"
        " fix: GRANT SELECT ON public.events TO {role};",
    ),
    "SELECT on the position sequence": (
        "REVOKE SELECT ON SEQUENCE events_position_seq FROM {role}",
        "SELECT on sequence public.events_position_seq: the drain barrier reads the last"
        " position handed out (pg_sequence_last_value) before each read; USAGE would also do,"
        " but would let the role take positions;"
        " fix: GRANT SELECT ON SEQUENCE public.events_position_seq TO {role};",
    ),
    "USAGE on the relay's schema": (
        "REVOKE USAGE ON SCHEMA relay FROM {role}",
        "USAGE on schema relay: the relay's checkpoints, parked messages and commands are"
        " there; fix: GRANT USAGE ON SCHEMA relay TO {role};",
    ),
    "writing the checkpoints": (
        "REVOKE INSERT, UPDATE ON relay.checkpoints FROM {role}",
        "INSERT, UPDATE on table relay.checkpoints: the relay keeps its own state there;"
        " fix: GRANT INSERT, UPDATE ON relay.checkpoints TO {role};",
    ),
    "numbering parked messages": (
        "REVOKE USAGE ON SEQUENCE relay.parked_id_seq FROM {role}",
        "USAGE on sequence relay.parked_id_seq: the relay numbers its parked messages and"
        " commands with it; fix: GRANT USAGE ON SEQUENCE relay.parked_id_seq TO {role};",
    ),
}


@pytest.mark.parametrize("case", list(MISSING))
async def test_each_missing_right_is_named_with_its_grant_by_check_and_by_run(
    case: str, roles: Callable[..., Awaitable[str]], migrated: str, tmp_path: Path
) -> None:
    revoke, said = MISSING[case]
    dsn = await roles(revoke)
    role = urlsplit(dsn).username
    expected = f"error: database: {said.format(role=role)}"

    result = await asyncio.to_thread(check, dsn, tmp_path)
    assert result.returncode == 1, result.stderr
    assert errors(result.stderr) == [expected]
    assert "config OK" not in result.stdout
    assert "Traceback" not in result.stderr

    # `relay run` refuses at its preflight with the same list, not with a task dying later.
    path = save(tmp_path, config_dict(dsn, "nats://127.0.0.1:1", "library"), "run.yaml")
    run = await asyncio.to_thread(run_cli, ["run", "--config", str(path), "--http-port", "0"])
    assert run.returncode == 1, run.stderr
    assert f"lacks 1 right(s) the relay needs:\n  - {said.format(role=role)}" in run.stderr
    assert "task died" not in run.stderr
    assert "Traceback" not in run.stderr

    # The GRANT printed is the fix.
    await admin(migrated, expected.rpartition("fix: ")[2])
    fixed = await asyncio.to_thread(check, dsn, tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert "config OK" in fixed.stdout


async def test_a_position_sequence_the_column_does_not_own_is_checked_too(
    roles: Callable[..., Awaitable[str]], migrated: str, tmp_path: Path
) -> None:
    """A `DEFAULT nextval('s')` on a sequence not OWNED BY the column is linked only through
    the default: the rights check must find it as the relay's reading does."""
    dsn = await roles()  # its grants name the identity sequence, dropped here
    await admin(
        migrated,
        "CREATE SEQUENCE loose_position_seq; "
        "ALTER TABLE events ALTER COLUMN position DROP IDENTITY, "
        "ALTER COLUMN position SET DEFAULT nextval('loose_position_seq')",
    )
    role = urlsplit(dsn).username
    result = await asyncio.to_thread(check, dsn, tmp_path)
    assert result.returncode == 1, result.stderr
    assert errors(result.stderr) == [
        "error: database: SELECT on sequence public.loose_position_seq: the drain barrier reads"
        " the last position handed out (pg_sequence_last_value) before each read; USAGE would"
        " also do, but would let the role take positions;"
        f" fix: GRANT SELECT ON SEQUENCE public.loose_position_seq TO {role};"
    ]


async def test_check_refuses_what_run_refuses_and_warns_of_another_partition_count(
    migrated: str, tmp_path: Path
) -> None:
    """Tables a later release contracted fail `relay run` at start-up: `relay check` says
    so first; tables it only expanded are a warning. A changed `partitions` is no failure
    (replicas with this config wait, or change the outbox over): `relay check` warns, with
    the words `relay run` logs."""
    await admin(migrated, "INSERT INTO relay.outboxes (outbox, partitions) VALUES ('loans', 4)")
    result = await asyncio.to_thread(check, migrated, tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "warning: outboxes.loans.partitions is 1, but the outbox runs with 4 partition(s):"
        " the replicas change it over by themselves once every live replica running it says 1"
    ) in result.stderr

    await admin(migrated, "DELETE FROM relay.outboxes")
    # A later release's step that only expands: this relay runs, and says so.
    await admin(
        migrated,
        "INSERT INTO relay.schema_version (version) SELECT max(version) + 1"
        " FROM relay.schema_version",
    )
    expanded = await asyncio.to_thread(check, migrated, tmp_path)
    assert expanded.returncode == 0, expanded.stderr
    assert "newer than this relay" in expanded.stderr and "only add" in expanded.stderr
    # One that contracts what this relay uses (it needs a relay of that later version).
    await admin(
        migrated,
        "INSERT INTO relay.schema_version (version, readers_from) SELECT max(version) + 1,"
        " max(version) FROM relay.schema_version",
    )
    newer = await asyncio.to_thread(check, migrated, tmp_path)
    assert newer.returncode == 1, newer.stderr
    (line,) = errors(newer.stderr)
    assert "newer than this relay" in line and "upgrade the relay" in line


async def test_rights_that_only_cost_a_feature_are_warnings(
    roles: Callable[..., Awaitable[str]], tmp_path: Path
) -> None:
    dsn = await roles("REVOKE pg_read_all_stats, pg_signal_backend FROM {role}")
    role = urlsplit(dsn).username
    result = await asyncio.to_thread(check, dsn, tmp_path)
    assert result.returncode == 0, result.stderr
    assert errors(result.stderr) == []
    assert (
        "warning: database: membership in pg_read_all_stats (seeing other roles' sessions):"
        " pg_stat_activity hides the state and transaction start of sessions of other roles"
    ) in result.stderr
    assert f"fix: GRANT pg_read_all_stats TO {role};" in result.stderr
    assert (
        "warning: database: membership in pg_signal_backend (ending a silent holder's session):"
        f" this role may end only sessions of its own role {role!r}: heartbeat takeover"
    ) in result.stderr
    assert f"fix: GRANT pg_signal_backend TO {role};" in result.stderr


async def test_survive_failover_makes_reading_the_standbys_positions_required(
    roles: Callable[..., Awaitable[str]], migrated: str, tmp_path: Path
) -> None:
    """Without pg_read_all_stats, pg_stat_replication hides every standby's position: the
    relay would hold every event back for ever, so the right is required, not a warning."""
    dsn = await roles("REVOKE pg_read_all_stats FROM {role}")
    role = urlsplit(dsn).username
    data = config_dict(dsn, "nats://127.0.0.1:1", "library")
    data["source"]["survive_failover"] = {"standbys": 1}
    path = save(tmp_path, data, "survive.yaml")
    result = await asyncio.to_thread(run_cli, ["check", "--config", str(path), "--offline"])
    assert result.returncode == 1, result.stderr
    (line,) = errors(result.stderr)
    assert line.startswith(
        "error: database: membership in pg_read_all_stats (seeing how far the standbys are)"
    ), line
    assert line.endswith(f"fix: GRANT pg_read_all_stats TO {role};"), line
    await admin(migrated, f"GRANT pg_read_all_stats TO {role}")
    fixed = await asyncio.to_thread(run_cli, ["check", "--config", str(path), "--offline"])
    assert fixed.returncode == 0, fixed.stderr


async def test_a_holder_this_role_may_not_end_is_named(
    roles: Callable[..., Awaitable[str]], tmp_path: Path
) -> None:
    """Replicas under two roles: a standby could not end the silent holder's session."""
    checker = await roles("REVOKE pg_signal_backend FROM {role}")
    holder_dsn = await roles()
    holder_role = urlsplit(holder_dsn).username
    holder = await asyncpg.connect(
        holder_dsn, server_settings={"application_name": "relay:other-pod:7:lease"}
    )
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", lock_key("relay", OUTBOX))
        result = await asyncio.to_thread(check, checker, tmp_path)
        assert result.returncode == 0, result.stderr
        assert (
            f"warning: database: ending the sessions of role {holder_role!r}: a lease of this"
            f" config is held now by the session relay:other-pod:7:lease of role {holder_role!r},"
            " which this role may not end: if that holder goes silent, heartbeat takeover cannot"
            " work"
        ) in result.stderr
        # What the warning is about, for real.
        async with connect(checker) as standby:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await standby.fetchval("SELECT pg_terminate_backend($1)", holder.get_server_pid())
    finally:
        await holder.close()


# -- brokers ----------------------------------------------------------------------------------


@pytest.fixture
def nats_with_auth(tmp_path: Path) -> Iterator[NatsServerWithAuth]:
    server = NatsServerWithAuth(tmp_path / "nats-auth", "relay", "right-password").start()
    try:
        yield server
    finally:
        server.kill()


def broker_config(
    dsn: str, brokers: dict[str, Any], destinations: dict[str, str]
) -> dict[str, Any]:
    """One outbox per broker, each with one message per destination (fixed names)."""
    data = config_dict(dsn, "nats://127.0.0.1:1", "library")
    data["brokers"] = brokers
    data["outboxes"] = {
        f"o-{i}": {
            "broker": broker,
            "messages": {"BookLent": {"type": "t.v1", "destination": destination}},
        }
        for i, (destination, broker) in enumerate(destinations.items())
    }
    return data


async def test_webhook_receivers_that_cannot_be_reached_are_named_and_nothing_is_posted(
    migrated: str, tmp_path: Path
) -> None:
    """A webhook has no request without effect: `relay check` connects to each host and
    sends nothing; a bad URL and a dead host are named, the live one is not."""
    receiver = await WebhookServer().start()
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        brokers = {"hooks": {"type": "http", "signing_keys": [SECRET]}}
        destinations = {
            f"{receiver.url}/in/loans": "hooks",
            f"{dead}/in/loans": "hooks",
            "loans-without-a-scheme": "hooks",
        }
        data = broker_config(migrated, brokers, destinations)
        result = await asyncio.to_thread(run_cli, ["check", "--config", str(save(tmp_path, data))])
        assert result.returncode == 1, result.stderr
        said = errors(result.stderr)
        assert len(said) == 2, result.stderr
        assert "broker 'hooks': 'loans-without-a-scheme' is not an http:// or https:// URL" in (
            said[0] + said[1]
        )
        assert f"broker 'hooks': cannot connect to {dead}" in said[0] + said[1]
        assert receiver.requests == []
    finally:
        await receiver.close()


async def test_wrong_broker_passwords_are_named(
    migrated: str, nats_with_auth: NatsServerWithAuth, rabbitmq_url: str, tmp_path: Path
) -> None:
    port = nats_with_auth.port
    rabbit = urlsplit(rabbitmq_url)
    wrong_rabbit = urlunsplit(
        rabbit._replace(netloc=f"guest:wr0ng-pw@{rabbit.hostname}:{rabbit.port}")
    )
    brokers = {
        "good-nats": {
            "type": "nats",
            "servers": [f"nats://127.0.0.1:{port}"],
            "user": "relay",
            "password": "right-password",
            "jetstream": False,
        },
        "bad-nats": {
            "type": "nats",
            "servers": [f"nats://127.0.0.1:{port}"],
            "user": "relay",
            "password": "wr0ng-pw",
        },
        "bad-rabbit": {"type": "rabbitmq", "url": wrong_rabbit},
    }
    data = broker_config(
        migrated, brokers, {"a.b": "good-nats", "c.d": "bad-nats", "amq.topic": "bad-rabbit"}
    )
    result = await asyncio.to_thread(run_cli, ["check", "--config", str(save(tmp_path, data))])
    assert result.returncode == 1, result.stderr
    found = errors(result.stderr)
    assert len(found) == 2, result.stderr
    assert found[0].startswith("error: broker 'bad-nats': cannot connect: ")
    assert "authorization violation" in found[0].lower()
    assert found[1].startswith("error: broker 'bad-rabbit': cannot connect: ")
    assert "ACCESS_REFUSED" in found[1] or "authentication" in found[1].lower(), found[1]
    assert "note: broker 'good-nats': connected and authenticated" in result.stderr
    assert "wr0ng-pw" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr

    offline = await asyncio.to_thread(
        run_cli, ["check", "--config", str(save(tmp_path, data)), "--offline"]
    )
    assert offline.returncode == 0, offline.stderr
    assert "note: brokers not checked (--offline)" in offline.stderr


async def test_missing_destinations_are_named_and_nothing_is_published(  # noqa: PLR0917 - one broker each
    migrated: str,
    nats_url: str,
    rabbitmq_url: str,
    tansu_factory: Callable[..., TansuServer],
    sqs_endpoint: str,
    pubsub_emulator: str,
    redis_url: str,
    tmp_path: Path,
) -> None:
    tansu = tansu_factory()
    taken, fresh = unique_stream("chk-taken"), unique_stream("chk")
    async with redis_client(redis_url) as client:
        await client.set(taken, "a string, not a stream")
    stream, exchange, topic = unique_name("chk"), unique_name("chk-x"), unique_topic("chk")
    queue = unique_name("chk-q")
    missing = {
        "stream": f"{unique_name('nostream')}.x",
        "exchange": unique_name("no-exchange"),
        "topic": unique_topic("no-topic"),
        "queue": unique_queue("no-queue", fifo=False),
        "pubsub": pubsub_server.unique_name("no-topic"),
        "sns": unique_sns_topic("no-topic", fifo=False),
        "kinesis": unique_kinesis_stream("no-stream"),
    }
    ps_topic, ps_reader = pubsub_server.unique_name("chk"), pubsub_server.unique_name("chk")
    await asyncio.to_thread(pubsub_server.create_topic, pubsub_emulator, ps_topic, ps_reader)
    sqs_queue = unique_queue("chk", fifo=False)
    await create_stream(nats_url, stream, [f"{stream}.>"])
    await create_topology(rabbitmq_url, exchange, queue)
    await create_topic(tansu.bootstrap, topic, partitions=1)
    async with (
        sqs_client(sqs_endpoint) as sqs,
        sns_client(sqs_endpoint) as sns,
        kinesis_client(sqs_endpoint) as kinesis,
    ):
        sqs_url = await create_queue(sqs, sqs_queue)
        sns_topic = (await sns.create_topic(Name=unique_sns_topic("chk", fifo=False)))["TopicArn"]
        sns_queue = await subscribed_queue(sns, sqs, sns_topic, unique_queue("chk-sns", False))
        stream_name = unique_kinesis_stream("chk")
        await kinesis.create_stream(StreamName=stream_name, ShardCount=1)
        brokers = {
            "nats": {"type": "nats", "servers": [nats_url]},
            "rabbit": {"type": "rabbitmq", "url": rabbitmq_url},
            "kafka": {
                "type": "kafka",
                "bootstrap_servers": [tansu.bootstrap],
                "enable_idempotence": False,
            },
            "sqs": {"type": "sqs", "region": REGION, "endpoint_url": sqs_endpoint},
            "pubsub": {
                "type": "pubsub",
                "project": pubsub_server.PROJECT,
                "emulator_host": pubsub_emulator,
            },
            "redis": {"type": "redis", "url": redis_url},
            "sns": {"type": "sns", "region": REGION, "endpoint_url": sqs_endpoint},
            "kinesis": {"type": "kinesis", "region": REGION, "endpoint_url": sqs_endpoint},
        }
        destinations = {
            f"{stream}.x": "nats",
            missing["stream"]: "nats",
            exchange: "rabbit",
            missing["exchange"]: "rabbit",
            topic: "kafka",
            missing["topic"]: "kafka",
            sqs_url: "sqs",
            missing["queue"]: "sqs",
            ps_topic: "pubsub",
            missing["pubsub"]: "pubsub",
            taken: "redis",
            fresh: "redis",  # not there yet: XADD creates it
            sns_topic: "sns",
            missing["sns"]: "sns",
            stream_name: "kinesis",
            missing["kinesis"]: "kinesis",
            "library.{aggregate_type}": "nats",
        }
        data = broker_config(migrated, brokers, destinations)
        try:
            result = await asyncio.to_thread(
                run_cli, ["check", "--config", str(save(tmp_path, data))]
            )
            assert result.returncode == 1, result.stderr
            said = "\n".join(errors(result.stderr))
            assert len(errors(result.stderr)) == 8, result.stderr
            assert (
                f"broker 'nats': no JetStream stream captures subject {missing['stream']!r}" in said
            )
            assert f"broker 'rabbit': exchange {missing['exchange']!r} does not exist" in said
            assert f"broker 'kafka': topic {missing['topic']!r} does not exist" in said
            assert f"broker 'sqs': queue {missing['queue']!r} does not exist" in said
            missing_topic = pubsub_server.topic_path(missing["pubsub"])
            assert f"broker 'pubsub': topic {missing_topic!r} does not exist" in said
            assert f"broker 'redis': key {taken!r} holds a string, not a stream" in said
            assert f"broker 'sns': topic {missing['sns']!r} does not exist" in said
            assert f"broker 'kinesis': stream {missing['kinesis']!r} does not exist" in said
            assert (
                "destination 'library.{aggregate_type}' depends on the event: checked at run time"
                in result.stderr
            )
            # Nothing was published on the destinations that exist, nor created on the others.
            assert await fetch_all(nats_url, stream) == []
            assert await QueueReader(rabbitmq_url, queue).fetch() == []
            assert await consume(tansu.bootstrap, topic, timeout=1) == []
            assert await receive_all(sqs, sqs_url) == []
            assert await pubsub_server.pull_all_async(pubsub_emulator, ps_reader, 0) == []
            async with redis_client(redis_url) as client:
                assert await client.exists(fresh, DEDUP_PREFIX + fresh) == 0
            assert await receive_all(sqs, sns_queue) == []
            shard = (await kinesis.list_shards(StreamName=stream_name))["Shards"][0]["ShardId"]
            iterator = await kinesis.get_shard_iterator(
                StreamName=stream_name, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
            )
            records = await kinesis.get_records(ShardIterator=iterator["ShardIterator"])
            assert records["Records"] == []
            again = await asyncio.to_thread(
                run_cli, ["check", "--config", str(save(tmp_path, data))]
            )
            assert errors(again.stderr) == errors(result.stderr)
        finally:
            await delete_stream(nats_url, stream)
            await delete_redis_stream(redis_url, taken)
            await delete_topology(rabbitmq_url, exchange, queue)
            await asyncio.to_thread(
                pubsub_server.delete_topic, pubsub_emulator, ps_topic, ps_reader
            )


# -- no tracebacks ----------------------------------------------------------------------------

COMMANDS = [
    ["status"],
    ["parked", "list", OUTBOX],
    ["parked", "drop", "--all"],
    ["replay", OUTBOX, "--from-start", "--timeout", "1"],
    ["retry-parked", OUTBOX, "--all", "--timeout", "1"],
    ["repartition", OUTBOX, "--partitions", "2"],
    ["migrate"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
async def test_a_database_error_is_one_line_in_every_command(
    command: list[str], roles: Callable[..., Awaitable[str]], tmp_path: Path
) -> None:
    dsn = await roles("REVOKE USAGE ON SCHEMA relay FROM {role}")
    data = config_dict(dsn, "nats://127.0.0.1:1", "library")
    data["logging"]["level"] = "info"  # at debug, the traceback is logged too, on purpose
    path = save(tmp_path, data)
    result = await asyncio.to_thread(run_cli, [*command, "--config", str(path)])
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert "permission denied for " in lines[0], lines  # migrate: CREATE on the database
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("where", ["refusing", "unreachable"])
async def test_status_names_the_database_address_without_the_password(
    where: str, pg_admin_dsn: str, tmp_path: Path
) -> None:
    host, port = postgres.address(pg_admin_dsn)
    if where == "unreachable":
        host, port = "127.0.0.1", 1
    dsn = f"postgresql://someone:pa55-secret@{host}:{port}/no_such_database_{uuid.uuid4().hex}"
    path = save(tmp_path, config_dict(dsn, "nats://127.0.0.1:1", "library"))
    result = await asyncio.to_thread(run_cli, ["status", "--config", str(path)])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    if where == "unreachable":
        assert lines[0].startswith(f"error: cannot reach the database at {host}:{port}: ")
    else:
        assert lines[0].startswith(f"error: the database at {host}:{port} refused the connection")
    assert "pa55-secret" not in result.stderr
    assert "Traceback" not in result.stderr


# -- relay run's log ------------------------------------------------------------------------


async def test_run_logs_a_start_up_line_and_a_dying_task_once_as_fields(
    roles: Callable[..., Awaitable[str]],
    migrated: str,
    nats_url: str,
    relay_process: Callable[..., RelayProcess],
    tmp_path: Path,
) -> None:
    dsn = await roles()
    path = save(tmp_path, config_dict(dsn, nats_url, unique_name("startup")))
    relay = relay_process(["run", "--config", str(path)])
    start = await relay.wait_for_log("relay starting")
    assert start["version"]
    assert start["replica"] == f"relay:{start['replica'].split(':')[1]}:{relay.pid}"
    assert start["config_file"] == str(path)
    assert start["outboxes"] == [OUTBOX]
    await relay.wait_for_log("lease acquired: relaying")

    # A right taken away while it runs: the outbox's task dies, and says why once.
    role = urlsplit(dsn).username
    await admin(migrated, f"REVOKE SELECT ON SEQUENCE events_position_seq FROM {role}")
    died = await relay.wait_for_log("task died, stopping the relay")
    assert await relay.wait_async() == 1
    # PostgreSQL refuses the read up to 17; from 18 on it reads NULL, which the relay refuses.
    error_type, _, message = died["error"].partition(": ")
    assert error_type in {"InsufficientPrivilegeError", "SourceError"}, died
    assert message.startswith("permission denied for sequence"), died
    (trace,) = died["exception"]
    assert trace["exc_type"] == error_type
    assert trace["frames"], trace
    assert all("locals" not in frame for frame in trace["frames"])
    assert sum("exception" in record for record in relay.logs()) == 1
    assert "Traceback" not in relay.output()


# -- config rules that used to wait for the adapter ------------------------------------------

BROKER_RULES = {
    "rabbitmq url not amqp": (
        {"type": "rabbitmq", "url": "http://guest:guest@rabbit.invalid/"},
        "brokers.b.url: must start with amqp:// or amqps://",
    ),
    "nats server not a nats url": (
        {"type": "nats", "servers": ["http://nats.invalid:4222"]},
        "brokers.b.servers: http:// is not a NATS URL scheme; use nats://, tls://, ws://, wss://",
    ),
    "nats creds file missing": (
        {"type": "nats", "servers": ["nats://nats.invalid:4222"], "creds_file": "/nope/x.creds"},
        "brokers.b.creds_file: no such file: /nope/x.creds",
    ),
    "tls file missing": (
        {
            "type": "kafka",
            "bootstrap_servers": ["k:9092"],
            "security_protocol": "SSL",
            "tls": {"ca_file": "/nope/ca.pem"},
        },
        "brokers.b.tls: cannot load the TLS files: [Errno 2] No such file or directory",
    ),
    "sqs endpoint not a url": (
        {"type": "sqs", "region": "eu-west-1", "endpoint_url": "localhost:4566"},
        "brokers.b.endpoint_url: must be an http:// or https:// URL with a host",
    ),
    "sns endpoint not a url": (
        {"type": "sns", "region": "eu-west-1", "endpoint_url": "localhost:4566"},
        "brokers.b.endpoint_url: must be an http:// or https:// URL with a host",
    ),
    "kinesis region malformed": (
        {"type": "kinesis", "region": "eu west 1"},
        "brokers.b.region: String should match pattern",
    ),
    "sqs region malformed": (
        {"type": "sqs", "region": "eu west 1"},
        "brokers.b.region: String should match pattern",
    ),
    "pubsub emulator host with a scheme": (
        {"type": "pubsub", "project": "library-prod", "emulator_host": "http://localhost:8085"},
        "brokers.b.emulator_host: must be host:port, without a scheme",
    ),
    "pubsub emulator with credentials": (
        {
            "type": "pubsub",
            "project": "library-prod",
            "emulator_host": "localhost:8085",
            "credentials_file": "/etc/hostname",
        },
        "brokers.b.emulator_host: the emulator takes no endpoint and no credentials_file",
    ),
    "pubsub credentials file missing": (
        {"type": "pubsub", "project": "library-prod", "credentials_file": "/nope/key.json"},
        "brokers.b.credentials_file: no such file: /nope/key.json",
    ),
    "redis url not redis": (
        {"type": "redis", "url": "http://redis.invalid:6380/0"},
        "brokers.b.url: must start with redis:// or rediss://",
    ),
    "redis tls without rediss": (
        {"type": "redis", "url": "redis://redis.invalid:6380/0", "tls": {}},
        "tls: needs a rediss:// url",
    ),
    "redis password twice": (
        {"type": "redis", "url": "redis://u:pw@redis.invalid:6380/0", "password": "other"},
        "password: the url has one too; give it in one place",
    ),
    "redis database not a number": (
        {"type": "redis", "url": "redis://redis.invalid:6380/cache"},
        "the path must be a database number",
    ),
    "http url names no field of a message": (
        {"type": "http", "url": "https://hooks.example.com/{aggregate_id}"},
        "brokers.b.url: {aggregate_id} is not a field of a message",
    ),
    "http signing key not whsec_": (
        {"type": "http", "signing_keys": ["plain-text-secret-of-some-length"]},
        "brokers.b.signing_keys.0: a signing key starts with whsec_",
    ),
}


@pytest.mark.parametrize("case", list(BROKER_RULES))
def test_broker_rules_are_config_errors_that_check_offline_reports(
    case: str, tmp_path: Path
) -> None:
    broker, message = BROKER_RULES[case]
    data = config_dict("postgresql://127.0.0.1:1/app", "nats://127.0.0.1:1", "library")
    data["brokers"] = {"b": broker}
    data["outboxes"]["loans"]["broker"] = "b"
    path = save(tmp_path, data)
    result = run_cli(["check", "--config", str(path), "--offline"])
    assert result.returncode == 2, result.stderr
    assert "relay.yaml:" in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def test_a_configured_stream_is_created_at_start_not_by_check(
    migrated: str, nats_url: str, tmp_path: Path
) -> None:
    name = unique_name("chk-own")
    stream = {"name": name, "subjects": [f"{name}.>"]}
    brokers = {"nats": {"type": "nats", "servers": [nats_url], "stream": stream}}
    data = broker_config(migrated, brokers, {f"{name}.loans": "nats"})
    result = await asyncio.to_thread(run_cli, ["check", "--config", str(save(tmp_path, data))])
    assert result.returncode == 0, result.stderr  # `relay run` will create it
    async with nats_connect(nats_url) as nc:
        with pytest.raises(NotFoundError):
            await nc.jetstream().stream_info(name)  # check created nothing

    data["brokers"]["nats"]["stream"]["create"] = False
    result = await asyncio.to_thread(run_cli, ["check", "--config", str(save(tmp_path, data))])
    assert result.returncode == 1
    assert errors(result.stderr) == [
        f"error: broker 'nats': stream {name!r} does not exist and stream.create is false",
        f"error: broker 'nats': no JetStream stream captures subject '{name}.loans': every"
        " message to it would be retried for ever; create a stream for it (or configure"
        " brokers.<name>.stream)",
    ]


async def test_last_shows_what_the_broker_adapter_would_park(
    migrated: str, tmp_path: Path, nats_url: str
) -> None:
    """An id NATS's client would rewrite, and a payload that fits max_payload only without
    its headers, are shown as parked with the words `relay run` parks them with; the
    server's max_payload is learnt by the probe."""
    async with nats_connect(nats_url) as nc:
        limit = nc.max_payload
    events = [
        ("book", "plain", 1, "BookLent", {"loanId": "L1"}),
        ("book", "\talice", 1, "BookLent", {"loanId": "L2"}),
        ("book", "big-" + "i" * 400, 1, "BookLent", {"loanId": "x" * (limit - 300)}),
    ]
    async with connect(migrated) as conn:
        await append_many(conn, events)
    stream = unique_name("CHECK")
    subject = stream.lower()
    await create_stream(nats_url, stream, [f"{subject}.>"])
    try:
        config = config_dict(migrated, nats_url, subject)
        path = save(tmp_path, config, f"{uuid.uuid4().hex}.yaml")
        result = await asyncio.to_thread(run_cli, ["check", "--config", str(path), "--last", "3"])
    finally:
        await delete_stream(nats_url, stream)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    plain = next(line for line in lines if "book/plain@1" in line)
    assert "->" in plain
    tab = next(line for line in lines if "#" in line and "alice" in line)
    assert "would be parked (rejected): broker 'nats': header Nats-Msg-Id holds a tab" in tab
    big = next(line for line in lines if "book/big-" in line and line.startswith("#"))
    assert "would be parked (rejected)" in big
    assert f"larger than the server's max_payload ({limit:,})" in big
