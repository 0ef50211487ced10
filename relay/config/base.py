"""Shared building blocks of the config models: strict frozen models, durations, names, URLs."""

from __future__ import annotations

import re
import ssl
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin
from urllib.parse import parse_qs, unquote

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    WithJsonSchema,
    model_validator,
)

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


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "kb": 1000,
    "mb": 1000**2,
}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def _byte_size(value: Any) -> Any:
    """Accept `4MiB`, `512KiB`, `1MB`, or a bare number of bytes."""
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size; write it like 512KiB, 4MiB or 1048576")
        return int(match.group(1)) * _SIZE_UNITS[unit]
    return value


# What the file may hold, for `relay config-schema`: the validators above accept text too.
_DURATION_TEXT = {"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*(us|ms|s|m|h)\s*$"}
_SIZE_TEXT = {
    "type": "string",
    "pattern": r"^\s*[0-9]+\s*([Bb]|[KkMmGg][Ii][Bb]|[KkMm][Bb])?\s*$",
}


def _either(number: dict[str, Any], text: dict[str, Any], what: str) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [number, text], "description": what})


ByteSize = Annotated[
    int,
    BeforeValidator(_byte_size),
    Field(ge=1),
    _either({"type": "integer", "minimum": 1}, _SIZE_TEXT, "Bytes, or 512KiB, 4MiB, 1MB."),
]
Duration = Annotated[
    float,
    BeforeValidator(_duration),
    Field(ge=0),
    _either({"type": "number", "minimum": 0}, _DURATION_TEXT, "Seconds, or 10ms, 30s, 2m."),
]
PositiveDuration = Annotated[
    float,
    BeforeValidator(_duration),
    Field(gt=0),
    _either(
        {"type": "number", "exclusiveMinimum": 0}, _DURATION_TEXT, "Seconds, or 10ms, 30s, 2m."
    ),
]
Identifier = Annotated[str, Field(pattern=_IDENT)]


def _kinds(annotation: Any) -> set[Any]:
    """The plain types a field's annotation admits, through `X | None`, nested unions and
    `Annotated[...]` (an optional constrained number is `Annotated[int, ...] | None`)."""
    if get_origin(annotation) in (Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in get_args(annotation)))
    if get_origin(annotation) is Annotated:
        return _kinds(get_args(annotation)[0])
    return {annotation}


class Model(BaseModel):
    # hide_input_in_errors: a ValidationError printed by whoever builds a model in code must not
    # carry a secret it was given; `load_config` words its own messages from the errors' text.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, data: Any) -> Any:
        """pydantic takes YAML's `true` for 1 (`standbys: true` would mean one standby): a
        number field that admits no boolean refuses one, for every model at once."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(field.alias or name)
                kinds = _kinds(field.annotation)
                if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
                    raise ValueError(f"{name}: a number is needed here, not true or false")
        return data


def header_text(value: str) -> str:
    """A value every broker carries in a header as written: nats-py, for one, would turn a
    line break into a space and strip whitespace at either end (see brokers/_header_values)."""
    if not value.isprintable() or value != value.strip():
        raise ValueError(
            "goes in a message header: no control characters (line breaks, tabs) and no"
            " whitespace at either end"
        )
    return value


HeaderText = Annotated[str, AfterValidator(header_text)]

# Where a client or a server may end one step of a path: `/`, and `\` on some servers; also
# percent-encoded, since some decode the path before they resolve it.
_STEP_END = re.compile(r"/|\\|%2[Ff]|%5[Cc]")


def path_step(path: str) -> str | None:
    """The first step of `path` that a client or a server resolves rather than sends on, as
    written (`..`, `.`, `%2E%2E`, ...); None when there is none.

    An address with a value of an event in it must hold none: `in/hooks/../admin` reaches
    `in/admin`. Encoding does not help, since yarl (aiohttp), nginx and most servers decode
    `%2E` back to a dot before they resolve the path: such an address is refused instead."""
    for step in _STEP_END.split(path):
        if step and unquote(step) in (".", ".."):
            return step
    return None


def _existing_file(path: str) -> str:
    if not Path(path).is_file():
        raise ValueError(f"no such file: {path}")
    return path


# A file the relay reads at start-up: a missing one is a config error, not a failed connect.
ExistingFile = Annotated[str, AfterValidator(_existing_file)]


class EncryptedKeyError(ValueError):
    """The key file is encrypted and no `key_password` was given."""


class TlsConfig(Model):
    """Files for TLS; absent means the system's trust store and no client certificate."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    key_password: SecretStr | None = Field(
        None, description="Decrypts an encrypted key_file; write it as ${VAR}."
    )

    @model_validator(mode="after")
    def _files_load(self) -> TlsConfig:
        """A file that is missing or unreadable fails at load, not at every connect. Without
        files there is nothing to check: a context would only read the system's trust store
        (25 ms of CPU, and `TlsConfig()` is what a broker without a `tls` section uses)."""
        if self.ca_file is None and self.cert_file is None:
            return self
        try:
            self.context()
        except EncryptedKeyError:
            raise ValueError(
                "key_file is encrypted: give its passphrase in tls.key_password "
                "(write it as ${VAR})"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            hint = "; is tls.key_password right?" if self.key_password is not None else ""
            raise ValueError(f"cannot load the TLS files: {exc}{hint}") from None
        return self

    def context(self) -> ssl.SSLContext:
        """A client context: verify the server, and present a certificate if one is set."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file:
            key = str(self.key_file) if self.key_file else None
            # Always a callable: without one, OpenSSL asks for a passphrase on the terminal.
            context.load_cert_chain(str(self.cert_file), key, password=self._passphrase)
        return context

    def _passphrase(self) -> bytes:
        """Called by OpenSSL only for an encrypted key."""
        if self.key_password is None:
            raise EncryptedKeyError("key_file is encrypted")
        return self.key_password.get_secret_value().encode()


# -- connection URLs --------------------------------------------------------------------------
#
# A reserved character written raw in a password makes every URL parser split the URL inside
# the password: `postgresql://relay:Tr0ub4dor/x@db/app` has the host `relay`, the port
# `Tr0ub4dor` and the database `x@db/app`. The parsers' errors then quote that piece
# (`invalid literal for int() with base 10: 'Tr0ub4dor'`), or, worse, the URL parses and the
# relay connects somewhere else. So URLs are checked here, at load time, by rules that only
# say what is wrong: no message below quotes any part of the URL, since any part may hold a
# piece of the password.

PERCENT_ENCODING = (
    "percent-encode reserved characters in the user or password: "
    "/ → %2F, @ → %40, : → %3A, # → %23, % → %25, ? → %3F, [ → %5B, ] → %5D, \\ → %5C, "
    "space → %20 "
    "(in Python: urllib.parse.quote(password, safe=''))"
)
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")

_HOST_NAME = re.compile(r"(?:[\w.-]|%[0-9A-Fa-f]{2})+")  # a name, IPv4, or %-encoded socket path
_IPV6 = re.compile(r"\[(?P<addr>[0-9A-Fa-f:.]+(?:%25[\w.-]+)?)\](?::(?P<port>.*))?")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_KEYWORD_DSN = re.compile(r"^\s*[A-Za-z_]+\s*=")


@dataclass(frozen=True)
class _UrlParts:
    userinfo: str
    hostspec: str
    query: str


class UrlError(ValueError):
    """What is wrong with a URL, in words that quote none of it."""


def _broken(what: str) -> UrlError:
    """The usual cause of a URL that does not parse is a raw reserved character in a password."""
    return UrlError(f"not a valid URL: {what}; {PERCENT_ENCODING}")


def _split(url: str, schemes: tuple[str, ...]) -> _UrlParts:
    """Split like libpq, asyncpg and yarl do, refusing whatever they would read differently."""
    text = url.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in schemes:
        first = " or ".join(f"{s}://" for s in schemes)
        raise UrlError(f"must start with {first}")
    if any(c.isspace() for c in text):
        raise _broken("it contains whitespace")
    if "#" in rest:
        raise _broken("it contains a '#', which ends the URL there")
    authority = re.match(r"[^/?]*", rest)
    assert authority is not None  # matches the empty string at least
    userinfo, at, hostspec = authority.group().rpartition("@")
    tail = rest[authority.end() :]
    if "@" in tail:
        raise _broken(
            "it has an '@' after the host, so a '/' or '?' in the user or password cut it short"
        )
    if at and "@" in userinfo:
        raise _broken("it has more than one '@' before the host")
    if any(c in userinfo for c in "[]\\"):
        # urllib takes a bracket for an IPv6 host; yarl refuses a backslash in the authority.
        raise _broken("the user or password contains a '[', ']' or '\\'")
    if _BAD_ESCAPE.search(userinfo):
        raise _broken("the user or password has a '%' that does not start a %XX escape")
    return _UrlParts(userinfo=userinfo, hostspec=hostspec, query=tail.partition("?")[2])


def _check_port(port: str) -> None:
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise _broken("the port is not a number from 1 to 65535")


def _check_host(spec: str) -> None:
    """`host`, `host:port`, `[ipv6]` or `[ipv6]:port`; an empty host means the default one."""
    if spec.startswith("["):
        match = _IPV6.fullmatch(spec)
        if match is None:
            raise _broken("the host is not a valid [IPv6] address")
        host, port = match.group("addr"), match.group("port")
    else:
        host, sep, port = spec.partition(":")
        port = port if sep else None
        if host and not _HOST_NAME.fullmatch(host):
            raise _broken("the host is not a host name, an IP address or a %-encoded socket path")
    if port:  # `db:` with nothing after the colon means the default port, as in libpq
        _check_port(port)


# What a URL may ask of the server it connects to: the relay connects to the primary alone.
PRIMARY_SESSION_ATTRS = ("primary", "read-write", "any")


def check_postgres_url(url: str) -> None:
    """Raise UrlError unless libpq and asyncpg would both read `url` as written."""
    if "://" not in url and _KEYWORD_DSN.match(url):
        raise UrlError(
            "a keyword=value connection string is not supported; write it as a postgresql:// "
            f"URL instead, postgresql://user:password@host:5432/dbname?sslmode=require, and "
            f"{PERCENT_ENCODING}"
        )
    parts = _split(url, ("postgresql", "postgres"))
    hosts = parts.hostspec.split(",")
    if len(hosts) > 1 and not all(hosts):
        raise _broken("the list of hosts has an empty entry")
    for host in hosts:
        _check_host(host)
    if not parts.query:
        return
    try:
        query = parse_qs(parts.query, strict_parsing=True)
    except ValueError:
        raise _broken("the query (after '?') is not key=value pairs joined by '&'") from None
    _check_hosts_in_query(query, hosts)
    _check_libpq_only(query)
    if "sslmode" in query and query["sslmode"][-1] not in SSLMODES:
        raise UrlError(f"sslmode must be one of {', '.join(SSLMODES)}")
    _check_negotiation(query)
    for ports in query.get("port", []):
        for port in ports.split(","):
            _check_port(port)
    for attrs in query.get("target_session_attrs", []):
        if attrs not in PRIMARY_SESSION_ATTRS:
            raise UrlError(
                f"target_session_attrs={attrs} is not for the relay, which writes on every"
                " connection and so always connects to the primary (a standby is passed"
                f" over): leave it out, or write one of {', '.join(PRIMARY_SESSION_ATTRS)}"
            )


_KEEPALIVES = "set lease.keepalives instead (the relay sets TCP keepalives itself)"
_NOT_READ = "not supported by the relay's driver (asyncpg): leave it out"
# libpq's connection parameters (PostgreSQL 18's whole list) that asyncpg does not read. It
# passes every query key it does not know to the server as a setting, and the server refuses
# these at every connect. (`application_name` and `client_encoding` are server settings too,
# and work that way.)
LIBPQ_ONLY = {
    "connect_timeout": "set database.connect_timeout instead",
    "keepalives": _KEEPALIVES,
    "keepalives_idle": _KEEPALIVES,
    "keepalives_interval": _KEEPALIVES,
    "keepalives_count": _KEEPALIVES,
    "tcp_user_timeout": _KEEPALIVES,
    "hostaddr": "write the address as the host instead",
    "options": "give each server setting as a query key of its own (?statement_timeout=5s)",
    "fallback_application_name": "leave it out: the relay names its sessions itself",
    **{
        key: _NOT_READ
        for key in (
            "channel_binding",
            "gssdelegation",
            "gssencmode",
            "load_balance_hosts",
            "max_protocol_version",
            "min_protocol_version",
            "oauth_client_id",
            "oauth_client_secret",
            "oauth_issuer",
            "oauth_scope",
            "replication",
            "require_auth",
            "requirepeer",
            "requiressl",
            "scram_client_key",
            "scram_server_key",
            "sslcertmode",
            "sslcompression",
            "sslcrldir",
            "sslkeylogfile",
            "sslsni",
        )
    },
}


def _check_negotiation(query: dict[str, list[str]]) -> None:
    """libpq's rule, which the driver applies only when it connects: TLS from the first byte
    (`sslnegotiation=direct`) needs an sslmode that requires TLS."""
    negotiation = query.get("sslnegotiation", ["postgres"])[-1]
    if negotiation not in ("postgres", "direct"):
        raise UrlError("sslnegotiation must be postgres or direct")
    mode = query.get("sslmode", ["prefer"])[-1]
    if negotiation == "direct" and mode not in ("require", "verify-ca", "verify-full"):
        raise UrlError(
            "sslnegotiation=direct needs sslmode=require, verify-ca or verify-full (TLS from the"
            " first byte cannot fall back to plain text)"
        )


def _check_libpq_only(query: dict[str, list[str]]) -> None:
    for key in sorted(query):
        if key in LIBPQ_ONLY:
            raise UrlError(
                f"{key} is a libpq parameter the relay's driver does not read; it would go to"
                f" the server as a setting, which refuses it: {LIBPQ_ONLY[key]}"
            )


def _check_hosts_in_query(query: dict[str, list[str]], written: list[str]) -> None:
    """What the driver and the relay would read differently, or not at all: a key given
    twice (each takes another of them), an IPv6 address without brackets in `?host=`, and
    more than one port that is not one per host."""
    twice = sorted(key for key, values in query.items() if len(values) > 1)
    if twice:
        raise UrlError(f"{twice[0]} is given more than once in the query: give it once")
    named = [h for h in query.get("host", [""])[0].split(",") if h]
    for host in named:
        if host.count(":") > 1 and not host.startswith("["):
            raise UrlError("write an IPv6 address in ?host= in brackets, as [::1]")
        if not host.startswith(("/", "%2F")):
            _check_host(host)
    ports = query.get("port", [""])[0].split(",")
    count = len(named) or len([h for h in written if h]) or 1
    if len(ports) > 1 and len(ports) != count:
        raise UrlError(
            f"?port= names {len(ports)} ports for {count} host(s): give one port for every"
            " host, or one per host"
        )


def check_amqp_url(url: str) -> None:
    """Raise UrlError unless yarl (and so aiormq) would read `url` as written."""
    _check_host(_split(url, ("amqp", "amqps")).hostspec)


_NATS_CREDENTIALS = (
    "nats-py reads a user and password in a NATS URL without decoding %XX escapes, so write "
    "them in the broker's user: and password: keys instead"
)


def check_nats_url(url: str, schemes: tuple[str, ...]) -> None:
    """Raise UrlError unless nats-py would read `url` (`host:port` means nats://) as written.

    nats-py splits with urllib and says "invalid connect url option" only when it connects,
    which would look like an outage and be retried for ever.
    """
    text = url.strip()
    try:
        parts = _split(text if "://" in text else f"nats://{text}", schemes)
        if not parts.hostspec or parts.hostspec.startswith(":"):
            raise _broken("it names no host")
        _check_host(parts.hostspec)
    except UrlError as exc:
        what = str(exc).removeprefix("not a valid URL: ").partition("; ")[0]
        raise UrlError(f"not a valid NATS URL: {what}; {_NATS_CREDENTIALS}") from None
    if "%" in parts.userinfo:
        raise UrlError(f"the user or password has a %XX escape; {_NATS_CREDENTIALS}")


def check_redis_url(url: str) -> None:
    """Raise UrlError unless redis-py would read `url` (redis:// or rediss://) as written: a
    host, a port, a database number as the path and nothing else in it."""
    text = url.strip()
    parts = _split(text, ("redis", "rediss"))
    if not parts.hostspec or parts.hostspec.startswith(":"):
        raise _broken("it names no host")
    _check_host(parts.hostspec)
    rest = text.partition("://")[2]
    authority = re.match(r"[^/?]*", rest)
    assert authority is not None  # matches the empty string at least
    path = rest[authority.end() :].partition("?")[0].removeprefix("/")
    if path and not (path.isascii() and path.isdigit()):
        raise UrlError("the path must be a database number, as redis://host:6379/0")


def _postgres(value: SecretStr) -> SecretStr:
    check_postgres_url(value.get_secret_value())
    return value


def _amqp(value: SecretStr) -> SecretStr:
    check_amqp_url(value.get_secret_value())
    return value


def _redis(value: SecretStr) -> SecretStr:
    check_redis_url(value.get_secret_value())
    return value


PostgresUrl = Annotated[SecretStr, AfterValidator(_postgres)]
RedisUrl = Annotated[SecretStr, AfterValidator(_redis)]
AmqpUrl = Annotated[SecretStr, AfterValidator(_amqp)]
