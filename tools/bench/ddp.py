"""The DDP baselines: the ``ctr`` model trained with ``DistributedDataParallel`` over gloo.

What a user would run instead of a parameter server: ``world`` processes on 127.0.0.1, each
with the whole model; ``build_ctr`` supplies the same data, model and hyperparameters as the
shardps workers, with ``nn.Embedding(rows, 16, sparse=...)`` in place of ``PSEmbedding``
(initialised N(0, 0.01) like it). Optimizers as ``worker/models/ctr.py`` names them, through
``shardps.worker.runtime.torch_optimizer``: Adagrad(lr 0.05) on the embedding (torch's
Adagrad takes sparse gradients), Adam(lr 2e-3) on the MLP. DDP averages the gradients of the
ranks every step: a dense embedding all-reduces the whole ``rows x 16`` gradient, a sparse one
all-gathers the touched rows. Each rank reads the strided slice ``shard_indices(n, 0, seed,
rank, world)`` of the epoch's permutation, as a shardps worker does, cut to the same number
of batches on every rank (DDP needs equal step counts). One thread per process.

Each rank reports: samples, the training-loop wall time (after set-up and data generation,
before evaluation), its peak RSS (VmHWM), and rank 0 the test AUC.

``model="digits-cnn"`` (the hybrid part): the digits CNN as ``shardps worker`` builds it, its
optimizer for every parameter, its epochs and learning-rate schedule; rank 0 reports its
``test_accuracy``.
"""

from __future__ import annotations

import time

from shardps.tools.bench.common import BenchError, Children, self_peak_rss_kb


def _rank_main(rank: int, world: int, port: int, opts: dict, queue) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    try:
        queue.put((rank, _train(rank, world, port, opts)))
    except BaseException as exc:        # the driver reports it
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def _train(rank: int, world: int, port: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardps.worker.data import batches, shard_indices, take_batch
    from shardps.worker.models.ctr import DIM, build_ctr
    from shardps.worker.runtime import torch_optimizer

    torch.set_num_threads(1)
    rows, sparse, seed = opts["rows"], opts["sparse"], opts["seed"]
    # the driver holds the store (bound to a port of its own choosing): no port is probed
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)
        if opts.get("model", "ctr") == "ctr":
            emb = nn.Embedding(rows, DIM, sparse=sparse)
            nn.init.normal_(emb.weight, 0.0, 0.01)
            task = build_ctr(seed=seed, rows=rows, train_samples=opts["train_samples"], embedding=emb)
        else:
            from shardps.worker.models import build
            task = build(opts["model"], seed=seed)
        model = DDP(task.model)                      # broadcasts rank 0's parameters
        optimizers = []
        for name, p in task.model.named_parameters():
            table = name.rsplit(".", 1)[0]
            cfg = task.optimizers.get(table, task.optimizer)
            optimizers.append(torch_optimizer(cfg, [p], sparse=sparse and table == "embedding"))
        bases = [[g["lr"] for g in o.param_groups] for o in optimizers]
        x, y = task.train
        bs = task.batch_size
        steps = x.shape[0] // world // bs
        if opts.get("steps"):
            steps = min(steps, opts["steps"])
        epochs = opts.get("epochs") or (task.epochs if opts.get("model", "ctr") != "ctr" else 1)
        dist.barrier()
        started = time.perf_counter()
        samples = 0
        for epoch in range(epochs):
            factor = task.lr_schedule(epoch, epochs) if task.lr_schedule is not None else 1.0
            for o, base in zip(optimizers, bases):
                for group, lr in zip(o.param_groups, base):
                    group["lr"] = lr * factor
            for b in batches(shard_indices(x.shape[0], epoch, seed, rank, world)[:steps * bs], bs):
                loss = task.loss(model(take_batch(x, b)), take_batch(y, b))
                for o in optimizers:
                    o.zero_grad()
                loss.backward()
                for o in optimizers:
                    o.step()
                samples += len(b)
        wall = time.perf_counter() - started
        result: dict = {"samples": samples, "steps": steps * epochs, "wall_seconds": wall,
                        "peak_rss_kb": self_peak_rss_kb()}
        if rank == 0 and opts.get("evaluate", True):
            metrics = task.evaluate(task.model, *task.test)
            result["metrics"], result["test_auc"] = metrics, metrics.get("test_auc", float("nan"))
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def run_ddp(rows: int, sparse: bool, train_samples: int, world: int = 2, seed: int = 0,
            steps: int = 0, evaluate: bool = True, timeout: float = 900.0, model: str = "ctr",
            epochs: int = 0) -> list[dict]:
    """Train with DDP in ``world`` spawned processes; one result dict per rank, rank order.
    ``epochs``: the model's (0: its default; ctr: 1)."""
    opts = {"rows": rows, "sparse": sparse, "train_samples": train_samples, "seed": seed,
            "steps": steps, "evaluate": evaluate, "model": model, "epochs": epochs}
    import torch.distributed as dist

    # the ranks' rendezvous: a store listening on port 0 here, its port handed to them
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    with Children() as children:
        queue = children.ctx.Queue()
        for rank in range(world):
            children.spawn(_rank_main, rank, world, store.port, opts, queue)
        results: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        import queue as queue_mod
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"DDP ({'sparse' if sparse else 'dense'}, {rows:,} rows) timed out "
                                 f"after {timeout:.0f}s")
            try:
                rank, res = queue.get(timeout=min(remaining, 5.0))
            except queue_mod.Empty:
                dead = [p for p in children.procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise BenchError(f"a DDP rank exited with {dead[0].exitcode} before reporting") from None
                continue
            if "error" in res:
                raise BenchError(f"DDP rank {rank}: {res['error']}")
            results[rank] = res
        for p in children.procs:
            p.join(30)
    return [results[r] for r in range(world)]


def summarize(results: list[dict]) -> dict:
    """Aggregate samples/s (all ranks' samples over the slowest rank's wall time), AUC, RSS."""
    samples = sum(r["samples"] for r in results)
    wall = max(r["wall_seconds"] for r in results)
    return {"samples_per_s": samples / wall if wall > 0 else float("nan"),
            "auc": results[0].get("test_auc", float("nan")),
            "rank0_peak_rss_mb": results[0]["peak_rss_kb"] / 1024.0,
            "steps": results[0]["steps"]}
