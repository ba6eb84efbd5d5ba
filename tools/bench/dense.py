"""Dense: push (applying SGD on the server) and pull of a whole 16 / 64 MiB float32 tensor.

shardps: a ``LocalCluster`` of 1 (and 2) server processes, one ``PSClient`` in this process
that joined a worker group (the path a training worker takes), ``push_dense`` of the whole
table, then ``pull_dense``. torch RPC: ``shardps.tools.bench.rpc_baseline`` moving the same tensor,
its push applying the same SGD update. Each round runs one shardps push + pull and then one
push + pull of each torch RPC configuration; the figures are medians over the rounds, after
one warm-up round each. GB/s counts float32 payload bytes (4 per element) per second.

Both systems have a same-host fast path, so each is measured twice:

* ``ps_*``: shardps as a worker runs it (``PSClient`` default: bulk bytes through shared
  memory when client and server share a host, gRPC for control);
* ``ps_tcp_*``: ``PSClient(shared_memory=False)``: every byte over gRPC/TCP, as between hosts;
* ``rpc_*``: TensorPipe with ``_transports=["uv"]`` and its default channels: torch RPC as
  it ships. On one host TensorPipe then moves tensor payloads with its ``cma`` channel
  (``process_vm_readv``, a copy between the two processes' memory; strace shows one call per
  push), only the control messages over TCP;
* ``rpc_tcp_*``: ``_transports=["uv"], _channels=["basic"]``: tensors over the TCP connection.

Keys: ``{ps,ps_tcp}_dense_{push,pull}_gbps_{16,64}mib_{1,2}s``,
``{rpc,rpc_tcp}_dense_{push,pull}_gbps_{16,64}mib``; headline ``ps_dense_push_gbps`` (and
``ps_tcp_``, ``rpc_``, ``rpc_tcp_``, pull) are the 16 MiB figures, one shardps server against
one torch RPC server. ``ps_tcp_dense_{push,pull}_gbps_16mib_1s_bf16``: bfloat16 on the wire
(GB/s of the float32 tensor moved).
"""

from __future__ import annotations

import time

import numpy as np

from shardps.tools.bench.common import BenchError, gbps, median, ratio, start_client
from shardps.tools.bench.config import MIB, BenchConfig
from shardps.tools.bench.rpc_baseline import RpcBaseline

RPC_CONFIGS = {"rpc": None, "rpc_tcp": ["basic"]}     # key prefix -> TensorPipe channels


def _check(what: str, got: float, grad0: float, pushes: int, lr: float) -> None:
    want = -lr * pushes * grad0
    if not np.isclose(got, want, rtol=1e-3, atol=1e-6):
        raise BenchError(f"{what}: after {pushes} SGD pushes the first value is {got}, expected {want}")


class _Timings:
    """Seconds per operation, keyed by metric name; each key moves a fixed number of bytes."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}
        self.nbytes: dict[str, int] = {}

    def add(self, key: str, nbytes: int, seconds: float) -> None:
        self.seconds.setdefault(key, []).append(seconds)
        self.nbytes[key] = nbytes

    def gbps(self, key: str) -> float:
        return gbps(self.nbytes[key], median(self.seconds[key]))


def _round(client, prefix: str, rpcs: dict, name: str, grad: np.ndarray, suffix: str, measured: bool,
           timings: _Timings, counts: dict, cfg: BenchConfig, wire: str) -> None:
    """One shardps push + pull, then one of each torch RPC configuration in ``rpcs``."""
    nbytes = grad.nbytes
    t0 = time.perf_counter()
    client.push_dense(name, grad)
    t1 = time.perf_counter()
    values = client.pull_dense(name)
    t2 = time.perf_counter()
    counts[(prefix, suffix)] = counts.get((prefix, suffix), 0) + 1
    if wire == "float32":
        _check(f"shardps {name}", float(values[0]), float(grad[0]), counts[(prefix, suffix)], cfg.dense_lr)
    if measured:
        timings.add(f"{prefix}_dense_push_gbps_{suffix}", nbytes, t1 - t0)
        timings.add(f"{prefix}_dense_pull_gbps_{suffix}", nbytes, t2 - t1)
    mib = nbytes // MIB
    for rpc_prefix, r in rpcs.items():
        tp, tl, first, numel = r.call("dense_round", name, cfg.dense_lr)
        counts[(rpc_prefix, name)] = counts.get((rpc_prefix, name), 0) + 1
        _check(f"{rpc_prefix} {name}", first, float(grad[0]), counts[(rpc_prefix, name)], cfg.dense_lr)
        if numel != grad.shape[0]:
            raise BenchError(f"{rpc_prefix} pull returned {numel} elements, expected {grad.shape[0]}")
        if measured:
            timings.add(f"{rpc_prefix}_dense_push_gbps_{mib}mib", nbytes, tp)
            timings.add(f"{rpc_prefix}_dense_pull_gbps_{mib}mib", nbytes, tl)


def _variants(servers: int) -> list[tuple[str, bool, str]]:
    """(key prefix, shared memory allowed, wire dtype) of the shardps clients measured."""
    out = [("ps", True, "float32"), ("ps_tcp", False, "float32")]
    return out + ([("ps_tcp", False, "bfloat16")] if servers == 1 else [])


def run(cfg: BenchConfig, progress) -> dict[str, float]:
    from shardps.tables import sgd, zeros
    from shardps.tools.local import LocalCluster
    from shardps.worker.client import PSClient

    grads = {mib: np.random.default_rng(cfg.seed).standard_normal(mib * MIB // 4, dtype=np.float32)
             for mib in cfg.dense_sizes_mib}
    timings = _Timings()
    counts: dict = {}
    rpcs = {prefix: RpcBaseline(channels) for prefix, channels in RPC_CONFIGS.items()}
    try:
        for prefix, r in rpcs.items():
            progress(f"starting torch RPC ({prefix}: uv transport, channels {RPC_CONFIGS[prefix] or 'default'})")
            r.start()
            for mib in cfg.dense_sizes_mib:
                r.call("create_dense", f"d{mib}", mib * MIB // 4, cfg.seed)
        for servers in cfg.dense_servers:
            progress(f"starting a shardps cluster of {servers} server(s)")
            with LocalCluster(servers=servers, replication=1) as cluster:
                for prefix, shm, wire in _variants(servers):
                    with PSClient(cluster.manager_address, f"bench-dense-{prefix}-{wire}", wire_dtype=wire,
                                  timeout=300.0, shared_memory=shm) as client:
                        start_client(client)
                        sizes = cfg.dense_sizes_mib if wire == "float32" else cfg.dense_sizes_mib[:1]
                        for mib in sizes:
                            name = f"d{mib}"
                            client.create_dense(name, (mib * MIB // 4,), optimizer=sgd(cfg.dense_lr),
                                                init=zeros())
                            suffix = f"{mib}mib_{servers}s" + ("" if wire == "float32" else "_bf16")
                            paired = rpcs if wire == "float32" else {}
                            for rnd in range(cfg.dense_rounds + 1):      # round 0 warms up
                                _round(client, prefix, paired, name, grads[mib], suffix, rnd > 0, timings,
                                       counts, cfg, wire)
                            line = (f"{mib} MiB, {servers} server(s), {prefix} {wire}: push "
                                    f"{timings.gbps(f'{prefix}_dense_push_gbps_{suffix}'):.2f} / pull "
                                    f"{timings.gbps(f'{prefix}_dense_pull_gbps_{suffix}'):.2f} GB/s")
                            for rp in paired:
                                line += (f"; {rp} push {timings.gbps(f'{rp}_dense_push_gbps_{mib}mib'):.2f}"
                                         f" / pull {timings.gbps(f'{rp}_dense_pull_gbps_{mib}mib'):.2f}")
                            progress(line)
                        client.leave()
    finally:
        for r in rpcs.values():
            r.stop()
    out = {key: timings.gbps(key) for key in timings.seconds}
    head, s = cfg.dense_sizes_mib[0], cfg.dense_servers[0]
    for op in ("push", "pull"):
        for prefix in ("ps", "ps_tcp"):
            out[f"{prefix}_dense_{op}_gbps"] = out[f"{prefix}_dense_{op}_gbps_{head}mib_{s}s"]
        for prefix in RPC_CONFIGS:
            out[f"{prefix}_dense_{op}_gbps"] = out[f"{prefix}_dense_{op}_gbps_{head}mib"]
        out[f"ratio_dense_{op}_ps_over_rpc"] = ratio(out[f"ps_dense_{op}_gbps"], out[f"rpc_dense_{op}_gbps"])
        out[f"ratio_dense_{op}_ps_tcp_over_rpc_tcp"] = ratio(out[f"ps_tcp_dense_{op}_gbps"],
                                                            out[f"rpc_tcp_dense_{op}_gbps"])
    return out
