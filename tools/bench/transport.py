"""Transport: the ceiling of a raw socket, and what one call costs on each transport.

Ceiling (``tcp_gbps``, ``tcp_pull_gbps``): the client sends ``tcp_mib`` MiB with ``sendall``
and waits for a one-byte acknowledgement (the push direction); then it sends a one-byte request
and the other process answers with the same amount. Receivers ``recv_into`` a preallocated
buffer: no per-message copies. This is what any Python data path on this machine could reach
at best.

Call cost (``transport_<system>_<size>_{rtt,cpu}_us``): a client process calls a server
process on loopback, one call at a time, over (a) ``raw``: a TCP socket with length-prefixed
frames, the floor, minimal code; (b) ``grpc``: grpcio unary with identity serializers and the
channel and server options of ``shardps.rpc.channels``, as shardps uses gRPC today; (c)
``dataplane``: ``shardps.rpc.dataplane`` (plain TCP; ``dataplane_sockio``: the same with its
frames read and sent by ``shardps.rpc.sockio``'s compiled calls, ``compiled_io=True``).
``small``: 64 bytes in, 64 bytes back;
``1mib``: 1 MiB in, 64 bytes back (a push). ``rtt``: the median call time of a round; ``cpu``:
CPU seconds (``time.process_time``, every thread) of client plus server per call
(``..._client_cpu_us`` / ``..._server_cpu_us`` apart). Each figure is the median of
``transport_rounds`` rounds; a round runs every system in turn (the order rotates), so the
systems see the same machine load. ``transport_ps_small_*``: a 1-row pull through ``PSClient`` against
a one-server cluster (``transport_ps_grpc_small_*``: the same over gRPC).

A ctr step (``transport_ps_step_*``, see ``_ps_step``): its exchange with 2 server processes
at replication 1 and 2, wall and CPU per step, against ``transport_ctr_step_compute_cpu_ms``
(the step's forward and backward in one thread): ``ratio_transport_step_cpu_over_compute``.
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np

from shardps.tools.bench.common import BenchError, Children, gbps, median, proc_cpu_seconds, ratio
from shardps.tools.bench.config import MIB, BenchConfig


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


def _ceiling(cfg: BenchConfig, progress) -> dict[str, float]:
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


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    out = _ceiling(cfg, progress)
    out.update(_call_costs(cfg, progress))
    out.update(_ps_small_call(cfg, progress))
    out.update(_ps_step(cfg, progress))
    out.update(_ps_step(cfg, progress, replication=2))
    out.update(ctr_compute(progress))
    compute = out["transport_ctr_step_compute_cpu_ms"]
    data_path = out["transport_ps_step_exchange_client_cpu_ms"] + out["transport_ps_step_exchange_server_cpu_ms"]
    out["ratio_transport_step_cpu_over_compute"] = ratio(data_path, compute)
    out["ratio_transport_ps_small_rtt_over_raw"] = ratio(out["transport_ps_small_rtt_us"],
                                                         out["transport_raw_small_rtt_us"])
    progress(f"data path CPU per ctr step {data_path:.2f} ms = {out['ratio_transport_step_cpu_over_compute']:.2f} "
             f"x the step's compute ({compute:.2f} ms)")
    return out


def ctr_compute(progress, steps: int = 60) -> dict[str, float]:
    """``transport_ctr_step_compute_cpu_ms``: the CPU of one ctr training step's forward and
    backward on one thread (a batch of 512 samples of the ctr data, the rows it touches as a
    sparse ``nn.Embedding``, the MLP 416-64-1, BCE), median over ``steps`` steps: what a
    worker computes per step, against which the data path's CPU per step is a ratio."""
    import torch
    from torch import nn

    from shardps.worker.models import ctr
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = 1_000_000
    ids, clicks, _ = ctr.generate(512 * (steps + 10), rows, seed=1000)
    model = ctr.CTRModel(rows, nn.Embedding(rows, ctr.DIM, sparse=True))
    x, y = torch.from_numpy(ids), torch.from_numpy(clicks)
    times = []
    for i in range(steps + 10):
        b = slice(i * 512, (i + 1) * 512)
        t0 = time.thread_time()
        model.zero_grad(set_to_none=True)
        ctr.bce(model(x[b]), y[b]).backward()
        if i >= 10:
            times.append(time.thread_time() - t0)
    out = {"transport_ctr_step_compute_cpu_ms": median(times) * 1e3}
    progress(f"a ctr step's forward and backward: {out['transport_ctr_step_compute_cpu_ms']:.2f} ms of CPU "
             f"(one thread)")
    return out


# ---------------------------------------------------------------- call cost per transport
SYSTEMS = ("raw", "grpc", "dataplane", "dataplane_sockio")
LABELS = {"raw": "raw TCP socket", "grpc": "grpcio unary", "dataplane": "data plane",
          "dataplane_sockio": "  with sockio"}
SIZES = {"small": 64, "1mib": MIB}
REPLY = b"r" * 64
_LEN = struct.Struct("<I")
_GRPC_METHOD = "/shardps.tools.bench.Transport/Call"
_DATAPLANE_METHOD = 1


def _raw_serve(conn: socket.socket) -> None:
    """The floor's server: a 4-byte length and that many bytes, read into one buffer (as
    much as has arrived per ``recv_into``: one call for a small frame), answered with REPLY
    framed the same way."""
    buf = memoryview(bytearray(MIB + 64))
    answer = _LEN.pack(len(REPLY)) + REPLY
    with conn:
        while True:
            got = conn.recv_into(buf)
            if not got:
                return
            while got < _LEN.size:
                n = conn.recv_into(buf[got:])
                if not n:
                    return
                got += n
            total = _LEN.size + _LEN.unpack_from(buf)[0]
            if got < total:
                _recv_exact(conn, buf[got:total])
            conn.sendall(answer)


def _call_server(system: str, pipe) -> None:
    """A server process: serve ``system`` on loopback, send its port, then answer ``cpu``
    (this process's CPU seconds) until ``stop``."""
    import threading
    if system == "raw":
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)

        def accept_loop():
            while True:
                conn, _ = listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=_raw_serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept_loop, daemon=True).start()
        port = listener.getsockname()[1]
    elif system == "grpc":
        import grpc

        from shardps.rpc import channels
        handler = grpc.method_handlers_generic_handler("shardps.tools.bench.Transport", {
            "Call": grpc.unary_unary_rpc_method_handler(lambda request, context: REPLY)})
        server = channels.new_server(handlers=[handler])
        port = channels.add_port(server, "127.0.0.1:0")
        server.start()
    else:
        from shardps.rpc.dataplane import DataPlaneServer
        server = DataPlaneServer(lambda method, header, payload, call: (b"", [REPLY]),
                                 compiled_io=system == "dataplane_sockio").start()
        port = server.port
    pipe.send(port)
    while True:
        cmd = pipe.recv()
        if cmd == "stop":
            return
        pipe.send(time.process_time())


def _caller(system: str, port: int):
    """``call(payload)`` for one blocking call of ``system``, checked."""
    if system == "raw":
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.settimeout(None)               # the floor: blocking calls, no poll() before each
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reply = memoryview(bytearray(4 + len(REPLY)))

        def raw_call(payload):
            parts = [memoryview(_LEN.pack(len(payload))), memoryview(payload)]
            while parts:                    # sendmsg: no copy of the payload into a frame
                sent = sock.sendmsg(parts)
                while sent:
                    if sent >= len(parts[0]):
                        sent -= len(parts.pop(0))
                    else:
                        parts[0], sent = parts[0][sent:], 0
            _recv_exact(sock, reply)
        return raw_call
    if system == "grpc":
        from shardps.rpc import channels
        stub = channels.channel(f"127.0.0.1:{port}").unary_unary(_GRPC_METHOD)

        def grpc_call(payload):
            if len(stub(payload, timeout=60)) != len(REPLY):
                raise BenchError("gRPC: wrong reply")
        return grpc_call
    from shardps.rpc.dataplane import DataPlaneConnection
    conn = DataPlaneConnection(f"127.0.0.1:{port}", compiled_io=system == "dataplane_sockio")

    def dataplane_call(payload):
        if len(conn.call(_DATAPLANE_METHOD, b"", [payload], timeout=60)[1]) != len(REPLY):
            raise BenchError("data plane: wrong reply")
    return dataplane_call


def _call_client(system: str, port: int, pipe) -> None:
    """A client process: for each ``(nbytes, calls)`` it gets, make ``calls`` calls of
    ``nbytes`` and send back (median seconds per call, CPU seconds per call); ``stop`` ends."""
    call = _caller(system, port)
    payloads = {n: bytes(n) for n in SIZES.values()}
    pipe.send("ready")
    while True:
        cmd = pipe.recv()
        if cmd == "stop":
            return
        nbytes, calls = cmd
        payload = payloads[nbytes]
        times = []
        cpu0 = time.process_time()
        for _ in range(calls):
            t0 = time.perf_counter()
            call(payload)
            times.append(time.perf_counter() - t0)
        pipe.send((median(times), (time.process_time() - cpu0) / calls))


def _expect(pipe, what: str, timeout: float = 120.0):
    try:
        if pipe.poll(timeout):
            return pipe.recv()
    except EOFError:
        raise BenchError(f"transport: {what} exited (its error is above)") from None
    raise BenchError(f"transport: {what} gave no answer in {timeout:.0f}s")


def _call_costs(cfg: BenchConfig, progress) -> dict[str, float]:
    calls = {"small": cfg.transport_small_calls, "1mib": cfg.transport_1mib_calls}
    samples: dict[str, list[float]] = {}
    with Children() as children:
        servers, clients = {}, {}
        for system in SYSTEMS:
            servers[system], child = children.ctx.Pipe()
            children.spawn(_call_server, system, child)
        ports = {s: _expect(p, f"the {s} server") for s, p in servers.items()}
        for system in SYSTEMS:
            clients[system], child = children.ctx.Pipe()
            children.spawn(_call_client, system, ports[system], child)
        for s, p in clients.items():
            _expect(p, f"the {s} client")

        def measure(system: str, size: str, n: int) -> tuple[float, float, float]:
            servers[system].send("cpu")
            before = _expect(servers[system], f"the {system} server")
            clients[system].send((SIZES[size], n))
            rtt, client_cpu = _expect(clients[system], f"the {system} client", cfg.process_timeout_s)
            servers[system].send("cpu")
            server_cpu = (_expect(servers[system], f"the {system} server") - before) / n
            return rtt, client_cpu, server_cpu

        for system in SYSTEMS:                          # warm-up: connections, buffers, caches
            for size in SIZES:
                measure(system, size, max(2, calls[size] // 5))
        for r in range(cfg.transport_rounds):
            order = SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]
            for system in order:
                for size in SIZES:
                    rtt, ccpu, scpu = measure(system, size, calls[size])
                    for key, value in (("rtt", rtt), ("client_cpu", ccpu), ("server_cpu", scpu),
                                       ("cpu", ccpu + scpu)):
                        samples.setdefault(f"transport_{system}_{size}_{key}_us", []).append(value * 1e6)
            progress(f"call cost: round {r + 1}/{cfg.transport_rounds}")
        for p in list(servers.values()) + list(clients.values()):
            p.send("stop")
    out = {k: median(v) for k, v in samples.items()}
    for line in _table(out, cfg):
        progress(line)
    return out


def _table(out: dict[str, float], cfg: BenchConfig) -> list[str]:
    lines = [f"call cost, medians of {cfg.transport_rounds} rounds ({cfg.transport_small_calls} x 64 B, "
             f"{cfg.transport_1mib_calls} x 1 MiB); CPU = client + server:",
             f"  {'':16}{'64 B p50':>10}{'64 B CPU':>10}{'x raw':>7}{'1 MiB p50':>11}{'1 MiB CPU':>11}{'x raw':>7}"]
    for s in SYSTEMS:
        k = f"transport_{s}"
        lines.append(f"  {LABELS[s]:16}{out[k + '_small_rtt_us']:8.0f}us{out[k + '_small_cpu_us']:8.0f}us"
                     f"{out[k + '_small_cpu_us'] / out['transport_raw_small_cpu_us']:7.2f}"
                     f"{out[k + '_1mib_rtt_us']:9.0f}us{out[k + '_1mib_cpu_us']:9.0f}us"
                     f"{out[k + '_1mib_cpu_us'] / out['transport_raw_1mib_cpu_us']:7.2f}")
    return lines


def _ps_small_call(cfg: BenchConfig, progress) -> dict[str, float]:
    """A 1-row ``PSClient.pull_rows`` against a one-server ``LocalCluster`` (manager and
    server in their own processes, the client here), over the data plane and, for
    comparison, over gRPC (``data_plane=False``): p50 round trip and client + server CPU
    per call, medians of ``transport_rounds`` interleaved rounds."""
    from shardps.tables import sgd
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient

    n = cfg.transport_small_calls
    samples: dict[str, list[float]] = {}
    with LocalCluster(servers=1, replication=1) as cluster:
        server_pid = next(iter(cluster.servers.values())).popen.pid
        clients = {"ps": PSClient(cluster.manager_address, "transport-bench"),
                   "ps_grpc": PSClient(cluster.manager_address, "transport-bench", data_plane=False)}
        try:
            clients["ps"].create_job()
            clients["ps"].create_sparse("e", 16, optimizer=sgd(0.1))
            one = np.array([7], dtype=np.int64)
            for c in clients.values():                  # connections, map, data plane
                for _ in range(20):
                    c.pull_rows("e", one)
            for r in range(cfg.transport_rounds):
                for name in (("ps", "ps_grpc") if r % 2 == 0 else ("ps_grpc", "ps")):
                    c, times = clients[name], []
                    cpu0, server0 = time.process_time(), proc_cpu_seconds(server_pid)
                    for _ in range(n):
                        t0 = time.perf_counter()
                        c.pull_rows("e", one)
                        times.append(time.perf_counter() - t0)
                    cpu = (time.process_time() - cpu0 + proc_cpu_seconds(server_pid) - server0) / n
                    samples.setdefault(f"transport_{name}_small_rtt_us", []).append(median(times) * 1e6)
                    samples.setdefault(f"transport_{name}_small_cpu_us", []).append(cpu * 1e6)
        finally:
            for c in clients.values():
                c.close()
    out = {k: median(v) for k, v in samples.items()}
    progress(f"PSClient 1-row pull: data plane {out['transport_ps_small_rtt_us']:.0f} us p50, "
             f"{out['transport_ps_small_cpu_us']:.0f} us CPU; gRPC {out['transport_ps_grpc_small_rtt_us']:.0f} "
             f"us p50, {out['transport_ps_grpc_small_cpu_us']:.0f} us CPU")
    return out


def _ps_step(cfg: BenchConfig, progress, replication: int = 1) -> dict[str, float]:
    """A ctr step against 2 server processes (replication 1), one client: this step's push
    (the distinct rows of a batch of 512 samples of the ctr data, 26 ids each: about 1,780
    rows x 16, and a 27,000-parameter dense table) and the next batch's pull, as one
    ``exchange_async`` and as a ``push_many`` then a ``pull_many``; medians over
    ``transport_rounds`` interleaved rounds of 20 steps, and CPU milliseconds per step
    (``_client_cpu_ms``: this process; ``_server_cpu_ms``: both servers) over all of them.
    ``replication`` 2: every block on both servers, the exchange only
    (``transport_ps_step_exchange_r2_*``)."""
    from shardps import kernels
    from shardps.tables import adagrad, adam, normal
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient
    from shardps.worker.models import ctr

    batches = ctr.generate(512 * 400, 1_000_000, seed=1000)[0].reshape(400, -1)
    turn = iter(range(1 << 30))
    dense_grad = np.ones(27_000, np.float32)

    def batch() -> np.ndarray:
        return kernels.unique_inverse(batches[next(turn) % batches.shape[0]])[0]

    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}                # way -> [client, servers] CPU seconds
    with LocalCluster(servers=2, replication=replication) as cluster:
        pids = [s.popen.pid for s in cluster.servers.values()]
        with PSClient(cluster.manager_address, "transport-step") as c:
            c.create_job()
            c.join(heartbeat=False)
            c.create_sparse("emb", 16, num_rows=1_000_000, optimizer=adagrad(0.05),
                            init=normal(0.0, 0.01, seed=7))          # as the ctr model's
            c.create_dense("mlp", (27_000,), optimizer=adam(1e-3))

            def exchange(u, v):
                c.exchange_async([("mlp", dense_grad), ("emb", u, np.ones((len(u), 16), np.float32))],
                                 [("mlp",), ("emb", v)], clock=0).result()

            def push_then_pull(u, v):
                c.push_many([("mlp", dense_grad), ("emb", u, np.ones((len(u), 16), np.float32))])
                c.pull_many([("mlp",), ("emb", v)])

            ways = ({"transport_ps_step_exchange_ms": exchange, "transport_ps_step_push_pull_ms": push_then_pull}
                    if replication == 1 else {f"transport_ps_step_exchange_r{replication}_ms": exchange})
            for fn in ways.values():
                for _ in range(5):
                    fn(batch(), batch())
            for r in range(cfg.transport_rounds):
                for key, fn in (ways.items() if r % 2 == 0 else reversed(ways.items())):
                    times = []
                    steps = [(batch(), batch()) for _ in range(20)]
                    spent = cpu.setdefault(key, [0.0, 0.0])
                    client0, servers0 = time.process_time(), sum(proc_cpu_seconds(p) for p in pids)
                    for u, v in steps:
                        t0 = time.perf_counter()
                        fn(u, v)
                        times.append((time.perf_counter() - t0) * 1e3)
                    spent[0] += time.process_time() - client0
                    spent[1] += sum(proc_cpu_seconds(p) for p in pids) - servers0
                    samples.setdefault(key, []).append(median(times))
    out = {k: median(v) for k, v in samples.items()}
    for key, (client, servers) in cpu.items():
        n = 20 * cfg.transport_rounds
        out[key.replace("_ms", "_client_cpu_ms")] = client / n * 1e3
        out[key.replace("_ms", "_server_cpu_ms")] = servers / n * 1e3
    key = "transport_ps_step_exchange" + ("" if replication == 1 else f"_r{replication}")
    progress(f"a ctr step against 2 servers at replication {replication}: exchange {out[key + '_ms']:.2f} ms "
             f"(CPU: client {out[key + '_client_cpu_ms']:.2f} ms, servers {out[key + '_server_cpu_ms']:.2f} ms)"
             + (f", push then pull {out['transport_ps_step_push_pull_ms']:.2f} ms" if replication == 1 else ""))
    return out
