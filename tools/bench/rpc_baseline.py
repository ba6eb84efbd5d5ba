"""The torch RPC baseline: ``torch.distributed.rpc`` over TensorPipe, as a parameter server.

Two processes: ``ps`` holds the tensors; ``trainer`` calls it with ``rpc_sync`` and times each
call. The benchmark process drives the trainer through a pipe, one round at a time, so that
rounds of shardps and of torch RPC interleave (side by side on a noisy machine).

* dense push: ``rpc_sync(ps, push_dense, (name, grad, lr))``; the ps applies the same SGD
  update shardps applies (``w -= lr * grad``) before answering. Dense pull returns the tensor.
* sparse pull: ``table[ids]`` (gather); sparse push: ``table.index_add_(0, ids, grads,
  alpha=-lr)`` (SGD scatter-update) on a preallocated ``[rows, dim]`` table.

Transports: ``_transports=["uv"]`` pins TensorPipe to TCP (libuv), as between two hosts.
``channels=None`` keeps TensorPipe's default channels, which on one host include ``cma``
(process_vm_readv, a memory copy between processes, not TCP) for tensor payloads;
``channels=["basic"]`` sends tensors over the same TCP connection too. The benchmark
measures both.
"""

from __future__ import annotations

import time
from typing import Any

from shardps.tools.bench.common import BenchError, Children, free_port

_TABLES: dict = {}      # in the ps process


# ---------------------------------------------------------------- functions run on the ps
def create_dense(name: str, numel: int) -> None:
    import torch
    _TABLES[name] = torch.zeros(numel, dtype=torch.float32)


def push_dense(name: str, grad, lr: float) -> None:
    _TABLES[name].add_(grad, alpha=-lr)


def pull_dense(name: str):
    return _TABLES[name]


def create_sparse(name: str, rows: int, dim: int, seed: int) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    _TABLES[name] = torch.randn(rows, dim, generator=g) * 0.01


def gather(name: str, ids):
    return _TABLES[name].index_select(0, ids)


def scatter_sgd(name: str, ids, grads, lr: float) -> None:
    _TABLES[name].index_add_(0, ids, grads, alpha=-lr)


# ---------------------------------------------------------------- processes
def _options(port: int, channels):
    from torch.distributed import rpc
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", _transports=["uv"],
                                           _channels=channels, num_worker_threads=8, rpc_timeout=300)


def _quiet() -> None:
    import warnings
    warnings.filterwarnings("ignore")       # torch.distributed's device-selection notices


def _ps_main(port: int, channels) -> None:
    _quiet()
    import torch
    from torch.distributed import rpc
    torch.set_num_threads(1)
    rpc.init_rpc("ps", rank=1, world_size=2, rpc_backend_options=_options(port, channels))
    rpc.shutdown()          # blocks until the trainer shuts down too


def _trainer_main(port: int, channels, conn) -> None:
    _quiet()
    import numpy as np
    import torch
    from torch.distributed import rpc
    torch.set_num_threads(1)
    rpc.init_rpc("trainer", rank=0, world_size=2, rpc_backend_options=_options(port, channels))
    grads: dict = {}
    try:
        conn.send(("ready", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send(("ok", _serve(cmd, args, grads, np, torch, rpc)))
            except Exception as exc:           # report to the driver, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        rpc.shutdown()


def _serve(cmd: str, args: tuple, grads: dict, np, torch, rpc):
    if cmd == "create_dense":
        name, numel, seed = args
        rpc.rpc_sync("ps", create_dense, (name, numel))
        grads[name] = torch.from_numpy(np.random.default_rng(seed).standard_normal(numel, dtype=np.float32))
        return None
    if cmd == "dense_round":                  # -> (push seconds, pull seconds, first value)
        name, lr = args
        t0 = time.perf_counter()
        rpc.rpc_sync("ps", push_dense, (name, grads[name], lr))
        t1 = time.perf_counter()
        values = rpc.rpc_sync("ps", pull_dense, (name,))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, float(values[0]), int(values.numel())
    if cmd == "create_sparse":
        name, rows, dim, seed = args
        rpc.rpc_sync("ps", create_sparse, (name, rows, dim, seed))
        return None
    if cmd == "sparse_round":                 # -> (pull seconds, push seconds)
        name, ids, grads_np, lr = args
        ids_t = torch.from_numpy(ids)
        g = torch.from_numpy(grads_np)
        t0 = time.perf_counter()
        rows = rpc.rpc_sync("ps", gather, (name, ids_t))
        t1 = time.perf_counter()
        rpc.rpc_sync("ps", scatter_sgd, (name, ids_t, g, lr))
        t2 = time.perf_counter()
        if tuple(rows.shape) != tuple(grads_np.shape):
            raise BenchError(f"gather returned {tuple(rows.shape)}, expected {grads_np.shape}")
        return t1 - t0, t2 - t1
    raise BenchError(f"unknown command {cmd!r}")


class RpcBaseline:
    """A torch RPC ps + trainer pair. Context manager; ``call(cmd, *args)`` runs one command
    in the trainer and returns its result (BenchError on failure or after ``timeout``)."""

    def __init__(self, channels: list[str] | None = None, timeout: float = 300.0):
        self.channels = channels
        self.timeout = timeout
        self._children = Children()
        self._conn: Any = None       # the trainer's end of a multiprocessing Pipe, once started

    def start(self) -> "RpcBaseline":
        try:
            port = free_port()
            ctx = self._children.ctx
            parent, child = ctx.Pipe()
            self._children.spawn(_ps_main, port, self.channels)
            self._children.spawn(_trainer_main, port, self.channels, child)
            self._conn = parent
            self._expect("ready", 120.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _expect(self, what: str, timeout: float):
        if not self._conn.poll(timeout):
            raise BenchError(f"torch RPC trainer gave no answer in {timeout:.0f}s (expected {what})")
        status, value = self._conn.recv()
        if status == "error":
            raise BenchError(f"torch RPC trainer: {value}")
        return value

    def call(self, cmd: str, *args):
        self._conn.send((cmd, args))
        return self._expect(cmd, self.timeout)

    def stop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            for p in self._children.procs:
                p.join(15)
            self._conn.close()
            self._conn = None
        self._children.stop()

    def __enter__(self) -> "RpcBaseline":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
