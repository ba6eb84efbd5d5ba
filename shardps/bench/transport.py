"""Transport ceiling: a raw TCP socket between two Python processes on loopback.

The client sends ``tcp_mib`` MiB with ``sendall`` and waits for a one-byte acknowledgement
(``tcp_gbps``: the push direction); then it sends a one-byte request and the other process
answers with the same amount (``tcp_pull_gbps``). Receivers ``recv_into`` a preallocated buffer: no per-message copies.
This is what any Python data path on this machine could reach at best.
"""

from __future__ import annotations

import socket
import time

from shardps.bench.common import Children, gbps, median
from shardps.bench.config import MIB, BenchConfig


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("peer closed the connection")
        got += k


def _peer(port: int, nbytes: int, repeats: int) -> None:
    """The other process: receive `repeats` messages (ack each), then answer `repeats` requests."""
    with socket.create_connection(("127.0.0.1", port)) as conn:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        for _ in range(repeats):
            _recv_exact(conn, view)
            conn.sendall(b"k")
        request = memoryview(bytearray(1))
        for _ in range(repeats):
            _recv_exact(conn, request)
            conn.sendall(view)


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    nbytes = cfg.tcp_mib * MIB
    with socket.socket() as listener, Children() as children:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(60)
        children.spawn(_peer, listener.getsockname()[1], nbytes, cfg.tcp_repeats)
        conn, _ = listener.accept()
        conn.settimeout(60)
        with conn:
            payload = memoryview(bytearray(nbytes))
            ack = memoryview(bytearray(1))
            send, recv = [], []
            for _ in range(cfg.tcp_repeats):
                t0 = time.perf_counter()
                conn.sendall(payload)
                _recv_exact(conn, ack)
                send.append(time.perf_counter() - t0)
            for _ in range(cfg.tcp_repeats):
                t0 = time.perf_counter()
                conn.sendall(b"r")
                _recv_exact(conn, payload)
                recv.append(time.perf_counter() - t0)
    out = {"tcp_gbps": gbps(nbytes, median(send)), "tcp_pull_gbps": gbps(nbytes, median(recv))}
    progress(f"{cfg.tcp_mib} MiB x {cfg.tcp_repeats}: send {out['tcp_gbps']:.2f} GB/s, "
             f"receive {out['tcp_pull_gbps']:.2f} GB/s")
    return out
