"""Finding the primary among a URL's hosts, and saying what each host is when none is.

Every connection goes to the primary (database.py asks the driver for one). When no host
takes it, or two do, the relay asks each host what it is, so that the log names the standby
waiting for promotion, the host that is down, or the two primaries of a split brain.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qs, unquote

import asyncpg

DEFAULT_PORT = 5432
DEFAULT_HOST = "the default host (PGHOST or the local socket)"


@dataclass(frozen=True, slots=True)
class Host:
    """One host of the URL, as it answered."""

    address: str  # host:port, for messages
    role: Literal["primary", "standby", "down"]
    said: str
    server: tuple[str, str] | None = None  # (start time, port): two names of one server


def listed(url: str) -> list[str]:
    """The URL's `host:port` entries, from before its path or from `?host=` and `?port=`
    (a host without a port gets 5432, or the one port given for all), socket directories
    (`/run/postgresql:5432`) among them; a URL naming no host gives none."""
    rest = url.strip().partition("://")[2]
    authority = re.match(r"[^/?]*", rest)
    written = authority.group().rpartition("@")[2] if authority else ""
    query = parse_qs(rest.partition("?")[2])
    names = written.split(",") if written else ",".join(query.get("host", [])).split(",")
    ports = ",".join(query.get("port", [])).split(",")
    found = []
    for i, written_name in enumerate(n for n in names if n):
        # A socket directory is percent-encoded in the authority; it is a host like any
        # other, and may be a primary (a split brain must see it).
        name = unquote(written_name) if written_name[:3].upper() == "%2F" else written_name
        if name.startswith(":"):
            continue  # no host: no address to name or probe
        if re.search(r"(^[^:\[]+|\]):\d+$", name):
            found.append(name)
            continue
        port = ports[i] if i < len(ports) and ports[i] else (ports[0] or str(DEFAULT_PORT))
        found.append(f"{name.rstrip(':')}:{port}")
    return found


def url_user(url: str) -> str:
    """The user the URL logs in as (before `@`, or `?user=`), decoded; empty if none."""
    rest = url.strip().partition("://")[2]
    authority = re.match(r"[^/?]*", rest)
    userinfo, at, _ = authority.group().rpartition("@") if authority else ("", "", "")
    if at and userinfo:
        return unquote(userinfo.partition(":")[0])
    return parse_qs(rest.partition("?")[2]).get("user", [""])[0]


def address(url: str) -> str:
    """The URL's hosts for messages (never its user or password)."""
    return ",".join(listed(url)) or DEFAULT_HOST


def hosts(url: str) -> list[tuple[str, int]]:
    """The URL's hosts with their ports, IPv6 without brackets, to connect to one by one."""
    found = []
    for entry in listed(url):
        host, _, port = entry.rpartition(":")
        found.append((host.strip("[]"), int(port)))
    return found


# Whether the server is in recovery, and what tells one server from another: a server
# under two names (a service and its pod) answers both with one start time and port.
_WHAT_IS = (
    "SELECT pg_is_in_recovery() AS recovering, pg_postmaster_start_time() AS started,"
    " current_setting('port') AS port"
)


async def server_of(conn: asyncpg.Connection) -> tuple[str, str]:
    """The server `conn` reaches, as `Host.server` names it: a restarted server is another."""
    row = await conn.fetchrow(_WHAT_IS)
    return str(row["started"]), str(row["port"])


async def ask_each(
    url: str,
    open_any: Callable[[str, int], Awaitable[asyncpg.Connection]],
    errors: tuple[type[BaseException], ...],
    text: Callable[[BaseException], str],
) -> list[Host]:
    """What each host of the URL is now, asked over a connection of its own (`open_any`,
    which takes a standby too); `errors` mean a host is down, `text` words them."""

    async def ask(host: str, port: int) -> Host:
        here = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            conn = await open_any(host, port)
        except errors as exc:
            return Host(here, "down", f"{here} cannot be reached: {text(exc)}")
        try:
            row = await conn.fetchrow(_WHAT_IS)
        except errors as exc:
            return Host(here, "down", f"{here} did not answer: {text(exc)}")
        finally:
            conn.terminate()
        server = str(row["started"]), str(row["port"])
        if row["recovering"]:
            said = f"{here} is a standby (in recovery: read-only until it is promoted)"
            return Host(here, "standby", said, server)
        return Host(here, "primary", f"{here} is a primary", server)

    return list(await asyncio.gather(*(ask(host, port) for host, port in hosts(url))))


def no_primary(found: list[Host]) -> str:
    return (
        f"no primary among the database's hosts ({'; '.join(h.said for h in found)}); the"
        " relay writes on every connection, so it waits for a primary (a promotion, or the"
        " URL's hosts changed) and retries"
    )


def split_brain(found: list[Host]) -> str | None:
    """Why the relay must not use any host, when two servers answer as primaries (one
    server under two names, `127.0.0.1` and `localhost`, is one primary)."""
    servers: dict[tuple[str, str] | None, str] = {}
    for host in found:
        if host.role == "primary":
            servers.setdefault(host.server, host.address)
    primaries = list(servers.values())
    if len(primaries) < 2:
        return None
    return (
        f"split brain: {' and '.join(primaries)} both answer as primaries, so events and"
        " checkpoints may be on either; the relay uses neither until only one is (the old"
        " primary of a failover must be stopped or rebuilt as a standby), and retries"
    )
