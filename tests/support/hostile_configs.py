"""Config files with a secret in them, each broken in one way: for the tests that load them.

Every error path of loading a config, with a literal secret where one may be written. The
unit tests load them in-process; tests/integration/test_secrets.py runs `relay check` on them.
"""

from __future__ import annotations

SECRET = "Zq8Wv3Kp6Tn1"
OLD = "Yh4Rb9Lm2Xc7"

HEAD = "database:\n  url: postgresql://relay@db/app\n"
OUTBOX = (
    "outboxes:\n  loans:\n    broker: {broker}\n    messages:\n      BookLent:\n"
    "        type: library.book-lent.v1\n        destination: library.loans\n"
)


def nats(extra: str) -> str:
    return (
        HEAD
        + "brokers:\n  nats:\n    type: nats\n    servers: ['nats://nats-1:4222']\n"
        + extra
        + OUTBOX.format(broker="nats")
    )


def servers(text: str) -> str:
    """A NATS broker whose `servers:` is `text`, as written."""
    return (
        HEAD
        + f"brokers:\n  nats:\n    type: nats\n    servers: {text}\n"
        + OUTBOX.format(broker="nats")
    )


def kafka(extra: str) -> str:
    return (
        HEAD
        + "brokers:\n  kafka:\n    type: kafka\n    bootstrap_servers: ['kafka-1:9092']\n"
        + "    security_protocol: SASL_PLAINTEXT\n    sasl_mechanism: PLAIN\n"
        + "    sasl_username: relay\n"
        + extra
        + OUTBOX.format(broker="kafka")
    )


def pieces(secret: str) -> set[str]:
    return {secret[i : i + 4] for i in range(len(secret) - 3)}


DUPLICATED = {
    "database.url": (
        f"database:\n  url: postgresql://relay:{OLD}@db/app\n"
        f"  url: postgresql://relay:{SECRET}@db/app\n"
        + "brokers:\n  nats:\n    type: nats\n    servers: ['nats://nats-1:4222']\n"
        + OUTBOX.format(broker="nats")
    ),
    "password": nats(f"    user: relay\n    password: {OLD}\n    password: {SECRET}\n"),
    "token": nats(f"    token: {OLD}\n    token: '{SECRET}'\n"),
    "sasl_password": kafka(f'    sasl_password: "{OLD}"\n    sasl_password: "{SECRET}"\n'),
}


# Every other way loading can fail, each on a file with a secret in it.
BROKEN: dict[str, tuple[str, str]] = {
    "unknown escape on the secret's line": (
        nats(f'    user: relay\n    password: "{SECRET}\\q"\n'),
        "found unknown escape character",
    ),
    "a tab before the secret": (
        nats(f"    user: relay\n    password:\t{SECRET}\n\tx: 1\n"),
        "invalid YAML",
    ),
    "an unclosed quote": (nats(f"    user: relay\n    password: '{SECRET}\n"), "invalid YAML"),
    "a control character": (nats(f"    token: {SECRET}\x01\n"), "invalid YAML"),
    "an anchor defined twice": (
        nats(f"    user: &a relay\n    password: &a {SECRET}\n    stream: 3\n"),
        "brokers.nats.stream",
    ),
    "an alias named like the secret": (nats(f"    password: *{SECRET}\n"), "undefined alias"),
    "a tag named like the secret": (
        nats(f"    password: !{SECRET[:6]}!{SECRET[6:]} x\n"),
        "undefined tag handle",
    ),
    "a raw ${ in the secret": (
        nats(f'    password: "x${{{SECRET}:9}}z"\n'),
        "after ${ and a variable name comes } or :-default}",
    ),
    "a raw ${ with a dash in the secret": (
        nats(f'    password: "${{{SECRET}-x}}"\n'),
        "after ${ and a variable name comes } or :-default}",
    ),
    "an unterminated ${": (nats(f"    token: {SECRET}${{TOKEN\n"), "unterminated ${"),
    "an unset variable": (
        nats(f"    token: {SECRET}${{RELAY_TEST_UNSET_VARIABLE}}\n"),
        "RELAY_TEST_UNSET_VARIABLE is not set",
    ),
    "a secret where a list belongs": (
        servers(f"nats://relay:{SECRET}@h:4222"),
        "brokers.nats.servers",
    ),
    "a secret under a misspelled key": (nats(f"    pasword: {SECRET}\n"), "unknown key"),
    "a secret as a mapping": (nats(f"    token: {{{SECRET}: 1}}\n"), "brokers.nats.token"),
    "a NATS URL with a raw [ in the password": (
        servers(f"['nats://relay:{SECRET}[@h:4222']"),
        "brokers.nats.servers: servers.0: not a valid NATS URL",
    ),
    "a NATS URL with a raw / in the password": (
        servers(f"['nats://relay:{SECRET}/@h']"),
        "not a valid NATS URL",
    ),
    "a NATS URL with a raw # in the password": (
        servers(f"['nats://relay:{SECRET}#@h']"),
        "not a valid NATS URL",
    ),
    "a NATS URL with a %-escape in the password": (
        servers(f"['nats://relay:{SECRET}%40@h']"),
        "write them in the broker's user: and password: keys",
    ),
    "a bad database URL": (
        f"database:\n  url: postgresql://relay:{SECRET}@db:{SECRET}/app\n"
        + "brokers:\n  nats:\n    type: nats\n    servers: ['nats://nats-1:4222']\n"
        + OUTBOX.format(broker="nats"),
        "database.url",
    ),
    "the top level is the secret": (f"{SECRET}\n", "the top level must be a mapping"),
}


def leaked(text: str) -> list[str]:
    """The 4-character pieces of either secret found in `text`."""
    return sorted(piece for secret in (SECRET, OLD) for piece in pieces(secret) if piece in text)
