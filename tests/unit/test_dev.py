"""dev.py brings what the tests need where it can, and says what is missing where it cannot."""

from __future__ import annotations

import subprocess
import sys
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


def test_node_is_installed_only_where_it_is_missing_and_apt_runs_as_root() -> None:
    assert dev.node_plan(found=True, root=True, apt=True) is None
    assert dev.node_plan(found=False, root=True, apt=True) == "install"
    for root, apt in ((False, True), (True, False), (False, False)):
        advice = dev.node_plan(found=False, root=root, apt=apt)
        assert advice is not None and "apt-get install nodejs npm" in advice
    assert dev.INSTALL_NODE[:2] == ["apt-get", "install"] and "nodejs" in dev.INSTALL_NODE


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
