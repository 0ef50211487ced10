"""dev.py brings what the tests need where it can, and says what is missing where it cannot."""

from __future__ import annotations

import subprocess
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


def test_buildah_and_mmdebstrap_are_installed_where_apt_runs_as_root() -> None:
    assert dev.image_tools_plan(found=True, root=True, apt=True) is None
    assert dev.image_tools_plan(found=False, root=True, apt=True) == "install"
    for root, apt in ((False, True), (True, False), (False, False)):
        advice = dev.image_tools_plan(found=False, root=root, apt=apt)
        assert advice is not None and "apt-get install buildah mmdebstrap" in advice
    assert dev.INSTALL_IMAGE_TOOLS[-2:] == ["buildah", "mmdebstrap"]


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
