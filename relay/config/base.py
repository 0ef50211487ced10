"""Shared building blocks of the config models: strict frozen models, durations, names."""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)\s*$")
_IDENT = r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$"


def _duration(value: Any) -> Any:
    """Accept `10ms`, `1.5s`, `2m`, or a bare number of seconds."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a duration; write it like 10ms, 30s or 2m")
        return float(match.group(1)) * _UNITS[match.group(2)]
    return value


Duration = Annotated[float, BeforeValidator(_duration), Field(ge=0)]
PositiveDuration = Annotated[float, BeforeValidator(_duration), Field(gt=0)]
Identifier = Annotated[str, Field(pattern=_IDENT)]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsConfig(Model):
    """Files for TLS; absent means the system's trust store and no client certificate."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def context(self) -> ssl.SSLContext:
        """A client context: verify the server, and present a certificate if one is set."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file:
            key = str(self.key_file) if self.key_file else None
            context.load_cert_chain(str(self.cert_file), key)
        return context
