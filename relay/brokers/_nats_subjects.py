"""What a NATS subject may be, and which stream subject captures it: the rules the NATS
publisher refuses a subject by before sending (docs/brokers/nats.md#subjects), shared with
the audit's reader and the checks."""

from __future__ import annotations

import re

from relay.printable import excerpt

# A token of a publish subject: not empty, and free of the separator, the wildcards,
# whitespace and control characters (a CR or LF would end the protocol line). One regex
# match per message keeps the check cheap on the hot path.
_TOKEN = r"[^.*>\s\x00-\x1f\x7f-\x9f]+"
VALID_SUBJECT = re.compile(rf"{_TOKEN}(?:\.{_TOKEN})*")
# The server reads a publish's protocol line (HPUB, subject, reply inbox, sizes) up to
# max_control_line, 4 KiB by default, and closes the connection on a longer one: a failure
# that would look transient and hold the outbox back for ever. The inbox and sizes take
# under 128 bytes.
MAX_SUBJECT_BYTES = 4096 - 128


def invalid(subject: str) -> str:
    return f"invalid subject {excerpt(subject)}: {_broken_rule(subject)}"


def reserved(subject: str) -> bool:
    """A subject of the server's own API or system account: `$JS.API.STREAM.PURGE.X` from
    event data purged a stream. A key-value bucket's `$KV.` is a stream like any other."""
    return subject[0] == "$" and not subject.startswith("$KV.")


def too_long(subject: str) -> bool:
    """Over MAX_SUBJECT_BYTES once encoded; encoded only when it could be (UTF-8: 4 a char)."""
    return len(subject) * 4 > MAX_SUBJECT_BYTES and len(subject.encode()) > MAX_SUBJECT_BYTES


def _broken_rule(subject: str) -> str:
    """Why a subject that failed VALID_SUBJECT cannot be published to; off the hot path."""
    if not subject:
        return "it is empty"
    if reserved(subject):
        return (
            "subjects starting with '$' are the server's own ($JS.API, $JS.ACK, $SYS...):"
            " a message sent there is a command to the server, not an event (only $KV., a"
            " key-value bucket's stream, may be published to)"
        )
    if too_long(subject):
        return (
            f"it is {len(subject.encode()):,} bytes long; NATS reads a publish's protocol line up"
            f" to 4 KiB (max_control_line), so a subject may have {MAX_SUBJECT_BYTES:,}"
        )
    if subject.startswith(".") or subject.endswith("."):
        return "it starts or ends with '.'"
    if ".." in subject:
        return "it has an empty token ('..')"
    if "*" in subject or ">" in subject:
        return "'*' and '>' are wildcards, for subscribing only"
    return "it contains whitespace or a control character"


def captures(pattern: str, subject: str) -> bool:
    """Whether a stream subject (`*` one token, `>` the rest) captures a publish subject."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)
