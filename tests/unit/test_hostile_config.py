"""Config files written carelessly or with malice: every error names its key, never a secret.

Literal secrets in the file are allowed, so every error path of loading is tried with one in
it; a file built to exhaust the loader (aliases of aliases, thousands of levels) is refused.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from relay.config import NOTIFY_CHANNEL_MAX, NatsBrokerConfig, load_config
from relay.config.yaml_file import MAX_DEPTH, MAX_VALUES
from relay.errors import ConfigError
from tests.support.hostile_configs import (
    BROKEN,
    DUPLICATED,
    OLD,
    SECRET,
    leaked,
    nats,
)


def refused(tmp_path: Path, text: str) -> str:
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert not leaked(message), f"pieces {leaked(message)} of a secret are in:\n{message}"
    return message


@pytest.mark.parametrize("key", DUPLICATED)
def test_a_duplicated_key_is_named_and_neither_value_shown(tmp_path: Path, key: str) -> None:
    message = refused(tmp_path, DUPLICATED[key])
    name = key.rpartition(".")[2]
    assert f'the key "{name}" appears twice in one mapping' in message
    assert "relay.yaml:" in message  # with the line of the second one


@pytest.mark.parametrize("case", BROKEN)
def test_every_error_of_loading_keeps_the_secret_out(tmp_path: Path, case: str) -> None:
    text, expected = BROKEN[case]
    assert expected in refused(tmp_path, text)


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "relay.yaml"
    path.write_bytes(nats("").encode() + b"  x: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path)


def alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for n in range(1, levels):
        lines.append(f"a{n}: &a{n} [{','.join(f'*a{n - 1}' for _ in range(9))}]")
    return "\n".join(lines) + "\n"


def test_aliases_of_aliases_are_refused_past_a_budget(tmp_path: Path) -> None:
    """Nine lines that would expand to 387 million values."""
    message = refused(tmp_path, alias_bomb(9))
    assert f"expands to more than {MAX_VALUES:,} values" in message


def test_a_few_aliases_still_work(tmp_path: Path) -> None:
    text = nats("").replace("    type: nats\n", "    type: &kind nats\n") + "x-kind: *kind\n"
    # An unknown top-level key: loaded (the alias expanded), then refused by name.
    assert "x-kind: unknown key" in refused(tmp_path, text)


@pytest.mark.parametrize(("shape", "depth"), [("block", 5_000), ("flow", 500)])
def test_nesting_past_the_parsers_stack_is_a_config_error(
    tmp_path: Path, shape: str, depth: int
) -> None:
    """Past the parser's stack, not a crash. 500 flow levels already exhaust it (a
    RecursionError inside ruamel); 5,000 take the parser 3.7 s to give up, same path."""
    if shape == "flow":
        text = "x: " + "[" * depth + "]" * depth + "\n"
    else:
        text = "x:\n" + "".join("  " * (n + 1) + "k:\n" for n in range(depth))
    message = refused(tmp_path, nats("") + text)
    assert "nested too deeply" in message or f"more than {MAX_DEPTH} levels" in message


def test_notify_channel_must_leave_room_for_the_trigger_name(tmp_path: Path) -> None:
    source = "source:\n  notify_trigger: true\n  notify_channel: {}\n"
    fits = tmp_path / "fits.yaml"
    fits.write_text(nats("") + source.format("c" * NOTIFY_CHANNEL_MAX))
    assert load_config(fits).source.notify_channel == "c" * NOTIFY_CHANNEL_MAX
    message = refused(tmp_path, nats("") + source.format("c" * (NOTIFY_CHANNEL_MAX + 1)))
    assert "source.notify_channel: at most 50 characters (it has 51)" in message


def write_tls(tmp_path: Path, passphrase: bytes | None) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase)
        if passphrase
        else serialization.NoEncryption()
    )
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    return cert_file, key_file


def tls(cert_file: Path, key_file: Path, password: str | None) -> str:
    lines = f"    tls:\n      cert_file: {cert_file}\n      key_file: {key_file}\n"
    return lines + (f"      key_password: '{password}'\n" if password else "")


@pytest.mark.parametrize(
    ("given", "check"),
    [
        (None, lambda m: "key_file is encrypted: give its passphrase in tls.key_password" in m),
        (OLD, lambda m: "is tls.key_password right?" in m),
    ],
    ids=["no passphrase", "a wrong one"],
)
def test_an_encrypted_key_is_never_asked_for_on_the_terminal(
    tmp_path: Path, given: str | None, check: Callable[[str], bool]
) -> None:
    """OpenSSL prompts `Enter PEM pass phrase:` unless it is given a way to get one."""
    cert_file, key_file = write_tls(tmp_path, SECRET.encode())
    message = refused(tmp_path, nats(tls(cert_file, key_file, given)))
    assert check(message), message


def test_an_encrypted_key_loads_with_its_passphrase(tmp_path: Path) -> None:
    cert_file, key_file = write_tls(tmp_path, SECRET.encode())
    path = tmp_path / "relay.yaml"
    path.write_text(nats(tls(cert_file, key_file, SECRET)))
    broker = load_config(path).brokers["nats"]
    assert isinstance(broker, NatsBrokerConfig) and broker.tls is not None
    broker.tls.context()  # the context the adapters connect with
    assert SECRET not in repr(broker)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RELAY_BROKERS__NATS__SERVERS", f"nats://relay:{SECRET}@nats-1:4222"),
        ("RELAY_DATABASE__RETRY", f"fast{SECRET}"),
    ],
)
def test_an_override_that_is_not_json_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """A list or a mapping set from the environment must be JSON; the error names the variable."""
    monkeypatch.setenv(name, value)
    message = refused(tmp_path, nats(""))
    assert f"{name}: a RELAY_* override of a list or a mapping must be JSON" in message


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("source:\n  survive_failover:\n", "standbys"),
        ("source:\n", "poll_interval"),
        ("http:\n", "port"),
        ("lease:\n  keepalives:\n", "count"),
        ("lease:\n", "max_per_replica"),  # an optional number: it passed as 1
    ],
)
def test_true_or_false_is_no_number(tmp_path: Path, section: str, key: str) -> None:
    """YAML's `true` would pass as 1 (`standbys: true`, one standby): a mistake, named."""
    indent = " " * (section.count("\n") * 2)
    message = refused(tmp_path, nats("") + f"{section}{indent}{key}: true\n")
    assert key in message
    assert "true or false" in message
