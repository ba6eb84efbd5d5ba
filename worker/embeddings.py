"""Embedding modules whose rows live on a shardps sparse table.

* ``PSEmbedding``: ``nn.Embedding``'s forward (one row per id).
* ``PSEmbeddingBag``: ``nn.EmbeddingBag``'s forward (bags of ids pooled by sum, mean or max,
  with ``offsets``, ``per_sample_weights``, ``include_last_offset`` and ``padding_idx``).

Both share ``PSRows``: a forward pulls each distinct id of the batch once (or takes the rows
``PSModel.pull`` fetched for it together with every other table), computes ``F.embedding`` /
``F.embedding_bag`` over the pulled rows (their backward summed in one compiled pass:
``lookup_kernels``), and keeps those rows as leaf tensors: their gradients, one row per
distinct id, are what ``PSModel.push`` sends.
A pooled lookup's gradient therefore travels as its touched rows only. When ``PSModel``'s
pull brought several tables' rows for the ids they announced, a ``PSEmbedding`` takes its
rows from their lookup in one call instead (``lookup_batch``). Not usable until a
``PSModel`` binds the module to a client.
"""

from __future__ import annotations

import collections
import itertools
import logging
from concurrent import futures
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.tables import Initializer, OptimizerConfig, normal
from shardps.worker.client import PSClient
from shardps.worker.device_copies import DeviceCopies
from shardps.worker.lookup_kernels import bag_lookup, lookup, unique_each
from shardps.worker.row_cache import CachePlan, RowCache, wanted_ids

log = logging.getLogger("shardps.worker")

_ID_DTYPES = (torch.int32, torch.int64)
MAX_ANNOUNCED = 1 << 14              # batches deduplicated together (lookup_kernels.unique_each numbers them in int16)


class StepClock:
    """The worker's completed steps, which lookups send with their pulls: one object shared
    by a ``PSModel``'s tables, so that a step sets it once, not once per table."""

    __slots__ = ("value",)

    def __init__(self, value: int = 0):
        self.value = value


class BatchSlot:
    """The ``lookup_batch.LookupBatch`` of the coming forward, or None: one object shared by a
    ``PSModel``'s tables (as ``StepClock``), which ``PSEmbedding.forward`` takes its rows from."""

    __slots__ = ("current",)

    def __init__(self):
        self.current = None


class Stage:
    """A table's lookup state that changes every step, in plain slots (an ``nn.Module``'s
    own attributes pass ``nn.Module.__setattr__``'s checks at every write).

    ``wanted``: the distinct ids announced for the next pull (``request_prefetch``);
    ``fetched``: (distinct ids, their rows: an array, or a future of one) fetched for the
    next lookup; ``pending``: (distinct ids, rows collecting gradients) of each lookup since
    the last push; ``last_unique``: the distinct ids of the last lookup."""

    __slots__ = ("wanted", "fetched", "pending", "last_unique")

    def __init__(self):
        self.wanted: np.ndarray | None = None
        self.fetched: tuple[np.ndarray, "np.ndarray | futures.Future | _Completing"] | None = None
        self.pending: list[tuple[np.ndarray, torch.Tensor]] = []
        self.last_unique = 0


class PSRows(nn.Module):
    """The rows of one sparse table as a module uses them (the base of ``PSEmbedding`` and
    ``PSEmbeddingBag``).

    ``num_embeddings`` bounds the ids (0..num_embeddings-1; it sizes the exported weight);
    rows start at N(0, 1) like ``nn.Embedding`` (``init`` to change). ``table`` names the
    server table (``PSModel`` defaults it to the module's path); ``optimizer`` overrides the
    model's for this table.

    Batching: ``request_prefetch(ids)`` announces the ids of the next lookup; the owning
    ``PSModel`` fetches their rows in its next pull, in the same requests as every other
    table (``PSModel.pull``), and the lookup then uses them without a call of its own. A
    lookup of ids that were not announced pulls them itself.

    ``cache_bytes``: keep hot rows on the worker, up to this many bytes (``RowCache``), and
    read a cached row without a pull while it is at most the staleness bound old (None: the
    owning ``PSModel``'s ``cache_bytes``; 0: no cache).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, table: str | None = None,
                 optimizer: OptimizerConfig | None = None, init: Initializer | None = None,
                 num_blocks: int = 0, cache_bytes: int | None = None):
        super().__init__()
        self.cache_bytes = cache_bytes
        self.cache: RowCache | None = None     # set by PSModel with the bound (cache_tau)
        self.cache_tau = 0
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.table = table
        self.optimizer = optimizer
        self.init = init or normal(0.0, 1.0, seed=0)
        self.num_blocks = num_blocks
        self.client: PSClient | None = None
        self.copies = DeviceCopies()           # PSModel shares its own: one copy stream, one pool
        self.stage = Stage()                   # what the coming lookups use, written every step
        # announced batches, oldest first (a PSModel with lookahead L announces the batch L
        # steps ahead)
        self._planned: collections.deque[_Planned] = collections.deque(maxlen=8)
        self._clock = StepClock()              # PSModel gives its tables one, set once a step
        self._batch = BatchSlot()              # PSModel's too: the forward's batched lookups
        # PSModel's LookupPlanner.observe: sees each lookup's ids
        self._observer: Callable[[PSRows, torch.Tensor], None] | None = None
        # PSModel's hybrid.BackwardPush.watch: sees each lookup's rows that collect gradients
        self._on_rows: Callable[[torch.Tensor], None] | None = None

    @property
    def last_unique(self) -> int:
        """The distinct ids of the last lookup."""
        return self.stage.last_unique

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}"

    @property
    def clock(self) -> int:
        """The worker's completed steps, sent with this table's pulls."""
        return self._clock.value

    @clock.setter
    def clock(self, value: int) -> None:
        self._clock.value = value

    def _plan(self, ids: torch.Tensor) -> np.ndarray:
        """Deduplicate a coming batch once (its lookup reuses it); returns its distinct ids.
        The batch is copied, so a caller may reuse its buffer."""
        flat = ids.detach().reshape(-1).to("cpu", copy=True).numpy().astype(np.int64, copy=False)
        return self._planned_as(ids, flat, *kernels.unique_inverse(flat))

    def _planned_as(self, ids: torch.Tensor, flat: np.ndarray, unique: np.ndarray, inverse: np.ndarray) -> np.ndarray:
        """Keep a coming batch's plan (``ids`` copied to ``flat``, deduplicated); its distinct ids."""
        self._planned.append(_Planned(flat, unique, inverse, *_device_view(ids)))
        return unique

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start pulling the rows of ``ids`` (a coming batch) in the background, in a call of
        this table's own (``request_prefetch`` shares the model's pull instead)."""
        unique = self._plan(ids)
        assert self.client is not None and self.table is not None     # bound by PSModel
        plan = self.cache_plan(unique, self.clock + 1)         # the coming batch: the next step's
        future = self.client.pull_rows_async(self.table, wanted_ids(unique, plan), clock=self.clock)
        self.stage.fetched = (unique, future if plan is None else _Completing(self, plan, future, self.clock))

    def cache_plan(self, ids: np.ndarray, use_step: int) -> CachePlan | None:
        """Which of the distinct ``ids`` of a lookup at step ``use_step`` the cache serves:
        pull ``plan.misses``, then ``complete`` the rows. None (pull every id) without a
        cache, and outside training (evaluation reads the servers' latest values)."""
        if self.cache is None or not (self.training and torch.is_grad_enabled()):
            return None
        return self.cache.plan(ids, use_step, self.cache_tau)

    def complete(self, plan: CachePlan | None, pulled: np.ndarray, refreshed: int) -> np.ndarray:
        """The rows of a lookup: ``pulled`` alone without a cache plan, else the plan's cached
        rows with ``pulled`` (its misses, read at step ``refreshed``, which refresh the cache)."""
        return pulled if plan is None or self.cache is None else self.cache.complete(plan, pulled, refreshed)

    def request_prefetch(self, ids: torch.Tensor) -> None:
        """Announce the ids of the next lookup: the owning PSModel fetches their rows in its
        next pull (or, with ``overlap``, in the exchange its next push sends), in the same
        requests as the dense values and every other table."""
        self.stage.wanted = self._plan(ids)

    def _has_rows_for(self, ids: np.ndarray) -> bool:
        """Whether rows fetched for exactly these distinct ids are waiting for the lookup."""
        return self.stage.fetched is not None and same_ids(self.stage.fetched[0], ids)

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the distinct ids ``[U, dim]``, index of each id of ``ids`` in them, with
        ``ids``' shape). The rows collect gradients while training."""
        if self.client is None or ids.dtype not in _ID_DTYPES:
            raise self._refusal(ids)
        if self._observer is not None:
            self._observer(self, ids)
        planned = self._take_plan(ids)
        on_cpu = ids.device.type == "cpu"           # torch.from_numpy: no copy (DeviceCopies.to_device)
        if planned is not None:
            unique_np, at = planned.unique, planned.inverse
            inverse = torch.from_numpy(at) if on_cpu else self.copies.to_device(at, ids.device)
        else:                      # the batch was not announced: deduplicate it now
            unique, inverse = torch.unique(ids.reshape(-1).long(), return_inverse=True)
            unique_np = unique.detach().cpu().numpy()
        stage = self.stage
        stage.last_unique = unique_np.shape[0]
        fetched, stage.fetched = stage.fetched, None
        if fetched is not None and same_ids(fetched[0], unique_np):
            rows_np = fetched[1] if isinstance(fetched[1], np.ndarray) else fetched[1].result()
        else:
            assert self.table is not None             # PSModel binds the table with the client
            plan = self.cache_plan(unique_np, self.clock)
            rows_np = self.complete(plan, self.client.pull_rows(self.table, wanted_ids(unique_np, plan),
                                                                clock=self.clock), self.clock)
        rows = torch.from_numpy(rows_np) if on_cpu else self.copies.to_device(rows_np, ids.device)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            stage.pending.append((unique_np, rows))
            if self._on_rows is not None:
                self._on_rows(rows)
        return rows, inverse.reshape(ids.shape)

    def _refusal(self, ids: torch.Tensor) -> InvalidArgument:
        if self.client is None:
            return InvalidArgument(f"{type(self).__name__} {self.table!r} is not bound: wrap the model in PSModel")
        return InvalidArgument(f"{type(self).__name__} {self.table!r}: ids must be int32 or int64, got {ids.dtype}")

    def _take_plan(self, ids: torch.Tensor) -> "_Planned | None":
        """The announced plan of this batch (dropping older announced batches that were
        never looked up), or None when the batch was not announced. On a GPU, ids that are
        the announced tensor itself (the same view of the same memory, unwritten since:
        ``_device_view``) match without reading them back, which would make the training
        thread wait for the GPU at every lookup; other ids are compared on the host."""
        planned = self._planned
        if not planned:
            return None
        if ids.device.type == "cpu":
            batch = ids.detach().reshape(-1).numpy()
            if same_ids(planned[0].flat, batch):     # the common case: the oldest announced
                return planned.popleft()
            k = self._find(lambda plan: same_ids(plan.flat, batch))
        else:
            view = _device_view(ids)[0]
            k = self._find(lambda plan: plan.view == view)
            if k is None:
                batch = ids.detach().reshape(-1).cpu().numpy()
                k = self._find(lambda plan: same_ids(plan.flat, batch))
        if k is None:
            return None
        for _ in range(k):
            planned.popleft()
        return planned.popleft()

    def _find(self, match) -> int | None:
        return next((k for k, plan in enumerate(self._planned) if match(plan)), None)

    def take_gradient_rows(self) -> list[tuple[np.ndarray, torch.Tensor]]:
        """(distinct ids, their gradient rows, on the lookup's device) of every lookup since
        the last call; clears them. Rows that got no gradient are left out. ``PSModel.push``
        copies every table's rows to the host together (``DeviceCopies.to_host_all``)."""
        pending, self.stage.pending = self.stage.pending, []
        return [(ids, rows.grad) for ids, rows in pending if rows.grad is not None]


def announce(lookups: list[tuple[PSRows, torch.Tensor]]) -> None:
    """``request_prefetch(ids)`` of each (embedding, ids) of a step: every batch copied to
    the host in one ``torch.cat`` and deduplicated in one compiled pass
    (``lookup_kernels.unique_each``), each table's plan then a view of those arrays."""
    if not lookups:
        return
    if len(lookups) > MAX_ANNOUNCED:
        for k in range(0, len(lookups), MAX_ANNOUNCED):
            announce(lookups[k:k + MAX_ANNOUNCED])
        return
    device = lookups[0][1].device
    flat = torch.cat([ids.detach().reshape(-1).long().to(device) for _, ids in lookups]).cpu().numpy()   # a copy
    ends = list(itertools.accumulate([ids.numel() for _, ids in lookups]))
    uniques, inverses = unique_each(flat, np.array(ends, np.int64))
    for (emb, ids), start, end, unique, inverse in zip(lookups, [0, *ends[:-1]], ends, uniques, inverses):
        emb.stage.wanted = emb._planned_as(ids, flat[start:end], unique, inverse)


def same_ids(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two 1-d arrays of ids, without its Python where they share a
    dtype: the same array, or their bytes compared (np.array_equal's own Python costs several times more)."""
    if a.dtype == b.dtype:
        return a is b or (a.shape == b.shape and a.tobytes() == b.tobytes())
    return a.shape == b.shape and bool(np.array_equal(a, b))


def bind_caches(modules, client: PSClient, cache_bytes: int, staleness: int, lookahead: int = 1) -> None:
    """Give each module without one its ``RowCache`` (its own ``cache_bytes``, else
    ``cache_bytes``) read up to ``staleness`` steps old, in ASYNC jobs only: in SYNC jobs any
    step may change any row (their results stay those of one large batch), and in SSP jobs a
    cached row would add its age to the staleness the job's bound already allows.
    ``lookahead``: a lookup is planned that many steps ahead of its step, and the rows
    cached by then were read from the servers at the earliest one step after the last plan's:
    a cached row is at least ``lookahead`` steps old (one for a lookup's own prefetch), so a
    lower bound would never read one."""
    from shardps.tables import Consistency
    wanted = [m for m in modules if m.cache is None
              and (m.cache_bytes if m.cache_bytes is not None else cache_bytes) > 0]
    if not wanted:
        return
    group = client.group()
    if group is not None and group.consistency is not Consistency.ASYNC:
        log.info("job %s is %s: embedding rows are read from the servers every step (the cache is for "
                 "ASYNC jobs)", client.job, group.consistency.name)
        return
    least = max(1, lookahead)
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < least:
        raise InvalidArgument(f"cache_staleness={staleness!r}: must be an integer >= {least} (with lookahead "
                              f"{lookahead} a cached row is at least {least} step(s) old when a lookup is "
                              f"planned: a lower bound never reads one): raise it, or set the lookahead to 1")
    for m in wanted:
        m.cache = RowCache(m.embedding_dim, m.cache_bytes if m.cache_bytes is not None else cache_bytes,
                           m.num_embeddings)
        m.cache_tau = staleness
        client.metrics.caches.add(client.job, m.table, m.cache)


class _Completing:
    """A pull of a cache plan's misses, completed with the plan's cached rows when read."""

    def __init__(self, rows: PSRows, plan: CachePlan, pulled: futures.Future, refreshed: int):
        self.rows, self.plan, self.pulled, self.refreshed = rows, plan, pulled, refreshed

    def result(self) -> np.ndarray:
        return self.rows.complete(self.plan, self.pulled.result(), self.refreshed)


class PSEmbedding(PSRows):
    """An embedding table on a shardps sparse table (``nn.Embedding``'s forward semantics).

    Only the rows a batch uses are pulled and pushed; see ``PSRows``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch = self._batch.current
        if batch is not None:
            out = batch.take(self, ids)
            if out is not None:
                return out
        rows, inverse = self._lookup(ids)
        return lookup(rows, inverse)


class PSEmbeddingBag(PSRows):
    """``nn.EmbeddingBag`` on a shardps sparse table: the same call signature and results.

    ``forward(input, offsets=None, per_sample_weights=None)``: ``input`` 2-D ``[B, N]`` (B
    bags of N ids; ``offsets`` must be None) or 1-D with ``offsets`` (the start of each bag;
    with ``include_last_offset`` one more, the end of the last). ``mode``: ``"sum"``,
    ``"mean"`` (an empty bag pools to zeros) or ``"max"``; ``per_sample_weights`` (``input``'s
    shape) scale each id's row, with ``"sum"`` only; ids equal to ``padding_idx`` are left out
    of their bag. Returns ``[B, embedding_dim]``.

    The pooling runs in ``F.embedding_bag`` over the batch's distinct rows, so the result
    equals ``nn.EmbeddingBag``'s on the same weights, and the gradient too, to float32
    rounding (its sums are taken in the order of the ids, ``lookup_kernels``); the gradient
    travels as one row per distinct id (ids that are only padding get none).
    """

    MODES = ("sum", "mean", "max")

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                 include_last_offset: bool = False, padding_idx: int | None = None,
                 table: str | None = None, optimizer: OptimizerConfig | None = None,
                 init: Initializer | None = None, num_blocks: int = 0):
        super().__init__(num_embeddings, embedding_dim, table, optimizer, init, num_blocks)
        if mode not in self.MODES:
            raise InvalidArgument(f"PSEmbeddingBag mode={mode!r}: one of {', '.join(self.MODES)}")
        if padding_idx is not None and num_embeddings > 0:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise InvalidArgument(f"padding_idx={padding_idx} must be within num_embeddings={num_embeddings}")
            padding_idx %= num_embeddings
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows, inverse = self._lookup(input)
        return self.pool(input, rows, inverse, offsets, per_sample_weights)

    def pool(self, input: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor,
             offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None,
             include_last_offset: bool | None = None) -> torch.Tensor:
        """Pool the bags of ``input`` given its looked-up ``rows`` and each id's index in them
        (``inverse``); ``F.embedding_bag``'s checks and semantics."""
        padding = None
        if self.padding_idx is not None:
            hit = (input == self.padding_idx).reshape(-1).nonzero()
            if hit.numel():
                padding = int(inverse.reshape(-1)[hit[0, 0]])
        if offsets is not None:
            offsets = offsets.to(device=inverse.device, dtype=inverse.dtype)
        last = self.include_last_offset if include_last_offset is None else include_last_offset
        return bag_lookup(rows, inverse, offsets, self.mode, per_sample_weights, last, padding)


class _Planned(NamedTuple):
    """An announced batch: its ids on the host (``flat``), deduplicated (``unique``, and
    ``inverse``: each id's index in them); on a GPU, the announced tensor's ``view``
    (``_device_view``) and the tensor itself, held so that its memory is not reused for
    another tensor while the plan waits."""

    flat: np.ndarray
    unique: np.ndarray
    inverse: np.ndarray
    view: tuple | None = None
    held: torch.Tensor | None = None


def _device_view(ids: torch.Tensor) -> tuple[tuple | None, torch.Tensor | None]:
    """(which memory ``ids`` views, and how, and the version of that memory; ``ids``) for a
    tensor on a GPU; (None, None) on the CPU, where a buffer may be written outside torch
    (through numpy) without its version changing. Two GPU tensors with equal views hold the
    same ids while the first is alive: the same bytes, written by nothing since (torch counts
    every in-place write to a tensor and its views)."""
    if ids.device.type == "cpu":
        return None, None
    return ((ids.device, ids.dtype, ids.untyped_storage().data_ptr(), ids.storage_offset(),
             tuple(ids.shape), tuple(ids.stride()), ids._version), ids)
