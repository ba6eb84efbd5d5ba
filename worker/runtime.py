"""The training worker (``shardps worker``) and the single-process baseline it is compared to.

A worker joins its job's worker group, builds the registered model, trains on its share of
the data (``shardps.worker.data``) pulling parameters from and pushing gradients to the
servers, evaluates on the held-out test set, and prints one final line such as

    shardps worker rank=0 steps=460 test_accuracy=0.9806 wall_seconds=12.3

Progress: a tqdm bar on rank 0 when attached to a terminal, log lines otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("shardps.worker")
WAIT_WORKERS_SECONDS = 600.0        # --wait-workers: how long a worker waits for the others
CACHE_STALENESS_SAMPLES = 4096      # --cache-staleness 0: the steps this many samples take


def cache_staleness_for(batch: int, lookahead: int = 1) -> int:
    """``--cache-staleness 0``: the steps ``CACHE_STALENESS_SAMPLES`` samples take at ``batch``,
    at least ``lookahead`` (the age of the youngest cached row when a lookup is planned: a
    lower bound would never read one)."""
    return max(1, lookahead, CACHE_STALENESS_SAMPLES // max(1, batch))


def add_training_flags(fs) -> None:
    fs.add("--job", "demo", "job (worker group) name")
    fs.add("--model", "digits-cnn", "registered model: digits-cnn, mnist-cnn or ctr")
    fs.add("--mode", "async", "consistency: async (ASP), sync (BSP) or ssp (bounded staleness)",
           choices=["async", "sync", "ssp"])
    fs.add("--staleness", 2, "SSP bound T: a pull waits while clock - slowest clock > T")
    fs.add("--epochs", 0, "epochs (0: the model's default)")
    fs.add("--steps", 0, "stop after this many steps per worker (0: no limit)")
    fs.add("--batch-size", 0, "per-worker batch size (0: the model's default)")
    fs.add("--lr", 0.0, "learning rate of every table (0: the model's default)")
    fs.add("--scale-lr", False, "linear scaling rule: multiply the learning rate by the number of workers")
    fs.add("--seed", 0, "seed of the model's initial values and the data order")
    fs.add("--wire-dtype", "float32", "dtype of values on the wire: float32, float16 or bfloat16",
           choices=["float32", "float16", "bfloat16"])
    fs.add("--data-dir", "", "where optional data sets (MNIST) are found")
    fs.add("--ctr-rows", 1_000_000, "ctr: embedding table rows")
    fs.add("--train-samples", 0, "ctr: training samples (0: the default)")
    fs.add("--torch-threads", 1, "torch intra-op threads per worker")
    fs.add("--device", "auto", "where the model, the batches and evaluation run: cpu; cuda:N (that GPU); "
           "cuda (a GPU, picked as auto picks one; fails without one); auto: cuda:{LOCAL_RANK mod GPUs} "
           "(torchrun's convention; without LOCAL_RANK the worker's rank stands in) when torch sees a "
           "GPU, else the CPU")
    fs.add("--plot", "", "write the loss / metric curve as a PNG here at the end")
    fs.add("--result-file", "", "write the final result as JSON here")
    fs.add("--step-delay", 0.0, "sleep this long per step (to simulate a slow worker)")
    fs.add("--prefetch", True, "prefetch the next batch's embedding rows during the step")
    fs.add("--overlap", True, "send each push in the background and prefetch the next step's "
           "dense values meanwhile (one push in flight)")
    fs.add("--lookahead", 0, "with --overlap, in ASYNC jobs: the pull sent with step t's push is for step "
           "t + LOOKAHEAD (2: the exchange runs during the next step's compute; values lack this "
           "worker's previous step). 0: 2 for models with embedding tables (their rows are most "
           "of the exchange), 1 for dense-only models (their every parameter would be a step staler). "
           "SYNC and SSP jobs use 1")
    fs.add("--shared-memory", True, "same-host bulk bytes through /dev/shm (false: every byte over gRPC)")
    fs.add("--cache-bytes", 0, "keep each embedding table's hot rows on the worker, up to this many bytes per "
           "table, and read them without a pull while they are at most --cache-staleness steps old "
           "(0: no cache; ASYNC jobs only: SYNC and SSP jobs read every row from the servers)")
    fs.add("--cache-staleness", 0, "the most steps a cached row is read after it was pulled (0: the steps "
           f"{CACHE_STALENESS_SAMPLES:,} samples take at the batch size, at least the lookahead: 8 at 512, 2 at "
           "4,096 with --overlap. A bound in steps skips more of the worker's own updates to a row the larger "
           "its batch; with --overlap it must be at least the lookahead, the age of the youngest cached row "
           "when a lookup is planned)")
    fs.add("--wait-workers", 0, "before the first step, wait until the job has had this many workers at once "
           "(those that finished and left count; 0: start at once). Give SYNC jobs their worker count: every "
           "worker then starts at step 0 with the same share of the data and, with --scale-lr, the same "
           f"learning rate. Fails after {WAIT_WORKERS_SECONDS:.0f} s")
    fs.add("--checkpoint-every", 0, "join a checkpoint every this many steps (0: only on demand)")
    fs.add("--dense", "servers", "the dense parameters: servers (tables, the servers' optimizer) or allreduce "
           "(on the workers, averaged by DistributedDataParallel; start the workers with torchrun's environment)",
           choices=["servers", "allreduce"])
    fs.add("--block-size", 0, "elements per block of the model's dense tables (0: the default, 65,536): smaller "
           "blocks spread a small model's dense parameters over more servers")
    fs.add("--ready-file", "", "write a JSON line (name, rank, metrics address, pid) here once joined")


def _default_lookahead(model) -> int:
    """``--lookahead 0``: 2 where the model has embedding tables (rows pulled per step make
    most of an exchange, and a step-staler row costs little), else 1."""
    from shardps.worker.embeddings import PSRows
    return 2 if any(isinstance(m, PSRows) for m in model.modules()) else 1


@dataclass
class TrainResult:
    rank: int
    steps: int
    samples: int
    wall_seconds: float
    metrics: dict
    losses: list = field(default_factory=list)
    curve: list = field(default_factory=list)          # [(step, {metric: value})] per epoch
    max_staleness: int = 0
    timings: dict = field(default_factory=dict)
    unique_rows: int = 0            # sum over steps of the distinct embedding ids in the batch
    sparse_bytes_pushed: int = 0    # client counter: ids + rows of sparse pushes
    device: str = ""                # where the model trained ("cpu", "cuda:0")
    bytes_pulled: int = 0           # client counters: everything pulled, and its sparse ids + rows
    sparse_bytes_pulled: int = 0
    cache: dict = field(default_factory=dict)   # per table: RowCache.summary() (--cache-bytes)

    def line(self, who: str) -> str:
        parts = [f"shardps {who}", f"rank={self.rank}", f"steps={self.steps}"]
        parts += [f"{k}={v:.4f}" for k, v in self.metrics.items()]
        parts += [f"samples_per_second={self.samples / max(self.wall_seconds, 1e-9):.0f}",
                  f"wall_seconds={self.wall_seconds:.1f}", f"device={self.device}"]
        return " ".join(parts)


def _lr_scaled(task, args, world: int):
    import dataclasses
    factor = world if args.scale_lr else 1.0

    def with_lr(cfg):
        lr = args.lr if args.lr else cfg.lr
        return dataclasses.replace(cfg, lr=lr * factor)
    return with_lr(task.optimizer), {k: with_lr(v) for k, v in task.optimizers.items()}


def build_task(args):
    from shardps.worker.models import build
    opts = {"data_dir": args.data_dir}
    if args.model == "ctr":
        opts["rows"] = args.ctr_rows
        if args.train_samples:
            opts["train_samples"] = args.train_samples
    return build(args.model, seed=args.seed, **opts)


def train_with_ps(task, ps_model, client, args, metrics=None, show_progress=False,
                  resume: tuple[int, int] | None = None) -> TrainResult:
    """The training loop of one worker. Reads the group's membership at each epoch start."""
    import torch

    from shardps.tables import Consistency
    from shardps.worker.data import batches, position, shard_indices, take_batch
    from shardps.worker.device import module_device, synchronize
    from shardps.worker.torch_ps import PSEmbedding

    device = module_device(task.model)        # the batches go where the model is
    x, y = task.train
    n = x.shape[0]
    epochs = args.epochs or task.epochs
    bs = args.batch_size or task.batch_size
    group = client.group()
    mode = group.consistency if group else Consistency.ASYNC
    embeddings = [m for m in task.model.modules() if isinstance(m, PSEmbedding)]
    started = time.perf_counter()
    losses = []
    samples = 0
    max_stale = 0
    compute = 0.0
    bar = None
    job = client.job
    if show_progress:
        from tqdm import tqdm
        world = max(1, len(group.members)) if group else 1    # the total: an estimate if workers come and go
        bar = tqdm(total=args.steps or epochs * -(-n // (world * bs)), desc=f"{task.name} rank "
                   f"{client.membership.rank}", unit="step", file=sys.stderr)
    done = False
    unique_rows = 0
    result_curve: list = []
    last_log = time.monotonic()
    start_epoch, start_batch = resume or (0, 0)
    factor = 1.0
    for epoch in range(start_epoch, epochs):
        if task.lr_schedule is not None:
            wanted = task.lr_schedule(epoch, epochs)
            if wanted != factor:           # every worker its own optimizer; one the shared tables' configs
                factor = wanted
                ps_model.set_lr(lambda base, factor=factor: base * factor, tables=client.membership.rank == 0)
                log.info("epoch %d: learning rate factor %g", epoch, factor)
        view = client.refresh_map()
        g = view.groups.get(job)
        ranks = [m.rank for m in g.members] if g else [client.membership.rank]
        index, count = position(client.membership.rank, ranks)
        idx = shard_indices(n, epoch, args.seed, index, count)
        if mode is Consistency.SYNC or ps_model.dense_mode == "allreduce":   # equal steps on every worker
            per_worker = n // count // bs
            idx = idx[:per_worker * bs]
        batch_list = list(batches(idx, bs))
        announced: dict[int, torch.Tensor] = {}    # batch position -> its ids on the device, announced
        for i, b in enumerate(batch_list):
            if epoch == start_epoch and i < start_batch:
                continue                   # resuming: these batches were trained before
            if args.steps and ps_model.step >= args.steps:
                done = True
                break
            tb = time.perf_counter()
            path = ps_model.maybe_checkpoint(getattr(args, "checkpoint_every", 0), epoch, i)
            if path is not None:
                log.info("checkpoint at step %d: %s", ps_model.step, path)
                if metrics is not None:
                    metrics.step_seconds.labels(job, "barrier_wait").observe(time.perf_counter() - tb)
            pull0 = ps_model.timings["pull_wait"]
            barrier0 = ps_model.timings["barrier_wait"]
            stepped0 = ps_model.timings["local_optimizer"]
            ps_model.pull()
            max_stale = max(max_stale, client.last_staleness)
            t1 = time.perf_counter()
            xb = announced.pop(i, None)
            if xb is None:
                xb = take_batch(x, b).to(device)
            yb = take_batch(y, b).to(device)
            loss = task.loss(ps_model(xb), yb)
            unique_rows += sum(emb.stage.last_unique for emb in embeddings)
            ahead = ps_model.lookahead if ps_model.overlap else 1
            if embeddings and args.prefetch and i + ahead < len(batch_list):
                # on the device already: the lookup then recognises the tensor it was
                # announced as, without reading its ids back from the GPU. Announced before
                # the backward pass, from which a hybrid step's push leaves with their pull
                nxt = announced[i + ahead] = take_batch(x, batch_list[i + ahead]).to(device)
                for emb in embeddings:
                    if ps_model.overlap:
                        emb.request_prefetch(nxt)      # fetched with the next dense values
                    else:
                        emb.prefetch(nxt)
            loss.backward()
            synchronize(device)      # compute is the GPU's work (push copies the gradients anyway)
            t2 = time.perf_counter()
            compute += t2 - t1
            ps_model.push()
            t3 = time.perf_counter()
            if args.step_delay:
                time.sleep(args.step_delay)
            lv = float(loss.detach())
            losses.append(lv)
            samples += len(b)
            client.progress.update(step=ps_model.step, loss=lv,
                                   samples_per_second=samples / max(1e-9, time.perf_counter() - started))
            if metrics is not None:
                stepped = ps_model.timings["local_optimizer"] - stepped0
                metrics.step(job, len(b), lv, client.progress["samples_per_second"],
                             (ps_model.timings["pull_wait"] - pull0, ps_model.timings["barrier_wait"] - barrier0,
                              t2 - t1, stepped, t3 - t2 - stepped), client.last_staleness)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{lv:.4f}")
            elif time.monotonic() - last_log > 5:
                last_log = time.monotonic()
                log.info("epoch=%d step=%d loss=%.4f samples_per_second=%.0f", epoch, ps_model.step,
                         lv, client.progress["samples_per_second"])
        if getattr(args, "plot", "") and not done:
            ps_model.settle()
            result_curve.append((ps_model.step, task.evaluate(task.model, *task.test)))
        if done:
            break
    ps_model.flush()
    wall = time.perf_counter() - started
    if bar is not None:
        bar.close()
    ps_model.settle()
    moved = client.metrics.totals()
    result = TrainResult(client.membership.rank, ps_model.step, samples, wall,
                         task.evaluate(task.model, *task.test), losses, result_curve, max_stale,
                         dict(ps_model.timings, compute=compute, copies=ps_model.copies.seconds), unique_rows,
                         int(moved["sparse_bytes_pushed"]), str(device), int(moved["bytes_pulled"]),
                         int(moved["sparse_bytes_pulled"]),
                         {emb.table: emb.cache.summary() for emb in embeddings if emb.cache is not None})
    return result


def train_single_process(args, task=None) -> TrainResult:
    """The baseline: the same model, data, batch size and optimizer in one process with
    torch.optim (the embedding as ``nn.Embedding(sparse=True)``), on ``args.device`` (the
    table too). InvalidArgument / FailedPrecondition for a device this process cannot use."""
    import torch
    from torch import nn

    from shardps.worker.data import batches, shard_indices, take_batch
    from shardps.worker.device import cuda_device_count, no_cuda_reason, resolve_device, use_device
    from shardps.worker.torch_ps import PSEmbedding
    torch.set_num_threads(args.torch_threads)
    device = resolve_device(getattr(args, "device", "cpu"), cuda_device_count(), no_cuda=no_cuda_reason())
    use_device(device)
    task = task or build_task(args)
    model = task.model
    for name, mod in list(model.named_modules()):
        if isinstance(mod, PSEmbedding):
            emb = nn.Embedding(mod.num_embeddings, mod.embedding_dim, sparse=True)
            nn.init.normal_(emb.weight, mod.init.mean, mod.init.std)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], emb)
    model.to(device)
    opt, per_table = _lr_scaled(task, args, 1)
    optimizers = []
    for name, p in model.named_parameters():
        cfg = per_table.get(name.rsplit(".", 1)[0], per_table.get(name, opt))
        optimizers.append(torch_optimizer(cfg, [p], sparse=p.dim() == 2 and name.endswith("embedding.weight")))
    x, y = task.train
    epochs = args.epochs or task.epochs
    bs = args.batch_size or task.batch_size
    started = time.perf_counter()
    steps = samples = 0
    losses = []
    base_lrs = [[g["lr"] for g in o.param_groups] for o in optimizers]
    for epoch in range(epochs):
        factor = task.lr_schedule(epoch, epochs) if task.lr_schedule is not None else 1.0
        for o, lrs in zip(optimizers, base_lrs):
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr * factor
        for b in batches(shard_indices(x.shape[0], epoch, args.seed, 0, 1), bs):
            if args.steps and steps >= args.steps:
                break
            loss = task.loss(model(take_batch(x, b).to(device)), take_batch(y, b).to(device))
            for o in optimizers:
                o.zero_grad()
            loss.backward()
            for o in optimizers:
                o.step()
            steps += 1
            samples += len(b)
            losses.append(float(loss.detach()))
    wall = time.perf_counter() - started
    return TrainResult(0, steps, samples, wall, task.evaluate(model, *task.test), losses, device=str(device))


def torch_optimizer(cfg, params, sparse: bool = False):
    """torch.optim equivalent of a server-side OptimizerConfig."""
    import torch

    from shardps.tables import OptimizerKind
    if cfg.kind is OptimizerKind.SGD:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    if cfg.kind is OptimizerKind.ADAGRAD:
        return torch.optim.Adagrad(params, lr=cfg.lr, lr_decay=cfg.lr_decay, weight_decay=cfg.weight_decay,
                                   initial_accumulator_value=cfg.initial_accumulator_value,
                                   eps=cfg.effective_eps)
    if sparse:
        return torch.optim.SparseAdam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.effective_eps)
    return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.effective_eps,
                            weight_decay=cfg.weight_decay)


def run_worker(args) -> int:
    """``shardps worker``: join, train, evaluate, print the final line."""
    import torch

    from shardps import logs
    from shardps.errors import PermissionDenied, ShardpsError
    from shardps.metrics import WorkerMetrics
    from shardps.rpc.channels import TlsConfig
    from shardps.settings import Common, build
    from shardps.worker import hybrid
    from shardps.worker.client import PSClient
    from shardps.worker.client.client import default_worker_name
    from shardps.worker.device import cuda_device_count, describe, no_cuda_reason, resolve_device, use_device
    from shardps.worker.torch_ps import PSModel

    common = build(Common, args)
    name = args.name or default_worker_name()           # host-rankN under torchrun / shardps run
    ctx = logs.setup("worker", name, common.log_format, common.log_level)
    ctx.set(job=args.job)
    torch.set_num_threads(args.torch_threads)
    gpus, no_cuda = cuda_device_count(), no_cuda_reason()
    try:                # a device this process cannot use fails now, before the cluster is touched
        resolve_device(args.device, gpus, os.environ, no_cuda=no_cuda)
    except ShardpsError as exc:
        log.error("worker failed: %s", exc.message)
        return 1
    metrics = WorkerMetrics()
    metrics_server = None
    if args.metrics_port >= 0:
        from prometheus_client import start_http_server
        metrics_server, _ = start_http_server(args.metrics_port, addr=args.metrics_host,
                                              registry=metrics.registry)
    tls = TlsConfig.from_files(common.tls_cert, common.tls_key, common.tls_ca)
    client = PSClient(args.manager, args.job, token=common.resolved_token(), tls=tls,
                      wire_dtype=args.wire_dtype, metrics=metrics, timeout=60.0,
                      shared_memory=args.shared_memory)
    try:
        _wait_for_manager(client)
        try:
            client.create_job(args.mode, args.staleness)
        except PermissionDenied:
            pass                          # the admin created it; workers only join
        membership = client.join(name=name, rank_hint=args.rank_hint)
        ctx.set(rank=membership.rank, epoch=client.shard_map.epoch)
        metrics.info.labels(args.job, name, str(membership.rank)).set(1)
        device = resolve_device(args.device, gpus, os.environ, rank=membership.rank, no_cuda=no_cuda)
        use_device(device)
        if args.ready_file:
            address = ""
            if metrics_server is not None:
                host = args.metrics_host if args.metrics_host not in ("0.0.0.0", "::") else "127.0.0.1"
                address = f"{host}:{metrics_server.server_address[1]}"
            with open(args.ready_file + ".tmp", "w") as f:
                json.dump({"role": "worker", "name": name, "rank": membership.rank, "metrics": address,
                           "pid": os.getpid(), "device": str(device)}, f)
            os.replace(args.ready_file + ".tmp", args.ready_file)
        log.info("joined job %s as rank %d of %d (device %s)", args.job, membership.rank,
                 membership.world_size, describe(device))
        if device.type == "cpu" and args.device.strip().lower() == "auto" and torch.version.cuda:
            log.warning("--device auto: %s; training on the CPU", no_cuda)
        task = build_task(args)
        task.model.to(device)      # before PSModel: its tables start from these values
        prepare_kernels(log)       # before the first step, not inside it
        world = max(1, membership.world_size, _wait_for_workers(client, args.wait_workers))
        opt, per_table = _lr_scaled(task, args, world)
        lookahead = args.lookahead or _default_lookahead(task.model)
        ps_model = PSModel(task.model, client, optimizer=opt, optimizers=per_table, overlap=args.overlap,
                           **hybrid.worker_kwargs(args.dense, task.model, opt, per_table),
                           lookahead=lookahead, cache_bytes=args.cache_bytes, block_size=args.block_size,
                           cache_staleness=args.cache_staleness or cache_staleness_for(
                               args.batch_size or task.batch_size, lookahead if args.overlap else 1))
        ps_model.create_tables()
        resume = ps_model.resume()
        if resume is not None:
            log.info("resuming at step %d from the job's checkpoint (epoch %d, batch %d)%s", ps_model.step, *resume,
                     "" if membership.restored else ": the latest, the tables as the servers hold them")
        elif ps_model.report_steps:
            ps_model.step = client.server_clock()
        show = membership.rank == 0 and sys.stderr.isatty()
        result = train_with_ps(task, ps_model, client, args, metrics, show_progress=show, resume=resume)
        print(result.line("worker"), flush=True)
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result.__dict__, f)
        if args.plot:
            from shardps.worker.curve import plot_curve
            plot_curve(result, args.plot, task.name)
        client.leave()
        return 0
    except ShardpsError as exc:
        log.error("worker failed: %s", exc.message)
        return 1
    finally:
        client.close()
        if metrics_server is not None:
            metrics_server.shutdown()


def prepare_kernels(log) -> tuple[float, int, int]:
    """A worker's compiled kernels loaded (or compiled), and logged: deduplication and
    routing (``shardps.kernels``, ``shardps.id_blocks``), a call's checks (``client.request_kernels``), the Step
    request's rows and reply's walk (``shardps.rpc.step``, ``step_reply``), the lookups'
    deduplication and backward (``lookup_kernels``), a call's rows routed and gathered
    (``client.step_plan``).
    ``kernels.prepare``'s (seconds, loaded, compiled)."""
    from shardps import id_blocks, kernels
    from shardps.rpc import step, step_reply
    from shardps.worker import lookup_kernels
    from shardps.worker.client import request_kernels, step_plan
    return kernels.prepare(log, id_blocks, step, step_reply, lookup_kernels, request_kernels, step_plan)


def _wait_for_workers(client, wanted: int) -> int:
    """``--wait-workers``: how many workers the job has once it has had ``wanted`` (0: at
    once; ``PSClient.wait_for_workers``)."""
    from shardps.errors import DeadlineExceeded
    if wanted <= 0:
        return 0
    log.info("waiting for %d workers of job %s to join (--wait-workers)", wanted, client.job)
    try:
        return client.wait_for_workers(wanted, timeout=WAIT_WORKERS_SECONDS)
    except DeadlineExceeded as exc:
        raise DeadlineExceeded(f"--wait-workers {wanted}: {exc.message}") from None


def _wait_for_manager(client, timeout: float = 120.0) -> None:
    from shardps.errors import DeadlineExceeded, Unavailable
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.refresh_map(timeout=5.0)
            return
        except (Unavailable, DeadlineExceeded):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
