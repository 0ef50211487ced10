"""`relay contract diff` used as a CI job would: two configs, two contract documents, the text
and `--json` output, and the exit codes (0 nothing breaking or unknown, 1 some, 2 bad input)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.relay_process import run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "relay.example.yaml"
ENV = {"DATABASE_URL": "postgresql://relay@127.0.0.1:1/app"}


def relay(*args: str | Path) -> tuple[int, str, str]:
    result = run_cli([str(a) for a in args], env=ENV)
    return result.returncode, result.stdout, result.stderr


def configs(tmp_path: Path) -> tuple[Path, Path]:
    """The example config, and one that drops memberId from v1 and adds a v2 beside it."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    text = EXAMPLE.read_text()
    old.write_text(text)
    assert "          memberId: data.memberId\n" in text
    new.write_text(
        text.replace("          memberId: data.memberId\n", "")
        + "      BookLentV2:\n"
        + "        type: library.book-lent.v2\n"
        + "        destination: library.loans.v2\n"
        + '        payload: {bookId: aggregate_id, member: "{id: data.memberId}"}\n'
    )
    return old, new


def test_two_configs_a_breaking_change_and_a_new_version(tmp_path: Path) -> None:
    old, new = configs(tmp_path)
    code, out, err = relay("contract", "diff", old, new)
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        "breaking: library.book-lent.v1 on library.loans at $.payload.memberId:"
        " `memberId` is gone; OLD requires it",
        "new: library.book-lent.v2 at $: a new message type, published to `library.loans.v2`,"
        " beside `library.book-lent.v1`: the documented way to make a breaking change"
        " (a new type, while consumers move)",
        "1 breaking, 1 new",
    ]


def test_two_contract_documents_as_json(tmp_path: Path) -> None:
    old, new = configs(tmp_path)
    assert relay("contract", "-c", old, "-o", tmp_path / "old-contract.yaml")[0] == 0
    assert relay("contract", "-c", new, "-f", "json", "-o", tmp_path / "new.json")[0] == 0
    code, out, _ = relay(
        "contract", "diff", tmp_path / "old-contract.yaml", tmp_path / "new.json", "--json"
    )
    assert code == 1
    changes = json.loads(out)
    assert [(c["message"], c["path"], c["verdict"]) for c in changes] == [
        ("library.book-lent.v1", "$.payload.memberId", "breaking"),
        ("library.book-lent.v2", "$", "new"),
    ]
    assert changes[0]["why"] == "`memberId` is gone; OLD requires it"
    assert changes[0]["channel"] == "library.loans"


def test_nothing_breaking_exits_0(tmp_path: Path) -> None:
    old, new = configs(tmp_path)
    assert relay("contract", "-c", old, "-o", tmp_path / "old-contract.yaml")[0] == 0
    code, out, _ = relay("contract", "diff", tmp_path / "old-contract.yaml", old)
    assert (code, out) == (0, "no changes: every message of OLD reaches its consumers as before\n")
    v2_only = old.read_text() + (
        "      BookLentV2:\n        type: library.book-lent.v2\n"
        "        destination: library.loans.v2\n"
    )
    new.write_text(v2_only)
    code, out, _ = relay("contract", "diff", old, new, "--json")
    assert code == 0
    assert [c["verdict"] for c in json.loads(out)] == ["new"]


def test_bad_input_exits_2_naming_the_file_and_key(tmp_path: Path) -> None:
    old, _ = configs(tmp_path)
    code, out, err = relay("contract", "diff", old, tmp_path / "missing.yaml")
    assert (code, out) == (2, "")
    assert f"cannot read {tmp_path / 'missing.yaml'}: No such file or directory" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("outboxes: [\n")
    code, _, err = relay("contract", "diff", broken, old)
    assert code == 2
    assert f"{broken} is not valid YAML or JSON" in err

    neither = tmp_path / "neither.json"
    neither.write_text('{"openapi": "3.1.0"}')
    code, _, err = relay("contract", "diff", old, neither)
    assert code == 2
    assert "is neither a contract (no `asyncapi` key) nor a relay config" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        old.read_text().replace("destination: library.loans\n", "destination: 'a.{'\n", 1)
    )
    code, _, err = relay("contract", "diff", old, bad)
    assert code == 2
    assert "bad.yaml:" in err
    assert "outboxes.loans-outbox.messages.BookLent.destination: unbalanced brace" in err


def test_contract_still_writes_the_document() -> None:
    code, out, _ = relay("contract", "-c", EXAMPLE)
    assert code == 0
    assert out.startswith("asyncapi: 3.0.0\n")
    assert "x-relay-rules:" in out


HOOK = """\
database: {url: "${DATABASE_URL}"}
brokers: {hook: {type: http, url: "%s"}}
outboxes:
  loans:
    broker: hook
    messages:
      BookLent: %s
"""
RULE = "{type: library.book-lent.v1, destination: loans, payload: {bookId: aggregate_id}}"
COPIES = (
    "[{type: library.book-lent.v1, destination: loans, payload: {bookId: aggregate_id},"
    ' id: "{aggregate_type}/{aggregate_id}@{version}"},'
    " {type: library.book-lent.v1, destination: loans, payload: data,"
    ' id: "{aggregate_type}/{aggregate_id}@{version}/legacy"}]'
)


def test_documents_carry_what_the_diff_compares(tmp_path: Path) -> None:
    """Written to files and read back: a webhook URL changed past its first placeholder, and a
    second rule of the type to the same destination (copies under another id, another
    shape), each exit 1; the URL's secret query value is in neither document."""
    url = "https://hooks.example.com/in/{type}?token=s3cret"
    sides = {
        "old": HOOK % (url, RULE),
        "url": HOOK % (url.replace("{type}", "{key}"), RULE),
        "copies": HOOK % (url, COPIES),
    }
    for name, text in sides.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        code, _, _ = relay("contract", "-c", tmp_path / f"{name}.yaml", "-o", tmp_path / name)
        assert code == 0
        assert "s3cret" not in (tmp_path / name).read_text()
    code, out, _ = relay("contract", "diff", tmp_path / "old", tmp_path / "url", "--json")
    assert code == 1
    assert [(c["path"], c["verdict"]) for c in json.loads(out)] == [
        ("$.channel.server", "breaking")
    ]
    code, out, _ = relay("contract", "diff", tmp_path / "old", tmp_path / "copies", "--json")
    assert code == 1
    found = {(c["path"], c["verdict"]) for c in json.loads(out)}
    assert {("$.id", "breaking"), ("$.payload.bookId", "breaking")} <= found
    code, out, _ = relay("contract", "diff", tmp_path / "copies", tmp_path / "copies")
    assert (code, out) == (0, "no changes: every message of OLD reaches its consumers as before\n")
