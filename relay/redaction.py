"""Hiding secrets in any text the relay prints: URLs' userinfo and `password=` values.

Used wherever text may carry a secret: error messages, log fields, CLI output.
"""

from __future__ import annotations

import re

# Everything from `scheme://` to the last `@` before whitespace: a raw `/`, `@`, `#`, `?` or
# `:` in a password must not end the match early and leave the rest of it in view. Hiding
# too much (a path with an `@` in it) is the lesser harm.
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)\S*@", re.I)
_KV_PASSWORD = re.compile(
    r"(?P<key>password|passwd|pwd|token|secret)\s*=\s*(?P<val>[^\s&;]+)", re.I
)


def redact(text: str) -> str:
    """Hide the whole userinfo of URLs (`scheme://***@host`) and `password=...` values."""
    text = _URL_USERINFO.sub(r"\g<scheme>***@", text)
    return _KV_PASSWORD.sub(r"\g<key>=***", text)
