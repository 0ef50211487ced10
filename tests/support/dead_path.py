"""A network path on which one connection can die, in the kernel: nothing comes back.

A proxy that stops forwarding (proxy.py) leaves the kernel acknowledging what is sent and
answering keepalives: to the client that is a hung peer, not a dead path. Here clients
reach a TcpProxy over a veth pair into a network namespace of the test's own, and
`kill(port)` sends that one connection's packets, both ways, to a blackhole route (policy
routing by port), so the client's kernel sees what it sees when a route or a firewall drops
a flow: no acknowledgement and no answer, with the socket still open. Every other
connection, on this path or elsewhere on the machine, is untouched.

Needs root (network namespaces and routing rules), as this machine's and CI's test runs
have; it fails with the command that was refused otherwise.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading

from tests.support.proxy import TcpProxy

_CLONE_NEWNET = 0x40000000
_SUBNETS = range(16, 250)  # 10.213.<n>.0/30, one a path


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> None:
    command = (
        ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    )
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _subnet_free(n: int) -> bool:
    shown = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    return f"10.213.{n}." not in shown.stdout


def _free_subnet() -> int:
    """A subnet no path uses now; test runs in parallel start their search apart."""
    start = os.getpid() % len(_SUBNETS)
    for i in range(len(_SUBNETS)):
        n = _SUBNETS[(start + i) % len(_SUBNETS)]
        if _subnet_free(n):
            return n
    raise RuntimeError("no free 10.213.x.0/30 subnet for a dead path")


def _listener_in(namespace: str, host: str) -> socket.socket:
    """A listening socket of `namespace`'s network, opened by a thread that enters it (a
    socket keeps its namespace; the thread's namespace is its own, so it goes back after)."""
    libc = ctypes.CDLL(None, use_errno=True)
    made: list[socket.socket | BaseException] = []

    def enter_and_listen() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        other = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if libc.setns(other, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            try:
                made.append(socket.create_server((host, 0)))
            finally:
                if libc.setns(own, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            made.append(exc)
        finally:
            os.close(own)
            os.close(other)

    thread = threading.Thread(target=enter_and_listen)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class DeadPath:
    """Clients connect to `host`:`port`; the proxy forwards to target_host:target_port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        n = _free_subnet()
        self.namespace = f"relay-dead-path-{n}"
        self._veth = (f"rdp{n}a", f"rdp{n}b")
        self._table = str(21300 + n)
        self.host, self._near = f"10.213.{n}.2", f"10.213.{n}.1"
        self._killed: set[int] = set()
        self._proxy: TcpProxy | None = None
        try:
            self._build()
            listener = _listener_in(self.namespace, self.host)
            self._proxy = TcpProxy(target_host, target_port, listener=listener)
        except BaseException:
            self.close()
            raise
        self.port = self._proxy.port

    @property
    def proxy(self) -> TcpProxy:
        """The proxy behind the path: its faults (pause, cut) are a hung peer's."""
        assert self._proxy is not None, "the path is closed"
        return self._proxy

    def _build(self) -> None:
        near, far = self._veth
        _ip("netns", "add", self.namespace)
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", self.namespace)
        _ip("addr", "add", f"{self._near}/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("addr", "add", f"{self.host}/30", "dev", far, namespace=self.namespace)
        _ip("link", "set", far, "up", namespace=self.namespace)
        # Where a killed connection's packets go, on each side.
        _ip("route", "add", "blackhole", f"{self.host}/32", "table", self._table)
        _ip("route", "add", "blackhole", f"{self._near}/32", "table", self._table,
            namespace=self.namespace)  # fmt: skip

    def client_port(self, server_port: int) -> int | None:
        """The client's port of the connection the server sees coming from `server_port`
        (pg_stat_activity's client_port), or None."""
        return self.proxy.client_port(server_port)

    def kill(self, client_port: int) -> None:
        """From now on, every packet of the client's connection from `client_port` is lost."""
        rule = ("rule", "add", "to", self.host, "sport", str(client_port), "table", self._table)
        _ip(*rule)
        _ip("rule", "add", "to", self._near, "dport", str(client_port), "table", self._table,
            namespace=self.namespace)  # fmt: skip
        self._killed.add(client_port)

    def revive(self, client_port: int) -> None:
        """Packets from and to `client_port` pass again (a new connection may reuse it)."""
        _ip("rule", "del", "to", self.host, "sport", str(client_port), "table", self._table,
            check=False)  # fmt: skip
        _ip("rule", "del", "to", self._near, "dport", str(client_port), "table", self._table,
            namespace=self.namespace, check=False)  # fmt: skip
        self._killed.discard(client_port)

    def close(self) -> None:
        """Remove the rules (the machine's first), the link, the namespace and the proxy."""
        for port in list(self._killed):
            self.revive(port)
        _ip("route", "flush", "table", self._table, check=False)
        _ip("link", "del", self._veth[0], check=False)  # its peer goes with it
        _ip("netns", "del", self.namespace, check=False)
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None

    def __enter__(self) -> DeadPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
