"""A TCP proxy on loopback that can be cut and healed: a partition between two processes
without network namespaces (the fault-schedule verifier and the manager-HA tests put one
between each manager replica and etcd)."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards connections to ``127.0.0.1:<port>`` (``address``) to ``target`` (host, port).

    ``cut()`` closes every forwarded connection and makes new ones close at once (the peer
    sees a refused or reset connection, as across a partition that resets); ``heal()`` forwards
    again. ``close()`` stops it. Thread-safe.
    """

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            conns, self._open = list(self._open), set()
        for s in conns:
            _close(s)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refused = self._cut
            if refused:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
