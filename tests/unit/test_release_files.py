"""The release's files agree with pyproject.toml, the version's one source.

A release bumps `[project] version` and nothing else should need remembering: every other
place that states the version (the image's build argument, the chart's appVersion, the
deploy page's build command, the changelog's newest entry) fails here until it follows.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

import relay

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
VERSION: str = PYPROJECT["project"]["version"]
# `outbox-relay:0.2.0` (an image tag) and `VERSION=0.2.0` (the build argument), as written in
# the Dockerfile and in docs/deploy.md's build command.
STATED = re.compile(r"outbox-relay:(\d+\.\d+\.\d+\S*)|\bVERSION=(\d+\.\d+\.\d+\S*)")


def stated_versions(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [tag or arg for tag, arg in STATED.findall(text)]


def test_the_installed_package_reports_pyprojects_version() -> None:
    """relay/__init__.py reads the installed metadata: a stale install shows up here."""
    assert relay.__version__ == VERSION


def test_the_image_and_its_docs_state_pyprojects_version() -> None:
    for path in (ROOT / "Dockerfile", ROOT / "docs" / "deploy.md"):
        found = stated_versions(path)
        assert found, f"{path.name} no longer states the image's version"
        assert set(found) == {VERSION}, f"{path.name}: {found}, pyproject.toml says {VERSION}"
    deploy = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    assert f"| `VERSION` | `{VERSION}` |" in deploy


def test_the_chart_runs_pyprojects_version() -> None:
    chart = yaml.safe_load((ROOT / "helm/outbox-relay/Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == VERSION


def test_the_changelog_starts_with_this_release_and_says_how_to_upgrade() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "[Keep a Changelog](https://keepachangelog.com/" in text
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, flags=re.M)
    assert releases, "CHANGELOG.md has no `## [x.y.z] - YYYY-MM-DD` heading"
    assert releases[0] == VERSION, f"the newest entry is {releases[0]}, pyproject says {VERSION}"
    entries = re.split(r"^## \[", text, flags=re.M)[1:]
    for entry in entries:
        assert "\n### Upgrading\n" in entry, f"[{entry.split(']')[0]}] has no Upgrading part"


def test_package_data_names_only_files_that_exist() -> None:
    """A pattern left behind by a move (migrations/*.sql) would ship nothing and mislead."""
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package, patterns in package_data.items():
        folder = ROOT / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"package-data {package}: {pattern} matches nothing"
    assert "py.typed" in package_data["relay"]


def test_the_license_file_is_the_one_pyproject_declares() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text.splitlines()[1]
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
