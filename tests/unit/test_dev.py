"""dev.py brings what the tests need where it can, and says what is missing where it cannot."""

from __future__ import annotations

import subprocess
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
