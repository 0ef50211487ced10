"""How tests/support/pod.py turns a rendered container into a `buildah run`: the kubelet's
rules for command and args, env sources, the user, probe ports and volumes."""

from __future__ import annotations

import base64
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.support.pod import Pod, PodError, argv, environment, port_of, user, volume_mounts

IMAGE = {"Entrypoint": ["tini", "--", "relay"], "Cmd": ["run"]}


def pod(spec: dict[str, Any] | None = None, objects: dict[Any, Any] | None = None) -> Pod:
    return Pod(spec or {}, objects or {}, "relay-abc12", "relay")


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        ({}, ["tini", "--", "relay", "run"]),
        ({"args": ["migrate"]}, ["tini", "--", "relay", "migrate"]),
        ({"command": ["sh"]}, ["sh"]),
        ({"command": ["sh"], "args": ["-c", "true"]}, ["sh", "-c", "true"]),
    ],
    ids=["image", "args-replace-cmd", "command-drops-cmd", "both"],
)
def test_command_and_args_over_the_image(container: dict[str, Any], expected: list[str]) -> None:
    assert argv(container, IMAGE) == expected


def test_env_resolves_values_the_pod_fields_and_both_forms_of_a_secret() -> None:
    objects = {
        ("Secret", "s"): {
            "stringData": {"DATABASE_URL": "postgresql://a"},
            "data": {"NATS_PASSWORD": base64.b64encode(b"pw").decode()},
        }
    }
    container = {
        "name": "relay",
        "env": [
            {"name": "LEVEL", "value": "debug"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {
                "name": "DATABASE_URL",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "DATABASE_URL"}},
            },
            {
                "name": "NATS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "NATS_PASSWORD"}},
            },
        ],
    }
    assert environment(pod(objects=objects), container) == {
        "LEVEL": "debug",
        "POD_NAME": "relay-abc12",
        "NS": "relay",
        "DATABASE_URL": "postgresql://a",
        "NATS_PASSWORD": "pw",
    }


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"secretKeyRef": {"name": "gone", "key": "K"}}, "Secret gone is not among"),
        ({"secretKeyRef": {"name": "s", "key": "OTHER"}}, "Secret s has no key OTHER"),
        ({"fieldRef": {"fieldPath": "status.podIP"}}, "fieldRef status.podIP"),
        ({"configMapKeyRef": {"name": "c", "key": "k"}}, "unsupported source"),
    ],
    ids=["no-secret", "no-key", "field", "config-map-key"],
)
def test_what_it_cannot_resolve_is_an_error_naming_it(entry: dict[str, Any], words: str) -> None:
    objects = {("Secret", "s"): {"stringData": {"K": "v"}}}
    container = {"name": "relay", "env": [{"name": "X", "valueFrom": entry}]}
    with pytest.raises(PodError, match=words):
        environment(pod(objects=objects), container)


def test_the_user_is_the_containers_over_the_pods() -> None:
    spec = {"securityContext": {"runAsUser": 10001, "runAsGroup": 10001}}
    assert user(pod(spec), {"name": "relay"}) == "10001:10001"
    assert user(pod(spec), {"name": "relay", "securityContext": {"runAsUser": 5}}) == "5:10001"
    with pytest.raises(PodError, match="no runAsUser"):
        user(pod(), {"name": "relay"})


def test_a_probe_port_by_name_is_the_named_container_port() -> None:
    container = {
        "ports": [{"name": "http", "containerPort": 9500}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9600}},
    }
    assert port_of(container, "readinessProbe") == (9500, "/readyz")
    assert port_of(container, "livenessProbe") == (9600, "/healthz")


def test_a_config_map_becomes_readable_files_and_an_empty_dir_a_writable_folder(
    tmp_path: Path,
) -> None:
    spec = {
        "volumes": [
            {"name": "config", "configMap": {"name": "cm"}},
            {"name": "tmp", "emptyDir": {}},
        ]
    }
    objects = {("ConfigMap", "cm"): {"data": {"relay.yaml": "http: {port: 1}\n"}}}
    container = {
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/relay", "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ]
    }
    mounts = volume_mounts(pod(spec, objects), container, tmp_path)
    assert [path for _, path in mounts] == ["/etc/relay", "/tmp"]
    config, tmp = (host for host, _ in mounts)
    assert (config / "relay.yaml").read_text() == "http: {port: 1}\n"
    assert stat.S_IMODE((config / "relay.yaml").stat().st_mode) == 0o644
    assert stat.S_IMODE(tmp.stat().st_mode) == 0o777
