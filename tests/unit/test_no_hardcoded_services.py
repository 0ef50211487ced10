"""Tests reach services only through the fixtures, so that embedded mode keeps its promise.

`python3 dev.py test` must pass on a machine without a PostgreSQL, NATS or RabbitMQ of its
own: the fixtures (tests/conftest.py, tests/support/) then start embedded servers on ports of
their choosing, and RELAY_TEST_EMBEDDED=1 forces that mode. A test that writes the machine's
address itself (`"127.0.0.1", 5432`) passes on a developer's machine and in CI, where those
services run, and fails only on the machine the promise is for. Running the whole suite a
second time in embedded mode would catch it too, at about ten minutes per run; this scan
catches the same mistake in milliseconds, on every run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
# The only places that may know the machine's services: they fall back to embedded ones.
ALLOWED = [TESTS / "conftest.py", TESTS / "support", Path(__file__).resolve()]
PORTS = {5432: "PostgreSQL", 4222: "NATS", 5672: "RabbitMQ", 6379: "Redis"}
LOOPBACK = re.compile(r"(?:127\.0\.0\.1|localhost|\[::1\]):(5432|4222|5672|6379)\b")
# Files whose loopback URLs and service ports are text that is never connected to.
TEXT_ONLY = {
    TESTS
    / "unit"
    / "test_config.py": "config files that are loaded and validated, never connected to",
    TESTS
    / "integration"
    / "test_secrets.py": "URLs refused before any connection, and redaction cases",
    **dict.fromkeys(
        (
            TESTS / "integration" / "deploy" / name
            for name in ("test_chart.py", "test_network_policy.py", "test_pod_security.py")
        ),
        "configs rendered into manifests (a NetworkPolicy's ports), never connected to",
    ),
}


# What each finding below is written with (ports in decimal): a file without any has none, and is
# not parsed (parsing every test file was most of this scan's 1.7 s).
_CANDIDATES = re.compile(r"5432|4222|5672|6379|MACHINE_")


def hard_coded(path: Path) -> list[str]:
    """Service ports, loopback service addresses and machine-service constants in a file."""
    text = path.read_text(encoding="utf-8")
    if not _CANDIDATES.search(text):
        return []
    tree = ast.parse(text, str(path))
    defaults = {  # `parts.port or 5672`: the default port of a URL that names none
        id(node.values[-1]) for node in ast.walk(tree) if isinstance(node, ast.BoolOp)
    }
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value in PORTS:
            if id(node) not in defaults and path not in TEXT_ONLY:
                found.append(f"{line}: port {node.value} ({PORTS[node.value]})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = LOOPBACK.search(node.value)
            if match and path not in TEXT_ONLY:
                found.append(f"{line}: address {match.group(0)}")
        elif isinstance(node, ast.Name | ast.alias | ast.Attribute):
            name = {ast.Name: "id", ast.alias: "name", ast.Attribute: "attr"}[type(node)]
            if str(getattr(node, name)).startswith("MACHINE_"):
                found.append(f"{line}: {getattr(node, name)}, the machine's own server")
    return sorted(found, key=lambda entry: int(entry.split(":", 1)[0]))


def test_tests_reach_services_only_through_the_fixtures() -> None:
    files = [
        path
        for path in sorted(TESTS.rglob("*.py"))
        if not any(path == allowed or allowed in path.parents for allowed in ALLOWED)
    ]
    assert TESTS / "integration" / "test_failover.py" in files
    found = {str(path.relative_to(TESTS.parent)): hard_coded(path) for path in files}
    found = {path: lines for path, lines in found.items() if lines}
    assert not found, (
        "hard-coded service addresses: use the fixtures' DSN or URL instead (for example "
        f"tests.support.postgres.address(dsn)), so that embedded mode works: {found}"
    )


def test_the_scan_finds_what_broke_embedded_mode(tmp_path: Path) -> None:
    """The line that made the network-cut test fail without a Postgres on 5432, and kin."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        'host, port = "127.0.0.1", 5432\n'
        'URL = "nats://localhost:4222"\n'
        "from tests.support.postgres import MACHINE_DSN\n"
        "port = parts.port or 5672\n"  # a default, not an address: allowed
    )
    assert hard_coded(sample) == [
        "1: port 5432 (PostgreSQL)",
        "2: address localhost:4222",
        "3: MACHINE_DSN, the machine's own server",
    ]
