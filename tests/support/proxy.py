"""A TCP proxy that can black-hole or cut traffic, to simulate network faults.

It runs one selector loop in a background thread, so it also serves subprocesses (the relay
under test). Every control call is executed by that thread and returns once it took effect.
With `record=True` it also keeps what clients send, so a test can check what crossed the
wire (off by default: a long run would keep every byte).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import queue
import selectors
import socket
import termios
import threading
from collections.abc import Callable

_CHUNK = 65536


class _Pipe:
    """A client connection and its upstream twin, with bytes waiting to be written to each."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.peer = {client: upstream, upstream: client}
        self.outgoing = {client: b"", upstream: b""}
        self.held = False  # forwards nothing, for good (TcpProxy.hold)


class TcpProxy:
    """Forwards 127.0.0.1:`port` (or what `listener` listens on) to target_host:target_port."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        record: bool = False,
        listener: socket.socket | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self._record = record
        self._listener = listener or socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.port: int = self.address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]]
        self._calls = queue.SimpleQueue()
        self._pipes: dict[socket.socket, _Pipe] = {}
        self._from_clients = bytearray()
        self._paused = False
        self._running = True
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"TcpProxy:{self.port}")
        self._thread.daemon = True
        self._thread.start()

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def connections(self) -> int:
        """Client connections being forwarded now; a client's close shows here once read."""
        return len(self._pipes) // 2

    def client_bytes(self) -> bytes:
        """Every byte clients have sent through the proxy so far (needs `record=True`)."""
        if not self._record:
            raise RuntimeError("this proxy does not record: create it with record=True")
        copy: list[bytes] = []
        self._call(lambda: copy.append(bytes(self._from_clients)))
        return copy[0]

    def waiting_from_clients(self) -> int:
        """Bytes clients have sent that the proxy has not read yet: while paused, proof that
        a client wrote something (a request now in flight) without needing a fixed wait."""
        counts: list[int] = []
        self._call(lambda: counts.append(self._unread_client_bytes()))
        return counts[0]

    def _unread_client_bytes(self) -> int:
        total = 0
        for pipe in {id(p): p for p in self._pipes.values()}.values():
            with contextlib.suppress(OSError):
                buffer = array.array("i", [0])
                fcntl.ioctl(pipe.client.fileno(), termios.FIONREAD, buffer)
                total += buffer[0]
        return total

    def client_port(self, upstream_port: int) -> int | None:
        """The client's own port of the connection forwarded from local `upstream_port` (what
        the server sees as the client's port), or None if there is no such connection."""
        found: list[int | None] = [None]

        def look() -> None:
            for pipe in self._pipes.values():
                upstream = pipe.peer[pipe.client]
                with contextlib.suppress(OSError):
                    if upstream.getsockname()[1] == upstream_port:
                        found[0] = pipe.client.getpeername()[1]

        self._call(look)
        return found[0]

    def hold(self, upstream_port: int) -> bool:
        """Stop forwarding the one connection the server sees coming from `upstream_port`,
        keeping both of its sockets open (a half-open path: this side's kernel still
        acknowledges, so no keepalive fails); the others, and new ones, go on. False if
        there is no such connection."""
        found = [False]

        def look() -> None:
            for pipe in {id(p): p for p in self._pipes.values()}.values():
                with contextlib.suppress(OSError):
                    if pipe.peer[pipe.client].getsockname()[1] == upstream_port:
                        pipe.held = True
                        self._update(pipe)
                        found[0] = True

        self._call(look)
        return found[0]

    def pause(self) -> None:
        """Stop forwarding in both directions; connections stay open (a black hole)."""
        self._call(self._set_paused, True)

    def resume(self) -> None:
        """Forward again, including whatever queued up while paused."""
        self._call(self._set_paused, False)

    def cut(self) -> None:
        """Close every live connection (both sides); new connections are still accepted."""
        self._call(self._close_all)

    def close(self) -> None:
        """Close all connections and the listener and stop the thread. Idempotent."""
        if self._closed:
            return
        self._call(self._shutdown)
        self._thread.join(5)
        self._closed = True
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control, executed on the proxy thread ------------------------------------------------

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        if self._closed:
            raise RuntimeError("proxy is closed")
        done = threading.Event()
        self._calls.put((lambda: fn(*args), done))
        self._wake_w.send(b"!")
        if not done.wait(5):
            raise TimeoutError("proxy thread did not respond")

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        for pipe in {id(p): p for p in self._pipes.values()}.values():
            self._update(pipe)

    def _close_all(self) -> None:
        for pipe in {id(p): p for p in self._pipes.values()}.values():
            self._drop(pipe)

    def _shutdown(self) -> None:
        self._close_all()
        self._running = False

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while self._running:
            for key, mask in self._selector.select():
                if key.data == "wake":
                    self._run_calls()
                elif key.data == "accept":
                    self._accept()
                else:
                    self._service(key.fileobj, key.data, mask)  # type: ignore[arg-type]

    def _run_calls(self) -> None:
        self._wake_r.recv(_CHUNK)
        while not self._calls.empty():
            fn, done = self._calls.get()
            fn()
            done.set()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        pipe = _Pipe(client, upstream)
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipes[sock] = pipe
        self._update(pipe)

    def _service(self, sock: socket.socket, pipe: _Pipe, mask: int) -> None:
        if sock not in self._pipes:
            return  # dropped earlier in this round
        peer = pipe.peer[sock]
        try:
            if mask & selectors.EVENT_WRITE and pipe.outgoing[sock]:
                sent = sock.send(pipe.outgoing[sock])
                pipe.outgoing[sock] = pipe.outgoing[sock][sent:]
            if mask & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                if not data:
                    self._drop(pipe)
                    return
                if self._record and sock is pipe.client:
                    self._from_clients += data
                pipe.outgoing[peer] += data
                sent = peer.send(pipe.outgoing[peer])
                pipe.outgoing[peer] = pipe.outgoing[peer][sent:]
        except BlockingIOError:
            pass
        except OSError:
            self._drop(pipe)
            return
        self._update(pipe)

    def _update(self, pipe: _Pipe) -> None:
        """Read only when the peer has no backlog, write only when there is something to write."""
        for sock, peer in pipe.peer.items():
            events = 0
            if not self._paused and not pipe.held:
                if not pipe.outgoing[peer]:
                    events |= selectors.EVENT_READ
                if pipe.outgoing[sock]:
                    events |= selectors.EVENT_WRITE
            key = self._selector.get_map().get(sock)
            if key is None and events:
                self._selector.register(sock, events, pipe)
            elif key is not None and not events:
                self._selector.unregister(sock)
            elif key is not None and key.events != events:
                self._selector.modify(sock, events, pipe)

    def _drop(self, pipe: _Pipe) -> None:
        for sock in pipe.peer:
            if self._selector.get_map().get(sock) is not None:
                self._selector.unregister(sock)
            self._pipes.pop(sock, None)
            with contextlib.suppress(OSError):
                sock.close()
