"""The Helm chart: its default and production renders, what it refuses, its schema and README,
and the manifests validated against the Kubernetes schemas of the oldest supported and the
newest bundled version (kubernetes-validate)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.config.config_schema import chart_config_schema, config_schema
from relay.config.config_schema import render as render_schema
from tests.integration.deploy.chart import (
    CHART,
    CUSTOM_CONFIG,
    DOCKERFILE,
    FULL,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    RELEASE,
    VERSION,
    container,
    custom,
    env_of,
    grace_seconds,
    helm_python,
    objects,
    pod_spec,
    render,
    render_error,
    run,
    secret_ref,
    tool,
)
from tests.support.relay_process import run_cli

# Helm renders the chart; kubernetes-validate, promtool and hadolint check it: tools, not
# services, but seconds each, so not in the fast tier.
pytestmark = pytest.mark.integration


# -- The chart with its default values --------------------------------------------------------


def test_chart_versions_follow_the_project() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == VERSION
    docker_version = re.search(r"^ARG VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert docker_version is not None and docker_version.group(1) == VERSION


def test_helm_lint_is_clean(chart: Any) -> None:
    assert helm_python is not None
    for values in ({}, FULL, MIGRATION_JOB, NETWORK_POLICY):
        report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE)
        assert report["errors"] == []
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert problems == [], problems


def test_default_render(chart: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = render(chart)
    objs = objects(manifests)
    assert set(objs) == {
        ("ConfigMap", RELEASE),
        ("Secret", RELEASE),
        ("ServiceAccount", RELEASE),
        ("Service", RELEASE),
        ("Deployment", RELEASE),
        ("PodDisruptionBudget", RELEASE),
        ("Pod", f"{RELEASE}-test-status"),
    }, "monitoring objects must be off by default"

    deployment = objs["Deployment", RELEASE]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    selector = deployment["spec"]["selector"]["matchLabels"]
    template = deployment["spec"]["template"]
    assert selector.items() <= template["metadata"]["labels"].items()
    spec = template["spec"]
    relay = container(spec, "relay")
    assert relay["image"] == f"outbox-relay:{VERSION}"
    assert relay["args"] == ["run"]
    assert "command" not in relay, "the image's ENTRYPOINT (tini -- relay) must stay"

    # Probes: liveness on the relay's loop, readiness on the database, both on `http`.
    (port,) = relay["ports"]
    assert port == {"name": "http", "containerPort": 9464, "protocol": "TCP"}
    assert relay["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert relay["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    service = objs["Service", RELEASE]["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [
        {"name": "http", "port": 9464, "targetPort": "http", "protocol": "TCP"}
    ]
    assert service["selector"] == selector

    # Secure defaults.
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for c in (relay, container(spec, "migrate", "initContainers")):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/etc/relay"] == {
            "name": "config",
            "mountPath": "/etc/relay",
            "readOnly": True,
        }
        assert mounts["/tmp"]["name"] == "tmp"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["tmp"]
    assert volumes["config"]["configMap"]["name"] == RELEASE
    assert objs["ServiceAccount", RELEASE]["automountServiceAccountToken"] is False
    assert spec["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == RELEASE
    assert relay["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert relay["resources"]["limits"] == {"memory": "256Mi"}

    # Identity and config: POD_NAME from the pod's name, the file where RELAY_CONFIG says.
    env = env_of(relay)
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["RELAY_CONFIG"]["value"] == "/etc/relay/relay.yaml"
    config_text = objs["ConfigMap", RELEASE]["data"]["relay.yaml"]

    # Shutdown: the kubelet's grace outlasts the relay's.
    assert spec["terminationGracePeriodSeconds"] == 30
    assert spec["terminationGracePeriodSeconds"] > grace_seconds(config_text, tmp_path, monkeypatch)

    # ${DATABASE_URL} comes from the chart's Secret.
    assert secret_ref(env["DATABASE_URL"]) == (RELEASE, "DATABASE_URL")
    assert objs["Secret", RELEASE]["type"] == "Opaque"

    # The migration runs first, with the same config, identity and secrets.
    migrate = container(spec, "migrate", "initContainers")
    assert migrate["args"] == ["migrate"]
    assert migrate["image"] == relay["image"]
    assert env_of(migrate) == env

    # Spread over nodes, without blocking scheduling.
    (spread,) = spec["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"] == selector

    # A standby is Ready, so with 2 replicas one pod may go at a time.
    pdb = objs["PodDisruptionBudget", RELEASE]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert "minAvailable" not in pdb
    assert pdb["selector"]["matchLabels"] == selector

    # The pods roll when the config changes: the checksum is the ConfigMap's.
    annotations = template["metadata"]["annotations"]
    configmap_text = manifests[f"{RELEASE}/templates/configmap.yaml"]
    assert annotations["checksum/config"] == hashlib.sha256(configmap_text.encode()).hexdigest()
    assert "checksum/secret" in annotations

    # NOTES warn that the Secret has no DATABASE_URL yet.
    assert "secret.values.DATABASE_URL is not set" in manifests[f"{RELEASE}/templates/NOTES.txt"]


def test_helm_test_hook_runs_relay_status_like_the_pods(chart: Any) -> None:
    for values in ({}, FULL):
        objs = objects(render(chart, values))
        hook = objs["Pod", f"{RELEASE}-test-status"]
        assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert "hook-succeeded" in hook["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        spec = hook["spec"]
        assert spec["restartPolicy"] == "Never"
        (status,) = spec["containers"]
        assert status["args"] == ["status"]
        relay = container(pod_spec(objs), "relay")
        assert status["image"] == relay["image"]
        assert env_of(status) == env_of(relay)
        assert status["volumeMounts"] == relay["volumeMounts"]
        assert spec["volumes"] == pod_spec(objs)["volumes"]
        assert spec["securityContext"] == pod_spec(objs)["securityContext"]
        assert status["securityContext"] == relay["securityContext"]


# -- Non-default values ----------------------------------------------------------------------


def test_production_values(chart: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifests = render(chart, FULL)
    objs = objects(manifests)
    assert ("Secret", RELEASE) not in objs, "existingSecret: the chart creates no Secret"
    deployment = objs["Deployment", RELEASE]
    assert deployment["spec"]["replicas"] == 3
    template = deployment["spec"]["template"]
    spec = template["spec"]
    assert "checksum/secret" not in template["metadata"]["annotations"]
    assert spec["terminationGracePeriodSeconds"] == 60

    relay = container(spec, "relay")
    assert relay["image"] == "registry.example.com/outbox-relay:0.1.0-rc1"
    assert relay["imagePullPolicy"] == "Always"
    assert relay["resources"] == FULL["resources"]

    # The custom config, valid for the relay, with its http.port and grace period.
    config_text = objs["ConfigMap", RELEASE]["data"]["relay.yaml"]
    assert yaml.safe_load(config_text) == CUSTOM_CONFIG
    assert grace_seconds(config_text, tmp_path, monkeypatch) == 45.0
    assert relay["ports"] == [{"name": "http", "containerPort": 9500, "protocol": "TCP"}]
    assert relay["livenessProbe"]["httpGet"]["port"] == "http"

    # Each ${VAR} without a default comes from the existing Secret, under secretKeys' name;
    # ${NATS_URL:-...} has a default and is left alone.
    env = env_of(relay)
    assert secret_ref(env["DATABASE_URL"]) == ("relay-credentials", "database-url")
    assert secret_ref(env["NATS_PASSWORD"]) == ("relay-credentials", "nats-password")
    assert "NATS_URL" not in env
    assert env["RELAY_LOGGING__LEVEL"] == {"name": "RELAY_LOGGING__LEVEL", "value": "debug"}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"

    # The migration uses its own DATABASE_URL (a role that may create the schema).
    migrate_env = env_of(container(spec, "migrate", "initContainers"))
    assert secret_ref(migrate_env["DATABASE_URL"]) == ("relay-migrator", "database-url")
    assert secret_ref(migrate_env["NATS_PASSWORD"]) == ("relay-credentials", "nats-password")

    monitor = objs["ServiceMonitor", RELEASE]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert (
        monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    assert objs["Service", RELEASE]["metadata"]["labels"].items() >= (
        monitor["spec"]["selector"]["matchLabels"].items()
    )

    rule = objs["PrometheusRule", RELEASE]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = rule["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {
        "RelayNoLeaseHolder",
        "RelayMoreThanOneHolder",
        "RelayLeaseFlapping",
        "RelayLagHigh",
        "RelayParkedMessages",
        "RelayOutboxHalted",
        "RelayPartitionsMismatch",
        "RelayUnexpectedDuplicates",
        "RelayPublishErrors",
        "RelayBarrierStuck",
        "RelayStandbysMissing",
        "RelayAuditMissing",
        "RelayAuditStuck",
    }
    (lag,) = [r for r in rules if r["alert"] == "RelayLagHigh"]
    assert lag["expr"].strip().endswith("> 120")
    for r in rules:
        assert {"summary", "description", "runbook_url"} <= r["annotations"].keys()
        assert 'namespace="relay",job="outbox-relay"' in r["expr"]

    dashboard = objs["ConfigMap", f"{RELEASE}-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["outbox-relay.json"])
    titles = " / ".join(p["title"] for p in board["panels"]).lower()
    for topic in (
        "lease holders",
        "publish rate",
        "lag",
        "parked",
        "failures",
        "p50 / p99",
        "barrier wait",
        "memory by pod",
        "cpu by pod",
        "restarts by pod",
    ):
        assert topic in titles


def test_created_secret_holds_every_value(chart: Any) -> None:
    values = {
        "secret": {
            "values": {
                "DATABASE_URL": "postgresql://relay:pw@db/app",
                "AWS_ACCESS_KEY_ID": "AKIA",
            }
        }
    }
    manifests = render(chart, values)
    objs = objects(manifests)
    assert objs["Secret", RELEASE]["stringData"] == values["secret"]["values"]
    env = env_of(container(pod_spec(objs), "relay"))
    assert secret_ref(env["DATABASE_URL"]) == (RELEASE, "DATABASE_URL")
    assert secret_ref(env["AWS_ACCESS_KEY_ID"]) == (RELEASE, "AWS_ACCESS_KEY_ID")
    assert "WARNING" not in manifests[f"{RELEASE}/templates/NOTES.txt"]

    # Changing a secret value rolls the pods too.
    changed = {"secret": {"values": {**values["secret"]["values"], "AWS_ACCESS_KEY_ID": "AKIB"}}}
    before = objs["Deployment", RELEASE]["spec"]["template"]["metadata"]["annotations"]
    after = objects(render(chart, changed))["Deployment", RELEASE]["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert before["checksum/secret"] != after["checksum/secret"]
    assert before["checksum/config"] == after["checksum/config"]


def test_checksum_follows_the_config_only(chart: Any) -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = objects(render(chart, values))["Deployment", RELEASE]
        value: str = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        return value

    base = checksum(custom())
    assert checksum(custom(logging={"level": "debug", "format": "json"})) != base
    assert checksum({**custom(), "replicaCount": 5, "resources": {}}) == base
    assert checksum({}) != base
    # A new `partitions` rolls the pods: the fleet changes the outbox over by itself once
    # the last old pod has gone (docs/scaling.md), with no hook and no hand-run step.
    orders = {**CUSTOM_CONFIG["outboxes"]["orders"], "partitions": 4}
    assert checksum(custom(outboxes={"orders": orders})) != base


# -- What the chart refuses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"terminationGracePeriodSeconds": 10}, "must be larger than the relay's shutdown"),
        (
            {"relay": {"config": {**CUSTOM_CONFIG, "shutdown": {"grace_period": "1m"}}}},
            "terminationGracePeriodSeconds (30) must be larger than the relay's "
            "shutdown.grace_period (60s)",
        ),
        (
            {"extraEnv": [{"name": "RELAY_SHUTDOWN__GRACE_PERIOD", "value": "40s"}]},
            "shutdown.grace_period (40s)",
        ),
        (
            custom(http={"enabled": False}),
            "http.enabled is false",
        ),
        (
            custom(http={"host": "127.0.0.1"}),
            "loopback",
        ),
        ({"secret": {"create": False}}, "relay.config uses ${DATABASE_URL}, but nothing sets it"),
        (
            {"existingSecret": "creds", "secret": {"values": {"DATABASE_URL": "x"}}},
            "secret.values is set, but existingSecret is used",
        ),
        ({"secretKeys": {"DATABASE_URL": "url"}}, "existingSecret, which is not set"),
    ],
    ids=[
        "grace-equal",
        "grace-minutes",
        "grace-env-override",
        "http-off",
        "http-loopback",
        "no-secret",
        "values-with-existing-secret",
        "secret-keys-without-existing-secret",
    ],
)
def test_render_refuses(chart: Any, values: dict[str, Any], message: str) -> None:
    assert message in render_error(chart, values)


def test_grace_period_in_milliseconds_passes(chart: Any) -> None:
    values = {**custom(shutdown={"grace_period": "500ms"}), "terminationGracePeriodSeconds": 1}
    objs = objects(render(chart, values))
    assert pod_spec(objs)["terminationGracePeriodSeconds"] == 1


def test_schema_rejects_typos_and_wrong_types(chart: Any) -> None:
    assert helm_python is not None
    chart.validate_schema({})
    chart.validate_schema(FULL)
    for values, where in [
        ({"replicas": 3}, "'replicas' not allowed"),
        ({"replicaCount": "3"}, "/replicaCount"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"serviceMonitor": {"enabled": "yes"}}, "/serviceMonitor/enabled"),
        ({"secret": {"values": {"database-url": "x"}}}, "database-url"),
        ({"prometheusRule": {"alerts": {"lagHigh": {"treshold": 1}}}}, "'treshold' not allowed"),
        ({"relay": {"config": {"shutdown": {"grace_period": "ten"}}}}, "grace_period"),
    ]:
        with pytest.raises(helm_python.HelmValuesError) as caught:
            chart.validate_schema(values)
        assert where in str(caught.value)
    # Rendering applies the schema too, as `helm install` does.
    with pytest.raises(helm_python.HelmValuesError):
        chart.render({"replicas": 3}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_migration_job_replaces_the_init_container(chart: Any) -> None:
    objs = objects(render(chart, MIGRATION_JOB))
    name = f"{RELEASE}-migrate"
    spec = pod_spec(objs)
    assert "initContainers" not in spec, "with the Job, the pods do not migrate"
    relay = container(spec, "relay")
    assert relay["image"] == f"registry.example.com/outbox-relay@{DIGEST}"

    job = objs["Job", name]
    config, secret = objs["ConfigMap", name], objs["Secret", name]
    for hooked in (job, config, secret):
        annotations = hooked["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    # The copies exist before the Job starts (a lower weight), hold what the release's do.
    weight = "helm.sh/hook-weight"
    assert int(config["metadata"]["annotations"][weight]) < int(
        job["metadata"]["annotations"][weight]
    )
    assert config["data"] == objs["ConfigMap", RELEASE]["data"]
    assert secret["stringData"] == objs["Secret", RELEASE]["stringData"]
    assert job["metadata"]["annotations"]["team"] == "payments"

    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod, "the chart's ServiceAccount is not there yet"
    (migrate,) = pod["containers"]
    assert migrate["args"] == ["migrate"]
    assert migrate["image"] == relay["image"]
    assert migrate["securityContext"] == relay["securityContext"]
    # Only the Job has the migrator's credentials; the rest comes from the Secret's copy.
    env = env_of(migrate)
    assert secret_ref(env["DATABASE_URL"]) == ("relay-migrator", "database-url")
    assert secret_ref(env_of(relay)["DATABASE_URL"]) == (RELEASE, "DATABASE_URL")
    assert {m["mountPath"] for m in migrate["volumeMounts"]} == {"/etc/relay", "/tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == name
    # The Service and the PodDisruptionBudget must not count the Job's pod.
    selector = objs["Deployment", RELEASE]["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()

    # An existing Secret exists before the install: the Job reads it, no copy is made.
    existing = {
        **MIGRATION_JOB,
        "secret": {},
        "existingSecret": "relay-credentials",
        "migrations": {"job": {"enabled": True}},
    }
    objs = objects(render(chart, existing))
    assert ("Secret", name) not in objs
    (migrate,) = objs["Job", name]["spec"]["template"]["spec"]["containers"]
    assert secret_ref(env_of(migrate)["DATABASE_URL"]) == ("relay-credentials", "DATABASE_URL")

    # Off (the default) or with migrations disabled: no Job.
    for values in ({}, {"migrations": {"enabled": False, "job": {"enabled": True}}}):
        assert not any(kind == "Job" for kind, _ in objects(render(chart, values)))


def test_image_digest_wins_over_the_tag(chart: Any) -> None:
    assert helm_python is not None
    values = {"image": {"repository": "r.example/relay", "tag": "0.1.0", "digest": DIGEST}}
    objs = objects(render(chart, values))
    spec = pod_spec(objs)
    images = {
        container(spec, "relay")["image"],
        container(spec, "migrate", "initContainers")["image"],
        objs["Pod", f"{RELEASE}-test-status"]["spec"]["containers"][0]["image"],
    }
    assert images == {f"r.example/relay@{DIGEST}"}
    with pytest.raises(helm_python.HelmValuesError) as caught:
        chart.validate_schema({"image": {"digest": "latest"}})
    assert "/image/digest" in str(caught.value)


def test_chart_readme_names_every_value() -> None:
    """Every key of values.yaml, down to its leaves, except inside Kubernetes objects that
    are passed through whole (documented as such)."""
    passed_whole = {"podSecurityContext", "securityContext", "resources", "strategy"}
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))

    def keys(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and path not in passed_whole:
                yield from keys(value, f"{path}.")
            else:
                yield path

    missing = [path for path in keys(values) if f"`{path}`" not in readme]
    assert not missing, f"helm/outbox-relay/README.md does not name {missing}"


def test_chart_icon_is_the_svg_in_the_chart() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    svg = (CHART / "icon.svg").read_bytes()
    assert meta["icon"] == "data:image/svg+xml;base64," + base64.b64encode(svg).decode()
    assert svg.startswith(b"<svg") and b"viewBox" in svg


def test_chart_schema_embeds_the_relays_config_schema() -> None:
    """values.schema.json holds `relay config-schema` for relay.config: `python3 dev.py schema`
    writes it again after a change to the config models."""
    values_schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    embedded = values_schema["properties"]["relay"]["properties"]["config"]
    printed = run_cli(["config-schema"])
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == render_schema(config_schema())
    assert embedded == chart_config_schema(json.loads(printed.stdout)), (
        "helm/outbox-relay/values.schema.json is out of date: run `python3 dev.py schema`"
    )


def test_chart_refuses_a_typo_inside_an_outbox(chart: Any) -> None:
    assert helm_python is not None
    outbox = CUSTOM_CONFIG["outboxes"]["orders"]
    for typo, where in [
        ({**outbox, "mesages": outbox["messages"]}, "mesages"),
        ({**outbox, "park_after": "ten"}, "park_after"),
        ({**outbox, "batch": {"max_bytes": "4 parsecs"}}, "max_bytes"),
    ]:
        values = custom(outboxes={"orders": typo})
        with pytest.raises(helm_python.HelmValuesError) as caught:
            chart.validate_schema(values)
        assert where in str(caught.value)
        with pytest.raises(helm_python.HelmValuesError):
            chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    # What the relay accepts passes: ${VAR} anywhere, durations and sizes as text, the
    # chart's example, and an empty relay.config (the example is used).
    fine = {**outbox, "park_after": "${PARK_AFTER:-10}", "batch": {"max_bytes": "4MiB"}}
    chart.validate_schema(custom(outboxes={"orders": fine}))
    example = yaml.safe_load((CHART / "files" / "relay.example.yaml").read_text(encoding="utf-8"))
    chart.validate_schema({"relay": {"config": example}})
    chart.validate_schema({"relay": {"config": {}}})


def test_packaged_chart_leaves_out_the_rule_tests(chart: Any) -> None:
    names = {f["name"] for f in chart.files}
    assert "files/relay.example.yaml" in names
    assert not any(name.startswith("tests/") for name in names)


# -- kubernetes-validate ------------------------------------------------------------------------


DIGEST = "sha256:" + "0123456789abcdef" * 4

# The migration as a hook Job, and the image pinned by digest.
MIGRATION_JOB: dict[str, Any] = {
    "image": {"repository": "registry.example.com/outbox-relay", "digest": DIGEST},
    "secret": {"values": {"DATABASE_URL": "postgresql://relay:pw@db/app"}},
    "migrations": {
        "job": {"enabled": True, "annotations": {"team": "payments"}},
        "extraEnv": [
            {
                "name": "DATABASE_URL",
                "valueFrom": {"secretKeyRef": {"name": "relay-migrator", "key": "database-url"}},
            }
        ],
    },
}

# The production values with the NetworkPolicy on: the config's database URL and NATS server
# come from the environment, so their ports are given; Prometheus alone may scrape.
PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
NETWORK_POLICY: dict[str, Any] = {
    **FULL,
    "migrations": {**FULL["migrations"], "job": {"enabled": True}},
    "networkPolicy": {
        "enabled": True,
        "ingress": {"from": [PROMETHEUS]},
        "egress": {
            "database": {
                "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                "ports": [{"port": 5432, "protocol": "TCP"}],
            },
            "brokers": {
                "nats": {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "messaging"}
                            },
                            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}},
                        }
                    ],
                    "ports": [{"port": 4222, "protocol": "TCP"}],
                }
            },
        },
        "extraEgress": [
            {
                "to": [{"ipBlock": {"cidr": "10.30.0.5/32"}}],
                "ports": [{"port": 4317, "protocol": "TCP"}],
            }
        ],
    },
}

SCENARIOS = {
    "default": {},
    "production": FULL,
    "migration-job": MIGRATION_JOB,
    "network-policy": NETWORK_POLICY,
}


@pytest.mark.parametrize("kubernetes", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_manifests_validate_against_kubernetes(
    chart: Any, tmp_path: Path, scenario: str, kubernetes: str
) -> None:
    validate = tool("kubernetes-validate")
    manifests = render(chart, SCENARIOS[scenario])
    files = []
    resources = 0
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml") and text.strip():
            file = tmp_path / path.replace("/", "_")
            file.write_text(text, encoding="utf-8")
            files.append(str(file))
            resources += sum(1 for doc in yaml.safe_load_all(text) if doc)
    result = run(validate, "--strict", "--kubernetes-version", kubernetes, *files)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ERROR" not in output
    # Only the Prometheus Operator's objects lack a bundled schema.
    unknown = re.findall(r"Couldn't find schema for kind (\w+)", output)
    assert set(unknown) <= {"ServiceMonitor", "PrometheusRule"}, output
    assert output.count("passed for resource") == resources - len(unknown)
