"""The chart's NetworkPolicy (networkPolicy.enabled): which pods it selects, the one port it
lets in, the ports it lets out (read from the relay's config), and what it refuses.

kubernetes-validate checks the rendered policies with the other manifests (test_chart.py,
scenario `network-policy`). No CNI runs here, so nothing is enforced: these tests check the
objects a cluster would be given.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.deploy.chart import (
    CUSTOM_CONFIG,
    FULL,
    RELEASE,
    container,
    custom,
    helm_python,
    objects,
    pod_spec,
    render,
    render_error,
)
from tests.integration.deploy.test_chart import MIGRATION_JOB, NETWORK_POLICY, PROMETHEUS

pytestmark = pytest.mark.integration

DNS_PORTS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
KUBE_DNS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
]


def tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def policies(chart: Any, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rendered NetworkPolicies by name."""
    found = objects(render(chart, values)).items()
    return {name: obj for (kind, name), obj in found if kind == "NetworkPolicy"}


def on(**network_policy: Any) -> dict[str, Any]:
    return {"enabled": True, **network_policy}


def test_off_by_default(chart: Any) -> None:
    for values in ({}, FULL, MIGRATION_JOB):
        assert policies(chart, values) == {}


def test_production_policy(chart: Any) -> None:
    objs = objects(render(chart, NETWORK_POLICY))
    policy = objs["NetworkPolicy", RELEASE]
    spec = policy["spec"]
    deployment = objs["Deployment", RELEASE]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert spec["podSelector"] == {"matchLabels": selector}
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    # The relay's pods and the `helm test` Pod are selected; the migration Job's pod is not.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    test_pod = objs["Pod", f"{RELEASE}-test-status"]
    assert selector.items() <= test_pod["metadata"]["labels"].items()
    job_labels = objs["Job", f"{RELEASE}-migrate"]["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= job_labels.items()

    # In: only the container port `http` (http.port 9500 of the config), from Prometheus.
    relay = container(pod_spec(objs), "relay")
    (http,) = relay["ports"]
    assert http["containerPort"] == 9500
    assert spec["ingress"] == [{"from": [PROMETHEUS], "ports": tcp(9500)}]

    # Out: DNS, the database, the NATS broker, and the extra rule, nothing else.
    egress = NETWORK_POLICY["networkPolicy"]["egress"]
    assert spec["egress"] == [
        {"to": KUBE_DNS, "ports": DNS_PORTS},
        {"to": egress["database"]["to"], "ports": tcp(5432)},
        {"to": egress["brokers"]["nats"]["to"], "ports": tcp(4222)},
        *NETWORK_POLICY["networkPolicy"]["extraEgress"],
    ]


def test_migration_job_gets_its_own_policy(chart: Any) -> None:
    objs = objects(render(chart, NETWORK_POLICY))
    name = f"{RELEASE}-migrate"
    policy, job = objs["NetworkPolicy", name], objs["Job", name]
    annotations = policy["metadata"]["annotations"]
    # There before the Job's pod starts (a pre-install hook of a lower weight), gone with it.
    assert annotations["helm.sh/hook"] == job["metadata"]["annotations"]["helm.sh/hook"]
    weight = "helm.sh/hook-weight"
    assert int(annotations[weight]) < int(job["metadata"]["annotations"][weight])
    assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    deployment_labels = objs["Deployment", RELEASE]["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= deployment_labels.items()
    # Nothing in; out to DNS and the database only: `relay migrate` talks to no broker.
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec.get("ingress", []) == []
    database = NETWORK_POLICY["networkPolicy"]["egress"]["database"]
    assert spec["egress"] == [
        {"to": KUBE_DNS, "ports": DNS_PORTS},
        {"to": database["to"], "ports": database["ports"]},
    ]
    # Without the Job (the init container runs in the relay's pods): no second policy.
    without = {**NETWORK_POLICY, "migrations": FULL["migrations"]}
    assert set(policies(chart, without)) == {RELEASE}


BROKERS = {
    "nats": {"type": "nats", "servers": ["nats://n1:4333", "tls://n2", "n3:4555", "wss://n4"]},
    "kafka": {"type": "kafka", "bootstrap_servers": "k1:9093,k2"},
    "rabbit": {"type": "rabbitmq", "url": "amqps://relay:${RABBIT_PASSWORD}@rabbit/vhost"},
    "aws": {"type": "sqs", "region": "eu-west-1"},
    "gcp": {"type": "pubsub", "project": "library-prod"},
    "moto": {"type": "sqs", "region": "eu-west-1", "endpoint_url": "http://moto:5000"},
    "redis": {"type": "redis", "url": "rediss://redis:6380/0", "password": "${REDIS_PASSWORD}"},
    "streams": {"type": "redis", "url": "redis://streams/1"},
    "topics": {"type": "sns", "region": "eu-west-1", "endpoint_url": "http://localstack:4566"},
    "kinesis": {"type": "kinesis", "region": "eu-west-1"},
}


@pytest.mark.parametrize(
    ("url", "ports"),
    [
        ("postgresql://relay:${PGPASSWORD}@db/app", [5432]),
        ("postgresql://relay:${PGPASSWORD}@pg-a:6432,pg-b/app?sslmode=require", [6432, 5432]),
        ("postgres:///app?host=db&port=5433,5434", [5433, 5434]),
        ("postgresql://relay:pw@${DB_HOST}:6543/app", [6543]),
        ("postgresql://relay:pw@[fd00::5]:5433/app", [5433]),
    ],
    ids=["default-port", "multi-host", "query-port", "host-from-env", "ipv6"],
)
def test_ports_come_from_the_config(chart: Any, url: str, ports: list[int]) -> None:
    kafka = [{"ipBlock": {"cidr": "10.40.0.0/24"}}]  # peers given, ports from the config
    values = {
        **custom(database={"url": url}, brokers=BROKERS),
        "networkPolicy": on(egress={"brokers": {"kafka": {"to": kafka}}}),
    }
    egress = policies(chart, values)[RELEASE]["spec"]["egress"]
    assert egress == [
        {"to": KUBE_DNS, "ports": DNS_PORTS},
        {"ports": tcp(*ports)},  # no `to`: any address, on these ports only
        # The brokers, by name: aws, gcp, kafka, kinesis, moto, nats, rabbit, redis, streams,
        # topics.
        {"ports": tcp(443)},
        {"ports": tcp(443)},  # pubsub.googleapis.com
        {"to": kafka, "ports": tcp(9093, 9092)},
        {"ports": tcp(443)},  # kinesis.eu-west-1.amazonaws.com
        {"ports": tcp(5000)},
        {"ports": tcp(4333, 4222, 4555, 443)},
        {"ports": tcp(5671)},
        {"ports": tcp(6380)},
        {"ports": tcp(6379)},
        {"ports": tcp(4566)},
    ]


def test_a_webhook_broker_gets_the_port_of_its_url_or_must_be_given_one(chart: Any) -> None:
    """`type: http`: the URL's port (443 for https://); a URL that starts with {destination}
    names its host per message, so the chart asks for the ports."""
    database = {"url": "postgresql://relay:${PGPASSWORD}@db/app"}
    hooks = {
        "a": {"type": "http", "url": "https://relay:${TOKEN}@hooks.example.com/in/{destination}"},
        "b": {"type": "http", "url": "http://hooks.internal:8080/{type}?key={key}"},
    }
    values = {**custom(database=database, brokers=hooks), "networkPolicy": on()}
    egress = policies(chart, values)[RELEASE]["spec"]["egress"]
    assert egress[2:] == [{"ports": tcp(443)}, {"ports": tcp(8080)}]
    anywhere = {"c": {"type": "http"}}
    values = {**custom(database=database, brokers=anywhere), "networkPolicy": on()}
    message = render_error(chart, values)
    assert "relay.config brokers.c.url starts with {destination}" in message
    assert "set networkPolicy.egress.brokers.c.ports" in message


def test_the_default_config_needs_the_database_port(chart: Any) -> None:
    """The example config reads database.url from ${DATABASE_URL}; its NATS port is known."""
    message = render_error(chart, {"networkPolicy": on()})
    assert "relay.config database.url takes its port from the environment" in message
    assert "set networkPolicy.egress.database.ports" in message
    values = {"networkPolicy": on(egress={"database": {"ports": tcp(5432)}})}
    egress = policies(chart, values)[RELEASE]["spec"]["egress"]
    assert egress[1:] == [{"ports": tcp(5432)}, {"ports": tcp(4222)}]
    # DNS can be left to other policies (for example a node-local cache).
    values["networkPolicy"]["egress"]["dns"] = {"enabled": False}
    assert policies(chart, values)[RELEASE]["spec"]["egress"] == [
        {"ports": tcp(5432)},
        {"ports": tcp(4222)},
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {**custom(), "networkPolicy": on(egress={"database": {"ports": tcp(5432)}})},
            "relay.config brokers.nats.servers takes its port from the environment (${VAR}) "
            "when the relay starts, so the NetworkPolicy cannot be rendered with it: set "
            "networkPolicy.egress.brokers.nats.ports, for example [{port: 4222, protocol: TCP}]",
        ),
        (
            {
                **custom(database={"url": "postgresql://relay:Secr3t-pw@db:${DB_PORT}/app"}),
                "networkPolicy": on(),
            },
            "relay.config database.url takes its port from the environment",
        ),
        (
            {
                **custom(
                    database={"url": "postgresql://relay:Secr3t-pw@db/app"},
                    brokers={"mq": {"type": "rabbitmq", "url": "${RABBIT_URL}"}},
                    outboxes={"orders": {**CUSTOM_CONFIG["outboxes"]["orders"], "broker": "mq"}},
                ),
                "networkPolicy": on(),
            },
            "relay.config brokers.mq.url takes its port from the environment",
        ),
        (
            {
                **custom(database={"url": "postgresql://relay:Secr3t-pw@db/app"}),
                "extraEnv": [
                    {
                        "name": "RELAY_DATABASE__URL",
                        "valueFrom": {"secretKeyRef": {"name": "db", "key": "url"}},
                    }
                ],
                "networkPolicy": on(egress={"brokers": {"nats": {"ports": tcp(4222)}}}),
            },
            "extraEnv RELAY_DATABASE__URL takes its port from the environment",
        ),
        (
            {
                **custom(database={"url": "postgresql://relay:Secr3t-pw@db/app"}),
                "networkPolicy": on(egress={"brokers": {"natz": {"ports": tcp(4222)}}}),
            },
            "networkPolicy.egress.brokers.natz: relay.config has no broker natz (its brokers: "
            "nats)",
        ),
    ],
    ids=["broker-from-env", "port-from-env", "rabbitmq-url-from-env", "env-override", "typo"],
)
def test_refuses_what_it_cannot_know(chart: Any, values: dict[str, Any], message: str) -> None:
    error = render_error(chart, values)
    assert message in error
    assert "Secr3t-pw" not in error, "the error must not print the URL (it holds a password)"


def test_schema_rejects_typos(chart: Any) -> None:
    assert helm_python is not None
    for values, where in [
        ({"networkPolicy": {"enable": True}}, "'enable' not allowed"),
        ({"networkPolicy": {"egress": {"databse": {}}}}, "'databse' not allowed"),
        (
            {"networkPolicy": {"ingress": {"from": [{"namespaceSelecter": {}}]}}},
            "'namespaceSelecter' not allowed",
        ),
        ({"networkPolicy": {"egress": {"database": {"ports": [{"port": 70000}]}}}}, "/port"),
        (
            {"networkPolicy": {"egress": {"brokers": {"nats": {"ports": [{"protocol": "TCP"}]}}}}},
            "missing property 'port'",
        ),
    ]:
        with pytest.raises(helm_python.HelmValuesError) as caught:
            chart.validate_schema(values)
        assert where in str(caught.value)
