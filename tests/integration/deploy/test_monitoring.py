"""The chart's alert rules (`promtool check rules` and `promtool test rules` on
helm/outbox-relay/tests/alerts.test.yaml) and dashboard: real metric names, and runbook and
doc links that resolve."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.core.metrics import Metrics
from tests.integration.deploy.chart import (
    CHART,
    ROOT,
    rules_of,
    run,
    tool,
)

# Helm renders the chart; kubernetes-validate, promtool and hadolint check it: tools, not
# services, but seconds each, so not in the fast tier.
pytestmark = pytest.mark.integration


# -- Alert rules and dashboard ----------------------------------------------------------------


def test_alert_rules_pass_promtool(chart: Any, tmp_path: Path) -> None:
    promtool = tool("promtool")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules_of(chart)), encoding="utf-8")
    shutil.copy(CHART / "tests" / "alerts.test.yaml", tmp_path / "alerts.test.yaml")

    checked = run(promtool, "check", "rules", str(tmp_path / "rules.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 14 rules found" in checked.stdout

    tested = run(promtool, "test", "rules", str(tmp_path / "alerts.test.yaml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_unit_test() -> None:
    tests = yaml.safe_load((CHART / "tests" / "alerts.test.yaml").read_text(encoding="utf-8"))
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {
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
    assert firing == alerts
    assert quiet == alerts


def exposed_metric_names() -> set[str]:
    """Every sample name the relay's /metrics can expose."""
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"]}
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def test_rules_and_dashboard_use_real_metric_names(chart: Any) -> None:
    exposed = exposed_metric_names()
    exprs = [rule["expr"] for group in rules_of(chart)["groups"] for rule in group["rules"]]
    board = json.loads((CHART / "files" / "dashboard.json").read_text(encoding="utf-8"))
    exprs += [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    used = {
        name for expr in exprs for name in re.findall(r"\b(?:relay|process|python)_[a-z_]+\b", expr)
    }
    assert used, "no metric found in the rules and the dashboard"
    assert used <= exposed, f"not exposed by relay.core.metrics: {sorted(used - exposed)}"


def github_anchors(markdown: str) -> set[str]:
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_deploy_doc_links_resolve() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", text)
    assert links
    for page, anchor in links:
        target = ROOT / "docs" / page
        assert target.is_file(), f"docs/deploy.md links to a missing {page}"
        if anchor:
            assert anchor in github_anchors(target.read_text(encoding="utf-8")), f"{page}#{anchor}"


def test_runbook_links_point_at_operations_anchors(chart: Any) -> None:
    anchors = github_anchors((ROOT / "docs" / "operations.md").read_text(encoding="utf-8"))
    for group in rules_of(chart)["groups"]:
        for rule in group["rules"]:
            page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
            assert page == "docs/operations.md"
            assert anchor in anchors, f"{rule['alert']}: no heading #{anchor} in operations.md"
