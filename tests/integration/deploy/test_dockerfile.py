"""The Dockerfile: hadolint, its shape (two stages, uid 10001, tini, the config path the
chart mounts) and every dependency of the image pinned in requirements.lock."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.deploy.chart import DOCKERFILE, image_distributions, run, tool

# Helm renders the chart; kubernetes-validate, promtool and hadolint check it: tools, not
# services, but seconds each, so not in the fast tier.
pytestmark = pytest.mark.integration


# -- Dockerfile -----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (parts[0].upper(), parts[1] if len(parts) > 1 else "")
        for line in joined.splitlines()
        if (parts := line.strip().split(None, 1))
    ]


OCI_LABELS = ("title", "version", "revision", "source", "created")


def test_hadolint_passes() -> None:
    hadolint = tool("hadolint", "hadolint")
    labels = [f"--require-label=org.opencontainers.image.{name}:text" for name in OCI_LABELS]
    result = run(hadolint, "--no-color", "--failure-threshold", "style", *labels, str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_dockerfile_shape() -> None:
    instructions = dockerfile_instructions()
    kinds = [kind for kind, _ in instructions]
    assert kinds.count("FROM") == 2, "multi-stage: a builder and a runtime"
    assert "HEALTHCHECK" not in kinds, "Kubernetes ignores HEALTHCHECK; the chart has probes"
    args = dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    runtime_start = max(i for i, kind in enumerate(kinds) if kind == "FROM")
    runtime = instructions[runtime_start:]

    def last(kind: str) -> str:
        return [arg for k, arg in runtime if k == kind][-1]

    assert last("USER") == "10001:10001"
    assert json.loads(last("ENTRYPOINT")) == ["tini", "--", "relay"]
    assert json.loads(last("CMD")) == ["run"]
    assert last("EXPOSE") == "9464"
    env = " ".join(arg for kind, arg in runtime if kind == "ENV")
    assert "RELAY_CONFIG=/etc/relay/relay.yaml" in env
    assert "PYTHONUNBUFFERED=1" in env
    labels = " ".join(arg for kind, arg in runtime if kind == "LABEL")
    for name in OCI_LABELS:
        assert f"org.opencontainers.image.{name}=" in labels
    runs = " ".join(arg for kind, arg in instructions if kind == "RUN")
    assert "-c requirements.lock '.[all]'" in runs
    assert re.search(r"tini=\S+", runs), "tini is pinned"
    # The Deployment relies on the image's ENTRYPOINT and on this config path.
    assert "RELAY_CONFIG=/etc/relay/relay.yaml" in env


def test_image_dependencies_are_all_pinned_in_the_lock() -> None:
    """Everything `pip install -c requirements.lock '.[all]'` brings in has a pin in the lock.

    Walks the installed metadata from the project's dependencies and broker extras.
    """
    seen = image_distributions()
    assert {"asyncpg", "nats-py", "aiokafka", "aio-pika", "aioboto3"} <= seen
    assert not seen & {"pytest", "mypy", "ruff", "moto"}, "test tools must stay out of the image"
