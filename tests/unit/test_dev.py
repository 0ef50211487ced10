"""dev.py brings what the tests need where it can, and says what is missing where it cannot."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import dev
from tests.support.rabbitmq_server import SERVER_SCRIPT


def test_nothing_to_do_once_rabbitmq_server_is_installed() -> None:
    for port_taken in (True, False):
        assert dev.rabbitmq_plan(installed=True, port_taken=port_taken, root=True, apt=True) is None


def test_root_with_apt_and_a_free_port_installs_it() -> None:
    assert dev.rabbitmq_plan(installed=False, port_taken=False, root=True, apt=True) == "install"


@pytest.mark.parametrize(
    ("port_taken", "root", "apt", "expected"),
    [
        (True, True, True, "those that start a private node"),
        (False, False, True, "`apt-get install rabbitmq-server` as root"),
        (False, True, False, "rabbitmq-server package), or run one on 127.0.0.1"),
    ],
    ids=["a-server-on-5672", "not-root", "no-apt"],
)
def test_otherwise_it_says_what_to_install(
    port_taken: bool, root: bool, apt: bool, expected: str
) -> None:
    plan = dev.rabbitmq_plan(installed=False, port_taken=port_taken, root=root, apt=apt)
    assert plan is not None
    assert plan != "install"
    assert "apt-get install rabbitmq-server" in plan or "Debian's rabbitmq-server" in plan
    assert expected in plan


def test_install_updates_the_package_lists_when_the_first_try_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried: list[list[str]] = []
    checked: list[list[str]] = []

    def call(command: list[str], **_: Any) -> int:
        tried.append(command)
        return 100  # apt-get: "Unable to locate package", the lists are stale

    def check(command: list[str], *_: Any, **__: Any) -> None:
        checked.append(command)

    monkeypatch.setattr(subprocess, "call", call)
    monkeypatch.setattr(dev, "check", check)
    dev.install_rabbitmq()
    install = ["apt-get", "install", "-y", "--no-install-recommends", "rabbitmq-server"]
    assert tried == [install]
    assert checked == [["apt-get", "update", "-qq"], install]


def test_dev_py_looks_for_the_server_the_fixtures_start() -> None:
    assert dev.RABBITMQ_SERVER == SERVER_SCRIPT


def test_dev_py_names_a_missing_pubsub_emulator_where_the_fixture_looks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.support import pubsub_server

    assert dev.PUBSUB_EMULATOR == pubsub_server.DEFAULT_EMULATOR
    missing = tmp_path / "cloud-pubsub-emulator"
    monkeypatch.setenv("RELAY_TEST_PUBSUB_EMULATOR", str(missing))
    dev.ensure_pubsub_emulator()
    said = capsys.readouterr().err
    assert f"no Pub/Sub emulator at {missing}" in said
    assert "apt-get install google-cloud-cli-pubsub-emulator" in said
    missing.write_text("#!/bin/sh\n")
    dev.ensure_pubsub_emulator()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("plan", "advice", "command"),
    [
        (dev.node_plan, "apt-get install nodejs npm", dev.INSTALL_NODE),
        (dev.image_tools_plan, "apt-get install buildah mmdebstrap", dev.INSTALL_IMAGE_TOOLS),
        (dev.chromium_plan, "apt-get install chromium chromium-driver", dev.INSTALL_CHROMIUM),
    ],
)
def test_tools_are_installed_only_where_missing_and_apt_runs_as_root(
    plan: Callable[..., str | None], advice: str, command: list[str]
) -> None:
    assert plan(found=True, root=True, apt=True) is None
    assert plan(found=False, root=True, apt=True) == "install"
    for root, apt in ((False, True), (True, False), (False, False)):
        said = plan(found=False, root=root, apt=apt)
        assert said is not None and advice in said
    packages = advice.removeprefix("apt-get install ").split()
    assert command[:2] == ["apt-get", "install"] and command[-len(packages) :] == packages


def test_the_base_is_named_after_the_command_that_makes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = dev.base_name()
    assert first == dev.base_name(), "the same command finds the cached base"
    monkeypatch.setattr(dev, "BASE_COMMAND", [*dev.BASE_COMMAND[:-1], "trixie"])
    assert dev.base_name() != first
    assert first.startswith("localhost/outbox-relay-base:")


def test_the_build_gets_the_version_and_base_and_mounts_only_host_settings_that_exist(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    present = tmp_path / "pip.conf"
    present.write_text("[global]\n")
    monkeypatch.setattr(dev, "HOST_SETTINGS", [str(present), str(tmp_path / "absent")])
    command = dev.build_command("localhost/base:1", "localhost/outbox-relay:9.9.9")
    assert command[:4] == ["buildah", "bud", "--isolation", "chroot"]
    assert f"{present}:{present}:ro" in command
    assert not [arg for arg in command if "absent" in arg]
    args = [command[i + 1] for i, arg in enumerate(command) if arg == "--build-arg"]
    assert "PYTHON_IMAGE=localhost/base:1" in args
    assert f"VERSION={dev.project_version()}" in args
    assert command[command.index("--tag") + 1] == "localhost/outbox-relay:9.9.9"
    assert dev.image_name() == f"localhost/outbox-relay:{dev.project_version()}"


# -- the venv: what each command installs, and pip's output ---------------------------------


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """dev.py's venv in tmp_path, with the pip commands it would run recorded, not run."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    monkeypatch.setattr(dev, "PYTHON", python)
    monkeypatch.setattr(dev, "STAMP", tmp_path / "stamp")
    installs: list[list[str]] = []
    monkeypatch.setattr(dev, "install", lambda command, what: installs.append(command))
    return installs


def extras(installs: list[list[str]]) -> list[str]:
    return [next(arg for arg in command if arg.startswith(".[")) for command in installs]


def test_the_demo_installs_its_extra_only_and_the_tests_add_theirs(venv: list[list[str]]) -> None:
    dev.ensure_venv("demo")
    assert extras(venv) == [".[demo]"]
    assert "-c" in venv[0] and "requirements.lock" in venv[0]
    dev.ensure_venv("demo")
    dev.ensure_venv("test")
    dev.ensure_venv("demo")  # the test extra holds the demo's: nothing to do
    dev.ensure_venv("test")
    assert extras(venv) == [".[demo]", ".[test]"]


def test_a_changed_pyproject_or_lock_installs_again(
    venv: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    dev.ensure_venv("test")
    dev.STAMP.write_text(dev.STAMP.read_text().replace("\n", "0\n", 1))  # another digest
    dev.ensure_venv("demo")
    dev.ensure_venv("demo")
    assert extras(venv) == [".[test]", ".[demo]"]


def test_pip_goes_to_its_log_and_the_terminal_gets_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dev, "PIP_LOG", tmp_path / "pip.log")
    pip = "\n".join(
        [
            "Collecting asyncpg>=0.29 (from outbox-relay==0.2.0)",
            "Processing /opt/pypi/files/structlog-26.1.0-py3-none-any.whl (from outbox-relay)",
            "Requirement already satisfied: nats-py>=2.7 in ./.venv/lib (from outbox-relay)",
            "Installing collected packages: asyncpg, structlog",
            "Successfully installed asyncpg-0.32.0 structlog-26.1.0",
        ]
    )
    dev.install([sys.executable, "-c", f"print({pip!r})"], "the demo")
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dev.py: installing the demo (pip's log: ")
    assert err.rstrip().endswith("3 packages")
    log = (tmp_path / "pip.log").read_text()
    assert "Processing /opt/pypi/files/structlog" in log and "Successfully installed" in log


def test_a_failing_pip_shows_the_tail_of_its_log_and_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dev, "PIP_LOG", tmp_path / "pip.log")
    failing = "print('\\n'.join(f'line {n}' for n in range(100))); raise SystemExit(3)"
    with pytest.raises(SystemExit) as exit_:
        dev.install([sys.executable, "-c", failing], "the demo")
    assert exit_.value.code == 3
    err = capsys.readouterr().err
    assert "FAILED (exit code 3)" in err
    assert "line 99" in err and f"line {99 - dev.LOG_TAIL}" not in err
    assert f"its whole output is in {tmp_path / 'pip.log'}" in err
    assert "line 0" in (tmp_path / "pip.log").read_text()


def test_the_matrix_runs_every_cell_and_names_each_that_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    runs: list[str] = []

    def call(command: list[str], env: dict[str, str] | None = None, label: str = "") -> int:
        runs.append(f"{label} RELAY_TEST_POSTGRES={(env or {}).get('RELAY_TEST_POSTGRES')}")
        return 1 if label.startswith(("PostgreSQL 16", "Python 3.12")) else 0

    monkeypatch.setattr(dev, "check", lambda *args, **kwargs: None)
    monkeypatch.setattr(dev, "call", call)
    monkeypatch.setattr(dev, "python_venv", lambda v: None if v == "3.13" else tmp_path)
    monkeypatch.setattr(dev, "other_pythons", lambda: ["3.12", "3.13"])
    assert dev.matrix() == 1
    assert runs == [
        *(f"PostgreSQL {m}: the SQL suites RELAY_TEST_POSTGRES={m}" for m in dev.MATRIX_POSTGRES),
        "Python 3.12: the unit tier and smoke RELAY_TEST_POSTGRES=None",
    ]
    said = capsys.readouterr().err.splitlines()[-1]
    assert said == (
        "dev.py: FAILED on PostgreSQL 16, Python 3.12, Python 3.13 (not found) (see each run above)"
    )


def test_the_matrix_passes_quietly_when_every_cell_passes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(dev, "check", lambda *args, **kwargs: None)
    monkeypatch.setattr(dev, "call", lambda *args, **kwargs: 0)
    monkeypatch.setattr(dev, "python_venv", lambda v: tmp_path)
    assert dev.matrix() == 0
    assert "FAILED" not in capsys.readouterr().err


def test_every_suite_the_matrix_names_exists() -> None:
    """A renamed file or test would otherwise drop out of the matrix unnoticed.

    ONLY_IN_THE_MAIN_RUN names tests by the start of their names, as pytest's --deselect does.
    """
    suites = [entry for suites in dev.MATRIX_POSTGRES.values() for entry in suites]
    for entry in [*suites, *dev.ONLY_IN_THE_MAIN_RUN, *dev.SMOKE]:
        path, _, test = entry.partition("::")
        assert (dev.ROOT / path).exists(), entry
        if test:
            assert f"def {test}" in (dev.ROOT / path).read_text(), entry
    assert set(dev.ON_PRIVATE_SERVERS) <= set(dev.SQL_SUITES)


def test_the_other_pythons_are_the_supported_ones_but_the_main_runs() -> None:
    others = dev.other_pythons()
    assert len(others) == len(dev.SUPPORTED_PYTHONS) - 1
    assert f"{sys.version_info.major}.{sys.version_info.minor}" not in others


def test_pythons_are_found_in_pyenv_where_its_shims_would_refuse(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    interpreter = tmp_path / "versions" / "3.12.1" / "bin" / "python3.12"
    interpreter.parent.mkdir(parents=True)
    interpreter.touch()
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert dev.find_python("3.12") == str(interpreter)
    assert dev.find_python("3.13") is None


def test_redis_server_is_installed_only_where_it_can_start() -> None:
    assert dev.redis_plan(found=True, port_taken=True, root=True, apt=True) is None
    assert dev.redis_plan(found=False, port_taken=False, root=True, apt=True) == "install"
    taken = dev.redis_plan(found=False, port_taken=True, root=True, apt=True)
    assert taken is not None and "apt-get install redis-server" in taken
    assert "as root" not in str(
        dev.redis_plan(found=False, port_taken=False, root=False, apt=False)
    )
