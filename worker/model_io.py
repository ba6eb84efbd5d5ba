"""What ``PSModel`` reads and writes as a whole: its state dict (export and warm start),
learning-rate schedules, and checkpoints of a custom training loop (``maybe_checkpoint`` to
cut one, ``resume`` to go on from one after ``shardps restore``).

The worker's own state in a checkpoint (``worker_state_bytes`` / ``load_worker_state``) is
what lives on the worker only: local parameters and buffers, the step, the data position and
the random generators, in the format of ``shardps.worker.local_state`` (safetensors + JSON:
reading it cannot run code).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple

import numpy as np
import torch

from shardps.errors import InvalidArgument, NotFound
from shardps.tables import OptimizerConfig, assigned, dense_table, sparse_table
from shardps.worker import dense_buckets, hybrid, local_state
from shardps.worker.device import module_device
from shardps.worker.embeddings import bind_caches

log = logging.getLogger("shardps.worker")

if TYPE_CHECKING:
    from torch import nn

    from shardps.worker.client import PSClient
    from shardps.worker.dense_buckets import DenseBucket
    from shardps.worker.embeddings import PSRows


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` did not match (as torch's ``load_state_dict`` returns)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def worker_state_bytes(model, ps_model, epoch: int, batch: int) -> bytes:
    """What lives on the worker (local parameters and buffers, the state of the optimizer
    that steps them, the step, the data position (epoch, batch), the random generators),
    encoded for a checkpoint."""
    local = {k: v for k, v in model.state_dict().items() if k not in ps_model.dense}
    state = {"step": ps_model.step, "epoch": epoch, "batch": batch, "local": local,
             "torch_rng": torch.get_rng_state()}
    optimizer = getattr(ps_model, "local_optimizer", None)
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    device = module_device(model)
    if device.type == "cuda":            # dropout on the GPU draws from the GPU's generator
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return local_state.encode(state)


def load_worker_state(raw: bytes, model, ps_model, generators: bool = True) -> tuple[int, int]:
    """Restore what ``worker_state_bytes`` saved (``generators``: the random generators too);
    returns the data position (epoch, batch). InvalidArgument for anything else (a pickle
    above all: it is never loaded)."""
    state = local_state.decode(raw)
    local, rng, cuda_rng = state.get("local"), state.get("torch_rng"), state.get("cuda_rng")
    fields = (state.get("step"), state.get("epoch"), state.get("batch"))
    if not (isinstance(local, dict) and all(isinstance(v, torch.Tensor) for v in local.values())
            and isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8
            and (cuda_rng is None or isinstance(cuda_rng, torch.Tensor) and cuda_rng.dtype == torch.uint8)
            and all(isinstance(f, int) and not isinstance(f, bool) for f in fields)):
        raise InvalidArgument("worker state: expected int step, epoch and batch, a dict of "
                              "tensors 'local' and uint8 tensors 'torch_rng' (and 'cuda_rng')")
    model.load_state_dict(local, strict=False)       # copied onto the model's device
    saved, optimizer = state.get("optimizer"), getattr(ps_model, "local_optimizer", None)
    if saved is not None and optimizer is not None:
        if not isinstance(saved, dict):
            raise InvalidArgument("worker state: 'optimizer' is not an optimizer's state dict")
        optimizer.load_state_dict(saved)                # onto its parameters' device
    ps_model.step = state["step"]
    if not generators:
        return state["epoch"], state["batch"]
    torch.set_rng_state(rng)
    device = module_device(model)
    if cuda_rng is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, device)
    return state["epoch"], state["batch"]


class ModelIO:
    """``PSModel``'s whole-model calls (a mixin; see the module docstring)."""

    module: "nn.Module"
    client: "PSClient"
    embeddings: "dict[str, PSRows]"
    dense: dict[str, torch.nn.Parameter]
    buckets: "list[DenseBucket]"
    step: int
    _base_lr: dict[str, float]
    _handled_checkpoint: tuple[str, int]
    local_optimizer: torch.optim.Optimizer | None
    _ddp: "nn.Module | None"

    _prefetch: collections.deque

    optimizer: OptimizerConfig
    optimizers: dict[str, OptimizerConfig]
    block_size: int
    cache_bytes: int
    cache_staleness: int
    overlap: bool

    if TYPE_CHECKING:                     # PSModel's
        def flush(self) -> None: ...
        def settle(self) -> None: ...
        def pull(self, features=None) -> None: ...
        @property
        def lookahead(self) -> int: ...

    def table_optimizer(self, table: str) -> OptimizerConfig:
        return self.optimizers.get(table, self.optimizer)


    def create_tables(self, timeout: float | None = None) -> None:
        """Create every table (idempotent) and offer this module's initial values; then pull
        the values that won, so every worker starts identical. A job trained with a table
        per dense parameter (and no bucket) goes on with that layout, from those tables."""
        if self.buckets:
            existing = {t.name: t for t in self.client.tables()}
            layout = dense_buckets.for_job(self.buckets, self.dense, existing)
            if layout is not self.buckets:
                log.info("job %s has a table per dense parameter: this model trains on them (as with "
                         "dense_table=None), not on a flat bucket", self.client.job)
                self.buckets = layout
        tables = [(dense_table(b.table, b.shape, assigned(), self.block_size), self.table_optimizer(b.names[0]))
                  for b in self.buckets]
        for emb in self.embeddings.values():
            assert emb.table is not None          # PSModel named every embedding's table
            tables.append((sparse_table(emb.table, emb.embedding_dim, emb.num_embeddings, emb.init, emb.num_blocks),
                           emb.optimizer or self.table_optimizer(emb.table)))
        self.client.create_tables(tables, timeout=timeout)      # one map change for the lot
        for b in self.buckets:
            self.client.initialize_dense(b.table, b.values().numpy(), timeout=timeout)
            self._base_lr[b.table] = self.table_optimizer(b.names[0]).lr
        for emb in self.embeddings.values():
            assert emb.table is not None
            self._base_lr[emb.table] = (emb.optimizer or self.table_optimizer(emb.table)).lr
        bind_caches(self.embeddings.values(), self.client, self.cache_bytes, self.cache_staleness,
                    self.lookahead if self.overlap else 1)
        self.pull()

    def forget_pulled(self) -> None:
        """Drop every value pulled ahead (the exchanges in flight, the embeddings' fetched
        and cached rows): the next pull reads the servers afresh."""
        self._prefetch.clear()
        for emb in self.embeddings.values():
            emb.stage.fetched = None
            if emb.cache is not None:
                emb.cache.clear()

    # ------------------------------------------------------------------ export, warm start
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ordinary state dict holding the servers' current values. A dense
        parameter's tensor is its own copy, not a view of its bucket (``torch.save`` of one
        saves that parameter alone)."""
        self.settle()
        state = self.module.state_dict()
        for key in self.dense.keys() & state.keys():
            state[key] = state[key].clone()
        for name, emb in self.embeddings.items():
            state[_weight_key(name)] = torch.from_numpy(_full_embedding(self.client, emb))
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Warm-start from a state dict (``state_dict``'s, or a plain module's of the same
        architecture with ``nn.Embedding`` in place of ``PSEmbedding``): the servers' tables
        take its values (dense parameters, and every row of each embedding), their optimizer
        state starting afresh; local parameters and buffers load into the module. Call it
        after ``create_tables``, from one worker (the others read the values with their next
        pull). ``strict``: a missing or unexpected key is an InvalidArgument naming them, and
        nothing is written. Returns the keys that did not match."""
        if not isinstance(state, Mapping):
            raise InvalidArgument(f"load_state_dict takes a state dict, got {type(state).__name__}")
        tables: dict[str, np.ndarray] = {}
        local: dict[str, torch.Tensor] = {}
        weights = {_weight_key(name): emb for name, emb in self.embeddings.items()}
        expected = set(self.module.state_dict()) | set(weights)
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if strict and (missing or unexpected):
            raise InvalidArgument(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                                  f"(strict=False loads the keys that match)")
        for key, value in state.items():
            if key in unexpected:
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument(f"load_state_dict: {key!r} is a {type(value).__name__}, not a tensor")
            if key in weights:
                emb = weights[key]
                if not value.is_floating_point() or tuple(value.shape) != (emb.num_embeddings, emb.embedding_dim):
                    raise InvalidArgument(f"load_state_dict: {key!r} has shape {tuple(value.shape)} "
                                          f"({value.dtype}); the table holds "
                                          f"({emb.num_embeddings}, {emb.embedding_dim}) float rows")
                tables[f"{emb.table}.ids"] = np.arange(emb.num_embeddings, dtype=np.int64)
                tables[f"{emb.table}.rows"] = _float32(value)
            else:
                if key in self.dense and not value.is_floating_point():
                    raise InvalidArgument(f"load_state_dict: {key!r} is {value.dtype}, not floating point")
                local[key] = value       # dense parameters too: the module holds their copy
        try:                             # the module first: a shape it refuses writes no table
            self.module.load_state_dict(local, strict=False)
        except RuntimeError as exc:
            raise InvalidArgument(f"load_state_dict: {exc}") from None
        self.flush()
        tables.update(self._bucket_values(set(local)))
        self.client.load_state_dict(tables)
        self.forget_pulled()
        return IncompatibleKeys(missing, unexpected)

    def _bucket_values(self, given: set[str]) -> dict[str, np.ndarray]:
        """The dense tables to write after the module loaded the parameters ``given``: a
        bucket all of whose parameters were given, as the module holds it; one given in
        part, as the servers hold it with those parameters' pieces replaced."""
        out = {}
        for b in self.buckets:
            names = [n for n in b.names if n in given]
            if not names:
                continue
            values = b.values().numpy()
            if len(names) < len(b.names):
                ours = values
                values = self.client.pull_dense(b.table).reshape(-1).copy()
                for n in names:
                    a, z = b.piece(n)
                    values[a:z] = ours[a:z]
            out[b.table] = values
        return out

    def set_lr(self, lr_of: Callable[[float], float], tables: bool = True) -> None:
        """Set every learning rate to ``lr_of(base_lr)``: the worker's own optimizer's (the
        parameters kept local, or all-reduced: each worker sets its own) and, with
        ``tables``, every table's, in one change of the shard map (one worker of the job does
        that for all: call it per epoch or every few hundred steps, not per step)."""
        optimizer = self.local_optimizer
        if optimizer is not None:
            # the bases: the optimizer's learning rates when the first schedule came
            bases = self.__dict__.setdefault("_local_base_lr", [g["lr"] for g in optimizer.param_groups])
            for group, base in zip(optimizer.param_groups, bases):
                group["lr"] = float(lr_of(base))
        if tables and self._base_lr:
            self.client.update_configs({table: {"lr": float(lr_of(base))} for table, base in self._base_lr.items()})

    def train(self, mode: bool = True):
        """``nn.Module.train`` (and ``eval``), reaching the DistributedDataParallel wrapper too."""
        if self._ddp is not None:
            self._ddp.train(mode)
        return super().train(mode)            # type: ignore[misc]  # nn.Module's, after this mixin

    def _apply(self, fn, recurse=True):
        """``to(device)`` and the like, as any module; a change of the parameters' dtype
        (``.to(torch.float64)``, ``.double()``, ``.half()``) is refused at once, naming the
        dtype: the tables hold float32, and the next step would fail inside torch. Mixed
        precision goes through ``torch.autocast``, which leaves the parameters float32."""
        probe = fn(torch.empty(0, dtype=torch.float32))
        if probe.dtype != torch.float32:
            raise InvalidArgument(f"PSModel's parameters are float32 (its tables on the servers hold float32): "
                                  f"it cannot become {probe.dtype}; for mixed precision use torch.autocast")
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ checkpoints
    def maybe_checkpoint(self, every: int = 0, epoch: int = 0, batch: int = 0,
                         timeout: float | None = 300.0) -> str | None:
        """The one call a custom training loop makes for checkpoints: once per step, after
        ``push``. When ``shardps checkpoint`` asked for one (the heartbeat brings the request:
        no call is made to find out), or with ``every`` at each multiple of ``every`` steps,
        it sends the push it holds, meets the group's other workers at the barrier with this
        worker's own state (local parameters and buffers, the step, ``epoch`` and ``batch`` of
        your data, the random generators) and returns the checkpoint's path; otherwise it
        returns None at once. Needs ``client.join()``: without a group there is nobody to
        ask, and ``shardps checkpoint`` cuts the tables directly. ``resume`` reads the state
        back after ``shardps restore``."""
        if self.client.membership is None:
            return None
        request = self.client.checkpoint_request
        asked = bool(request) and request != self._handled_checkpoint[0]
        periodic = every > 0 and self.step > 0 and self.step % every == 0 and self.step != self._handled_checkpoint[1]
        if not (asked or periodic):
            return None
        path = self.client.checkpoint_barrier(self.step, worker_state_bytes(self.module, self, epoch, batch),
                                              request if asked else "", timeout)
        self._handled_checkpoint = (request if asked else self._handled_checkpoint[0], self.step)
        return path

    def resume(self) -> tuple[int, int] | None:
        """Where this rank goes on from; call it after ``join`` and ``create_tables``.

        After ``shardps restore``: this rank's own state from the checkpoint (local
        parameters, buffers, the optimizer's state, the step, the random generators); returns
        the ``(epoch, batch)`` given to ``maybe_checkpoint``, or None when the checkpoint holds
        nothing for this rank.

        A rank started again without a restore (a worker died and ``shardps run`` or torchrun
        started it, or its whole group, again: ``membership.previous_step`` > 0) keeps the
        tables as the servers hold them and goes on from the job's step (``self.step =
        previous_step``); its local state comes from the job's latest checkpoint when there is
        one (``maybe_checkpoint``), whose ``(epoch, batch)`` it returns; else None. A later
        round of torch's elastic agent (``TORCHELASTIC_RESTART_COUNT`` > 0) is such a restart
        too, when the manager no longer knows the step (its ranks left, or their leases ran
        out, before the group came back): it goes on from the latest checkpoint's step. With
        ``dense="allreduce"`` every rank calls it (a collective): a rank the checkpoint has no
        state for (the group grew) takes rank 0's, whose dense part every rank shares, and
        all ranks take the highest step any was given (``hybrid.agreed_step``) before they
        decide, so all load alike and run the same steps. None on a first start."""
        m = self.client.membership
        if m is None:
            return None
        if m.restored:
            try:
                raw, _ = self.client.worker_state()
            except NotFound:
                return None
            return load_worker_state(raw, self.module, self)
        step = max(self.step, m.previous_step)
        if self._ddp is not None:    # one decision for the group: a rank told 0 loads what the others load
            step = hybrid.agreed_step(step, module_device(self.module))
        # a later round of torch's elastic agent is a restart even when the manager tells step 0:
        # the last round's ranks left, and a killed one's lease may have run out, before it came back
        restarted = step > 0 or hybrid.restart_round() > 0
        position = self._latest_state() if restarted else None     # sets self.step: the checkpoint's
        self.step = max(step, self.step)
        return position

    def _latest_state(self) -> tuple[int, int] | None:
        """Load this rank's state from the job's latest checkpoint (a hybrid rank it has none
        for: rank 0's, without its random generators); its (epoch, batch), or None."""
        try:
            raw, _ = self.client.worker_state(latest=True)
            return load_worker_state(raw, self.module, self)
        except NotFound:
            if self._ddp is None or self.client.membership is None or self.client.membership.rank == 0:
                return None
        try:
            raw, _ = self.client.worker_state(latest=True, rank=0)
        except NotFound:
            return None
        return load_worker_state(raw, self.module, self, generators=False)


def _float32(value: torch.Tensor) -> np.ndarray:
    return value.detach().to("cpu", torch.float32).contiguous().numpy()


def _weight_key(name: str) -> str:
    return f"{name}.weight" if name else "weight"


def _full_embedding(client: "PSClient", emb: "PSRows", chunk: int = 1 << 18) -> np.ndarray:
    """Every row of ``emb``'s table, ``[num_embeddings, dim]``."""
    if emb.num_embeddings <= 0:
        raise InvalidArgument(f"{type(emb).__name__} {emb.table!r} has no num_embeddings bound: export "
                              f"it with client.state_dict() (ids + rows) instead")
    assert emb.table is not None              # PSModel named every embedding's table
    out = np.empty((emb.num_embeddings, emb.embedding_dim), np.float32)
    for start in range(0, emb.num_embeddings, chunk):
        ids = np.arange(start, min(start + chunk, emb.num_embeddings), dtype=np.int64)
        out[start:start + ids.shape[0]] = client.pull_rows(emb.table, ids, clock=emb.clock)
    return out
