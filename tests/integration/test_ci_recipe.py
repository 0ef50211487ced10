"""The CI gate docs/contracts.md gives (docs/ci/github-actions-relay-gate.yml), its `relay`
commands run as the workflow runs them: a compatible change of the config passes both steps,
a change that breaks a consumer fails the first, one that old events break fails the second."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.db import append, append_many, connect
from tests.support.scenario import config_dict, loans, save

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "docs" / "ci" / "github-actions-relay-gate.yml"


def relay_steps() -> list[dict[str, Any]]:
    """The workflow's steps that run the relay, in order."""
    workflow = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers["pull_request"]["paths"] == ["deploy/relay.yaml"]
    (job,) = workflow["jobs"].values()
    return [s for s in job["steps"] if str(s.get("run", "")).startswith("relay ")]


def run_gate(workdir: Path, database_url: str) -> list[int]:
    """Each relay step's exit code, run in `workdir` as the runner would run it (RUNNER_TEMP
    holding the base branch's config, DATABASE_URL the step's own: the event store's copy)."""
    codes = []
    for step in relay_steps():
        env = {**os.environ, "RUNNER_TEMP": str(workdir / "tmp")}
        step_env = step.get("env", {})
        url = step_env.get("DATABASE_URL", "")
        env["DATABASE_URL"] = database_url if url.startswith("${{") else url
        # The step's shell expands "${RUNNER_TEMP}"; `relay` is this checkout's.
        command = step["run"].replace("${RUNNER_TEMP}", env["RUNNER_TEMP"])
        words = shlex.split(command, posix=True)
        assert words[0] == "relay"
        done = subprocess.run(
            [sys.executable, "-m", "relay", *words[1:]],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        codes.append(done.returncode)
    return codes


def library_config(workdir: Path, name: str, **lent: Any) -> None:
    """A config (DATABASE_URL from the environment, as the workflow gives it) where BookLent
    is published with `lent`'s changes."""
    rule = {
        "type": "library.book-lent.v1",
        "destination": "library.loans",
        "payload": {"bookId": "aggregate_id", "loanId": "data.loanId"},
        **lent,
    }
    data = config_dict("${DATABASE_URL}", "nats://127.0.0.1:1", "library", messages={})
    data["outboxes"]["loans"]["messages"] = {"BookLent": rule}
    save(workdir, data, name)


async def test_the_gate_passes_a_compatible_change_and_fails_each_breaking_kind(
    events_table: str, tmp_path: Path
) -> None:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "deploy").mkdir()
    library_config(tmp_path / "tmp", "relay.base.yaml")
    async with connect(events_table) as conn:
        await append_many(conn, loans(20))
        await append(conn, "book", "old", 1, "BookLent", {})  # before loanId was written

    assert len(relay_steps()) == 2
    # A new message beside the old one: nothing breaks, and every old event maps.
    library_config(tmp_path / "deploy", "relay.yaml")
    assert run_gate(tmp_path, events_table) == [0, 0]
    # A field removed from a message consumers read: the contract step fails.
    library_config(tmp_path / "deploy", "relay.yaml", payload={"bookId": "aggregate_id"})
    assert run_gate(tmp_path, events_table)[0] == 1
    # A schema the oldest events do not meet: the history step fails.
    schema = {"type": "object", "properties": {"loanId": {"type": "string"}}}
    library_config(tmp_path / "deploy", "relay.yaml", schema=schema)
    assert run_gate(tmp_path, events_table)[1] == 1
