"""Hiding secrets in any text the relay prints: URLs' userinfo and `password=` values.

Used wherever text may carry a secret: error messages, log fields, CLI output. It runs on
every log line, whose fields may hold event data of any size (an aggregate id of 70 KB), so
it takes time linear in the text: a regex for `scheme://...@` backtracks over every letter
of a long word, quadratic, 19 s for such an id, with the event loop frozen meanwhile.
"""

from __future__ import annotations

import re

_KV_PASSWORD = re.compile(
    r"(?P<key>password|passwd|pwd|token|secret)\s*=\s*(?P<val>[^\s&;]+)", re.I
)
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_LONGEST_SCHEME = 32  # postgresql, amqps, nats, tls, ...: a URL's scheme is a short word
_SPACE = re.compile(r"\s")


def redact(text: str) -> str:
    """Hide the whole userinfo of URLs (`scheme://***@host`) and `password=...` values."""
    if "://" in text:
        text = _hide_userinfo(text)
    return _KV_PASSWORD.sub(r"\g<key>=***", text)


def _hide_userinfo(text: str) -> str:
    """Everything from `scheme://` to the last `@` before whitespace becomes `scheme://***@`.

    A raw `/`, `@`, `#`, `?` or `:` in a password must not end it early and leave the rest in
    view; hiding too much (a path with an `@` in it) is the lesser harm.
    """
    out: list[str] = []
    pos = 0
    while (sep := text.find("://", pos)) != -1:
        end = _SPACE.search(text, sep + 3)
        token_end = end.start() if end else len(text)
        at = text.rfind("@", sep + 3, token_end)
        if not _has_scheme(text, pos, sep):
            out.append(text[pos : sep + 1])  # not a URL here; a later `://` may be
            pos = sep + 1
            continue
        if at == -1:  # a URL without userinfo: nothing to hide up to the next space
            out.append(text[pos:token_end])
            pos = token_end
            continue
        out.append(f"{text[pos:sep]}://***@")
        pos = at + 1
    out.append(text[pos:])
    return "".join(out)


def _has_scheme(text: str, floor: int, sep: int) -> bool:
    """Whether a scheme ends at `sep`: a letter, then letters, digits and `+.-`."""
    start = sep
    while start > floor and sep - start < _LONGEST_SCHEME and text[start - 1] in _SCHEME_CHARS:
        start -= 1
    return any(c.isascii() and c.isalpha() for c in text[start:sep])
