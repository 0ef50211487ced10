"""Every pod the chart renders meets the Pod Security Standards' Restricted profile (which
includes Baseline), checked control by control by tests/integration/deploy/pod_security.py:
no API server is available here to admit the pods into a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.integration.deploy.chart import RELEASE, objects, render
from tests.integration.deploy.pod_security import Pod, Violation, pods, violations
from tests.integration.deploy.test_chart import SCENARIOS

pytestmark = pytest.mark.integration

DEPLOYMENT = f"Deployment/{RELEASE}"
TEST_POD = f"Pod/{RELEASE}-test-status"
JOB = f"Job/{RELEASE}-migrate"
CONTAINERS = {DEPLOYMENT: {"relay", "migrate"}, TEST_POD: {"relay-status"}, JOB: {"migrate"}}

DEFAULT_POD = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
DEFAULT_CONTAINER = {
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def rendered_pods(chart: Any, values: dict[str, Any]) -> list[Pod]:
    return pods(objects(render(chart, values)))


def names(pod: Pod) -> set[str]:
    return {c["name"] for c in pod.containers()}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_pod_meets_the_restricted_profile(chart: Any, scenario: str) -> None:
    found = rendered_pods(chart, SCENARIOS[scenario])
    # The checker saw every pod spec: the relay's (with its init container unless the
    # migration is a Job), the `helm test` Pod, and the migration Job's.
    expected = {DEPLOYMENT, TEST_POD}
    if any(p.manifest == JOB for p in found):
        expected.add(JOB)
        assert names(next(p for p in found if p.manifest == DEPLOYMENT)) == {"relay"}
    else:
        assert names(next(p for p in found if p.manifest == DEPLOYMENT)) == {"relay", "migrate"}
    assert {p.manifest for p in found} == expected
    problems = [str(v) for p in found for v in violations(p)]
    assert problems == []


def with_container(**changes: Any) -> dict[str, Any]:
    return {"securityContext": {**DEFAULT_CONTAINER, **changes}}


def with_pod(**changes: Any) -> dict[str, Any]:
    return {"podSecurityContext": {**DEFAULT_POD, **changes}}


def without(mapping: dict[str, Any], key: str) -> dict[str, Any]:
    """`mapping` with `key` removed: Helm merges values over the defaults, and null deletes."""
    return {**mapping, key: None}


HOST = {"volumes": [{"name": "host", "hostPath": {"path": "/var/run"}}]}
NFS = {"volumes": [{"name": "share", "nfs": {"server": "nfs.example", "path": "/relay"}}]}

# Values that a careless override could give, and the control each breaks. `None` as the
# container: a pod-level field.
CASES: list[tuple[str, dict[str, Any], str, str, str | None]] = [
    ("privileged", with_container(privileged=True), "baseline", "Privileged Containers", "relay"),
    (
        "sys-admin",
        with_container(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        "baseline",
        "Capabilities",
        "relay",
    ),
    (
        "chown",  # allowed by Baseline, not by Restricted
        with_container(capabilities={"drop": ["ALL"], "add": ["CHOWN"]}),
        "restricted",
        "Capabilities",
        "relay",
    ),
    (
        "no-drop-all",
        with_container(capabilities={"drop": ["NET_RAW"]}),
        "restricted",
        "Capabilities",
        "relay",
    ),
    ("host-path", HOST, "baseline", "HostPath Volumes", None),
    ("nfs", NFS, "restricted", "Volume Types", None),
    (
        "apparmor-annotation",
        {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/relay": "unconfined"}},
        "baseline",
        "AppArmor",
        "relay",
    ),
    (
        "apparmor-field",
        with_container(appArmorProfile={"type": "Unconfined"}),
        "baseline",
        "AppArmor",
        "relay",
    ),
    ("selinux-type", with_pod(seLinuxOptions={"type": "spc_t"}), "baseline", "SELinux", None),
    (
        "selinux-user",
        with_container(seLinuxOptions={"user": "root"}),
        "baseline",
        "SELinux",
        "relay",
    ),
    ("proc-mount", with_container(procMount="Unmasked"), "baseline", "/proc Mount Type", "relay"),
    (
        "seccomp-unconfined",
        with_pod(seccompProfile={"type": "Unconfined"}),
        "baseline",
        "Seccomp",
        None,
    ),
    (
        "no-seccomp",
        {"podSecurityContext": without(DEFAULT_POD, "seccompProfile")},
        "restricted",
        "Seccomp",
        "relay",
    ),
    (
        "unsafe-sysctl",
        with_pod(sysctls=[{"name": "kernel.msgmax", "value": "65536"}]),
        "baseline",
        "Sysctls",
        None,
    ),
    (
        "host-process",
        with_container(windowsOptions={"hostProcess": True}),
        "baseline",
        "HostProcess",
        "relay",
    ),
    (
        "escalation",
        with_container(allowPrivilegeEscalation=True),
        "restricted",
        "Privilege Escalation",
        "relay",
    ),
    (
        "escalation-unset",
        {"securityContext": without(DEFAULT_CONTAINER, "allowPrivilegeEscalation")},
        "restricted",
        "Privilege Escalation",
        "relay",
    ),
    (
        "run-as-root-allowed",
        {
            "podSecurityContext": without(DEFAULT_POD, "runAsNonRoot"),
            "securityContext": without(DEFAULT_CONTAINER, "runAsNonRoot"),
        },
        "restricted",
        "Running as Non-root",
        "relay",
    ),
    (
        "container-says-root",
        with_container(runAsNonRoot=False),
        "restricted",
        "Running as Non-root",
        "relay",
    ),
    ("uid-0", with_pod(runAsUser=0), "restricted", "Running as Non-root user", None),
]


@pytest.mark.parametrize(
    ("values", "profile", "control", "container"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_checker_names_what_an_override_breaks(
    chart: Any, values: dict[str, Any], profile: str, control: str, container: str | None
) -> None:
    """The chart passes securityContext, podSecurityContext, volumes and podAnnotations
    through; the checker catches each way they can leave the profile, and says where."""
    found = [v for p in rendered_pods(chart, values) for v in violations(p)]
    hits = [
        v for v in found if (v.profile, v.control, v.container) == (profile, control, container)
    ]
    assert hits, f"no {profile} / {control} for {container}; found: {[str(v) for v in found]}"
    assert DEPLOYMENT in {v.manifest for v in hits}
    for violation in hits:
        text = str(violation)
        assert control in text and violation.manifest in text
        if container is not None:
            # A securityContext reaches every container of every pod the chart makes.
            assert f"container {container}" in text
    if "securityContext" in values and container is not None:
        hit = {(v.manifest, v.container) for v in found if v.control == control}
        for manifest, containers in CONTAINERS.items():
            if manifest != JOB:
                assert {(manifest, name) for name in containers} <= hit


def mutated(chart: Any, change: dict[str, Any], container: dict[str, Any] | None = None) -> Pod:
    """The relay's rendered pod with fields no value of the chart can set."""
    (deployment,) = [p for p in rendered_pods(chart, {}) if p.manifest == DEPLOYMENT]
    spec = copy.deepcopy(deployment.spec)
    spec.update(change)
    relay = next(c for c in spec["containers"] if c["name"] == "relay")
    relay.update(container or {})
    return Pod(deployment.manifest, deployment.annotations, spec)


@pytest.mark.parametrize(
    ("change", "in_container", "control", "where"),
    [
        ({"hostNetwork": True}, None, "Host Namespaces", None),
        ({"hostPID": True}, None, "Host Namespaces", None),
        (
            {},
            {"ports": [{"name": "http", "containerPort": 9464, "hostPort": 9464}]},
            "Host Ports",
            "relay",
        ),
        (
            {},
            {"livenessProbe": {"httpGet": {"host": "10.0.0.1", "path": "/healthz", "port": 80}}},
            "Host Probes / Lifecycle Hooks",
            "relay",
        ),
        (
            {},
            {"lifecycle": {"preStop": {"tcpSocket": {"host": "db", "port": 5432}}}},
            "Host Probes / Lifecycle Hooks",
            "relay",
        ),
    ],
    ids=["host-network", "host-pid", "host-port", "probe-host", "hook-host"],
)
def test_checker_catches_what_no_value_can_set(
    chart: Any,
    change: dict[str, Any],
    in_container: dict[str, Any] | None,
    control: str,
    where: str | None,
) -> None:
    found = violations(mutated(chart, change, in_container))
    assert [(v.control, v.container) for v in found] == [(control, where)]


def test_checker_allows_what_the_profile_allows(chart: Any) -> None:
    """Not stricter than the profile: these pass Restricted."""
    allowed = [
        with_container(capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}),
        with_pod(seccompProfile={"type": "Localhost", "localhostProfile": "relay.json"}),
        with_pod(sysctls=[{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]),
        with_pod(seLinuxOptions={"type": "container_t", "level": "s0:c1,c2"}),
        {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/relay": "localhost/x"}},
        # runAsNonRoot and seccomp on every container instead of the pod.
        {
            "podSecurityContext": without(without(DEFAULT_POD, "runAsNonRoot"), "seccompProfile"),
            "securityContext": {**DEFAULT_CONTAINER, "seccompProfile": {"type": "RuntimeDefault"}},
        },
        {"volumes": [{"name": "creds", "secret": {"secretName": "nats-creds"}}]},
    ]
    for values in allowed:
        found: list[Violation] = [v for p in rendered_pods(chart, values) for v in violations(p)]
        assert found == [], values
