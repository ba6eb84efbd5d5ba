"""PyTorch integration: train an ordinary ``nn.Module`` whose parameters live on shardps.

    model = Net()                                    # any nn.Module
    ps_model = PSModel(model, client, optimizer=adam(lr=1e-3), local=["bn"])
    ps_model.create_tables()                         # once per worker; idempotent
    for x, y in loader:
        ps_model.pull()                              # current parameters from the servers
        loss = F.nll_loss(model(x), y)
        loss.backward()
        ps_model.push()                              # gradients to the servers (their optimizer)
    torch.save(ps_model.state_dict(), "model.pt")    # plain PyTorch loads it

* The dense parameters travel as flat buckets (``shardps.worker.dense_buckets``): those
  sharing an optimizer lie end to end in one dense table, ``dense_table`` ("dense-params";
  more optimizers: "dense-params.1", ...), so a step's pull and push cost the same for 4 or
  400 tensors. ``dense_table=None``: a table per parameter, named after it ("fc1.weight").
  The tables are created with ASSIGNED initial values: each worker offers its module's own
  initial values and the first one written wins, so all workers start from identical values.
* ``PSEmbedding`` / ``PSEmbeddingBag`` (``shardps.worker.embeddings``) and
  ``PSEmbeddingBagCollection`` (``shardps.worker.embedding_bag``) keep their rows on sparse
  tables: a step moves only the distinct ids of the batch and their gradient rows.
* One pull and one push per server per step for the whole model: ``pull`` fetches the dense
  values and the rows every embedding announced (``pull(features)`` for the collections,
  ``request_prefetch(ids)`` for single embeddings) in one ``pull_many``; ``push`` sends every
  gradient in one ``push_many`` (with ``overlap``, both become one exchange). A lookup of ids
  that were not announced pulls them itself, in a call of its own.
* ``cache_bytes``: each embedding keeps its hot rows on the worker (``RowCache``) and reads
  them without a pull while they are at most ``cache_staleness`` steps old, in ASYNC jobs
  (SYNC and SSP jobs read every row from the servers); every gradient is still pushed.
* The optimizer runs on the servers, chosen per parameter or embedding table
  (``optimizers={"fc1.weight": sgd(...)}``: fc1.weight goes in a bucket of its own).
* Parameters whose names start with a prefix in ``local`` stay on the worker and are trained by
  ``local_optimizer`` (a torch optimizer you pass); buffers (batch-norm running statistics)
  always stay local to each worker.
* ``dense="allreduce"``: every dense parameter stays on the worker, in torch's
  DistributedDataParallel over torch's process group, stepped by ``dense_optimizer`` (a torch
  optimizer); only the embedding tables live on the servers (``shardps.worker.hybrid``).
* ``state_dict()`` returns the module's ordinary state dict with the servers' values (a
  ``PSEmbedding``'s ``weight`` as a full ``[num_embeddings, dim]`` tensor), loadable into the
  same architecture with ``nn.Embedding`` in place of ``PSEmbedding`` (``nn.EmbeddingBag`` in
  place of ``PSEmbeddingBag``).
"""

from __future__ import annotations

import collections
import math
import time
from concurrent import futures
from typing import Callable, Sequence

import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import OptimizerConfig, sgd
from shardps.worker import dense_buckets, hybrid, step_data
from shardps.worker.client import PSClient, PushResult
from shardps.worker.device_copies import DeviceCopies
from shardps.worker.embedding_bag import KeyedJaggedTensor, PSEmbeddingBagCollection
from shardps.worker.embeddings import BatchSlot, PSEmbedding, PSEmbeddingBag, PSRows, StepClock, announce
from shardps.worker.lookup_batch import LookupBatch
from shardps.worker.lookups import LookupPlanner
from shardps.worker.model_io import ModelIO
from shardps.worker.wanted import Wanted, give_rows

__all__ = ["PSModel", "PSLambdaLR", "PSEmbedding", "PSEmbeddingBag", "PSEmbeddingBagCollection",
           "KeyedJaggedTensor"]


MAX_LOOKAHEAD = 4


class PSModel(ModelIO, nn.Module):        # type: ignore[misc]  # state_dict: the servers' values
    """Binds a module's parameters to shardps tables; see the module docstring. An
    ``nn.Module`` wrapping the module: calling it runs the module's forward; ``train()`` /
    ``eval()`` reach the module; ``state_dict()`` / ``load_state_dict()`` read and write the
    servers' tables (``shardps.worker.model_io``).

    Not thread-safe (one training loop drives it). ``pull``/``push`` block; with a SYNC or
    SSP job, ``pull`` waits as the consistency model requires.
    """

    def __init__(self, module: nn.Module, client: PSClient, optimizer: OptimizerConfig | None = None,
                 optimizers: dict[str, OptimizerConfig] | None = None, local: Sequence[str] = (),
                 local_optimizer: torch.optim.Optimizer | None = None, block_size: int = 0,
                 report_steps: bool | None = None, overlap: bool = False, lookahead: int = 1,
                 cache_bytes: int = 0, cache_staleness: int = 8, dense: str = "servers",
                 dense_optimizer: torch.optim.Optimizer | None = None, dense_table: str | None = "dense-params"):
        super().__init__()
        self.module = module
        self.client = client
        self.optimizer = optimizer or sgd(0.01)
        self.optimizers = dict(optimizers or {})
        self.dense_mode = hybrid.dense_mode(dense)
        if self.dense_mode == "allreduce":      # every parameter on the worker (worker/hybrid.py)
            local, local_optimizer = [n for n, _ in module.named_parameters()], hybrid.check_optimizer(
                dense_optimizer, local_optimizer)
        elif dense_optimizer is not None:
            raise InvalidArgument("dense_optimizer is for dense='allreduce'; parameters kept local with local= "
                                  "are stepped by local_optimizer")
        self.local = tuple(local)
        self.local_optimizer = local_optimizer
        self.block_size = block_size
        self._report_steps = report_steps
        self.embeddings: dict[str, PSRows] = {}
        self.copies = DeviceCopies()           # rows and dense values to the device, gradients back
        self.collections: list[PSEmbeddingBagCollection] = []
        self._clock = StepClock()              # every table's (see _set_clock)
        self._batch = BatchSlot()              # every table's: the forward's lookups in one call (lookup_batch)
        for name, mod in module.named_modules():
            if isinstance(mod, PSRows):
                mod.table = mod.table or name
                mod.client, mod.copies, mod._clock, mod._batch = client, self.copies, self._clock, self._batch
                self.embeddings[name] = mod
            elif isinstance(mod, PSEmbeddingBagCollection):
                self.collections.append(mod)
        # DDP over the module (dense="allreduce"), kept out of the module tree and the state dict
        self.__dict__["_ddp"] = hybrid.wrap(module, list(self.embeddings)) if self.dense_mode == "allreduce" else None
        if self._ddp is not None:
            module.register_forward_pre_hook(lambda *_: hybrid.check_through_ddp(self.__dict__.get("_through_ddp")))
        self.dense: dict[str, nn.Parameter] = {}
        for name, p in module.named_parameters():
            if _under(name, self.local):
                continue
            self.dense[name] = p
        # the dense parameters' tables: flat buckets (worker/dense_buckets.py), or one per parameter
        self.buckets = dense_buckets.buckets(self.dense, self.table_optimizer, dense_table, self.embeddings.values())
        self.step = 0
        if not 1 <= lookahead <= MAX_LOOKAHEAD:
            raise InvalidArgument(f"lookahead={lookahead}: use 1 to {MAX_LOOKAHEAD} steps")
        self.overlap = overlap
        self.requested_lookahead = lookahead
        self._flow = _Flow()                   # the pull deferred, the push held or in flight
        # with overlap: (the step it is for, the exchange carrying that step's pull, the Wanted
        # whose rows it carries: _Completed once they arrived), oldest first
        self._prefetch: collections.deque[tuple[int, futures.Future, Wanted | _Completed]] = collections.deque()
        # seconds in pull and push, waiting for stragglers, stepping the local optimizer
        self.timings = {"pull_wait": 0.0, "push_wait": 0.0, "barrier_wait": 0.0, "local_optimizer": 0.0}
        self._base_lr: dict[str, float] = {}
        # the plain loop's lookups, learned from one forward, fetched with the next pull
        self.lookups = LookupPlanner()
        self._handled_checkpoint = ("", -1)                # (on-demand id, step) of the last one
        self.cache_bytes, self.cache_staleness = cache_bytes, cache_staleness
        client.before_leaving(self.flush)
        # hybrid with overlap: a step's push leaves from its backward pass (hybrid.BackwardPush)
        self._backward_push = hybrid.BackwardPush(lambda: _send_from_backward(self)) if (
            self._ddp is not None and overlap) else None
        if self.embeddings:
            for emb in self.embeddings.values():
                emb._observer = self.lookups.observe
                emb._on_rows = None if self._backward_push is None else self._backward_push.watch
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
            module.register_forward_hook(self._after_forward, with_kwargs=True)

    _ddp: nn.Module | None        # DistributedDataParallel over the module (dense="allreduce"), else None

    # written every step: set directly, past nn.Module.__setattr__'s checks (as PSRows does)
    _PLAIN = frozenset({"step"})

    def __setattr__(self, name: str, value) -> None:
        if name in PSModel._PLAIN:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def forward(self, *args, **kwargs):
        """The wrapped module's forward (through DistributedDataParallel with dense="allreduce")."""
        if self._ddp is None:
            return self.module(*args, **kwargs)
        self.__dict__["_through_ddp"] = True
        try:
            return self._ddp(*args, **kwargs)
        finally:
            self.__dict__["_through_ddp"] = False

    # ------------------------------------------------------------------ per step
    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Announce the sparse features of the next forward to every
        ``PSEmbeddingBagCollection`` of the module: their rows travel with the next ``pull``
        (with ``overlap``: in the exchange the next ``push`` sends)."""
        for collection in self.collections:
            collection.request_prefetch(features)

    def pull(self, features: KeyedJaggedTensor | None = None) -> None:
        """Load the servers' current values into the module's dense parameters, and fetch
        the rows of every announced lookup (``features`` for the collections, see
        ``prefetch``; ``request_prefetch`` of single embeddings), all in one ``pull_many``:
        one call per server. With ``overlap``, what the last push's exchange carried is used
        and only what it lacks is pulled; that pull first waits for the push in flight, so it
        reads every earlier push of this worker.

        In the plain loop (no ``features``, no ``overlap``), once a forward has shown where
        each embedding's ids come from (views of the forward's inputs: ``LookupPlanner``),
        the pull waits for the next forward of the module and fetches the dense values and
        those embeddings' rows there, together: one call per server instead of one per
        table. ``push``, ``settle`` and ``state_dict`` complete a pull no forward took."""
        if features is None and not self.overlap and self.lookups.learned and not self._prefetch:
            self._flow.deferred_pull = True
            return
        self._pull_now(features)

    def _before_forward(self, module, args, kwargs) -> None:
        if self.overlap and not self._flow.deferred_pull:
            return      # the loop announces its lookups itself (prefetch): no forward is watched
        self.lookups.begin(args, kwargs)
        if self._flow.deferred_pull:
            announce([(emb, ids) for emb, ids in self.lookups.predict()           # type: ignore[misc]
                      if emb.stage.wanted is None and emb.stage.fetched is None])    # type: ignore[attr-defined]
            self._pull_now()

    def _after_forward(self, module, args, kwargs, output) -> None:
        batch, self._batch.current = self._batch.current, None      # its rows were this forward's
        self.lookups.end(batch.taken if batch is not None else ())
        if batch is not None and batch.collecting:
            self._flow.batches.append(batch)                         # its gradients: the next push's

    def _pull_now(self, features: KeyedJaggedTensor | None = None) -> None:
        self._flow.deferred_pull = False
        if features is not None:
            self.prefetch(features)
        started = time.perf_counter()
        names = [b.table for b in self.buckets]
        while self._prefetch and self._prefetch[0][0] < self.step:
            self._prefetch.popleft()                # fetched for a step that was not run
        if self._prefetch and self._prefetch[0][0] == self.step:
            res = self._prefetch[0][1].result()[1]               # (push, pull) of an exchange
            self._cache_arrived()                                # completes its rows (and any returned)
            carried = self._prefetch.popleft()[2]
            assert isinstance(carried, _Completed)               # (emb, ids, rows): _cache_arrived's
            arrived = list(carried)
            give_rows(arrived)
            step_data.load_dense(self.buckets, res.values, self.copies)
            names = []                                           # loaded from the exchange
            waited = res.waited_seconds
        else:
            waited, arrived = 0.0, []
        wanted = Wanted.take(self.embeddings.values(), self.step, self.step, unfetched=True)
        held, self._flow.held = self._flow.held, None
        if names or wanted:
            # read-your-writes: a pull no exchange carried sees this worker's earlier pushes
            # (the one in flight would otherwise race it to the server); a held push rides
            # with it, applied first (one round trip per server)
            self.flush()
            self._set_clock(self.step)
            pulls = [(n,) for n in names] + wanted.requests()
            res = (self.client.exchange(held[0], pulls, clock=held[1], report_step=self.report_steps)[1]
                   if held is not None else self.client.pull_many(pulls, clock=self.step))
            pulled = wanted.arrived(res.values[len(names):])
            give_rows(pulled)
            arrived += pulled
            if names:
                step_data.load_dense(self.buckets, res.values, self.copies)
            waited = max(waited, res.waited_seconds)
        elif held is not None:
            self.client.push_many(held[0], clock=held[1], report_step=self.report_steps)
        # every table's lookup in one call, at the forward's first (lookup_batch)
        self._batch.current = LookupBatch.of(arrived, self._backward_push) if len(arrived) > 1 else None
        waited = min(waited, time.perf_counter() - started)
        self.timings["barrier_wait"] += waited        # SYNC / SSP: waiting for stragglers
        self.timings["pull_wait"] += time.perf_counter() - started - waited

    def push(self) -> PushResult | None:
        """Send the gradients of this step (dense parameters, and the rows each embedding
        looked up: one row per distinct id) as one push, step the local optimizer, zero the
        gradients, advance the clock.

        With ``overlap``, the push goes out in the background together with the pull of step
        ``step + lookahead`` (dense values and the embedding rows announced with
        ``prefetch(features)`` or ``request_prefetch``): one round trip per server, the
        server applying the push before it reads. At most one is in flight (the next
        ``push`` waits for it and raises its error). With ``lookahead`` 1 the next step's
        ``pull`` waits for it at once; with 2 it runs during the next step's compute (see
        ``lookahead``). Other workers' pushes may still be in flight (SYNC and SSP pulls wait
        as their model requires). Returns the acknowledgement without overlap, None with it.

        In the plain loop, once ``pull`` waits for the forward (see ``pull``), the push is
        held and rides with that pull: one round trip per server per step, the server
        applying the push before it reads; ``push`` returns None. ``flush`` sends it at once;
        the client sends it before ``leave``, ``checkpoint_barrier`` and ``close``."""
        if self._flow.deferred_pull:                    # pulled, then no forward: load the values
            self._pull_now()
        started = time.perf_counter()
        requests = step_data.gradient_requests(self.buckets, self.embeddings.values(), self.copies, self._flow.batches)
        future, prefetch = _sent_in_backward(self, requests)     # (None, None) unless the backward pass sent it
        self.flush()
        self._cache_arrived()
        if future is None and not self.overlap and self.lookups.learned:
            self._flow.held = (requests, self.step)     # sent with the next pull (see push's docstring)
        elif future is None and self.overlap:
            future, sent_pull = _exchange(self, requests)
            prefetch = prefetch or sent_pull
        if future is None and self._flow.held is None:
            future = self.client.push_many_async(requests, clock=self.step, report_step=self.report_steps)
        stepped = _step_local(self.local_optimizer)     # compute: not counted as push_wait
        self.timings["local_optimizer"] += stepped
        for b in self.buckets:
            b.zero_grad()
        self.step += 1
        self._set_clock(self.step)
        result = None
        if self.overlap:
            self._flow.pending_push = future
            if prefetch is not None:
                self._prefetch.append(prefetch)
        elif future is not None:
            result = future.result()
        self.timings["push_wait"] += time.perf_counter() - started - stepped
        return result

    def _cache_arrived(self) -> None:
        """Complete the embedding rows of every prefetch whose exchange has returned (each
        plan's cached rows with its pulled misses, which refresh the cache), once: in ``push``
        (``flush`` waited for the last exchange) its rows enter the caches before this push
        plans the lookups of step ``step + lookahead``. With lookahead 2 a cached row is then 2
        steps old when a plan reads it; completed only when its step read it, 3."""
        names = len(self.buckets)
        for k, (use, future, carried) in enumerate(self._prefetch):
            if isinstance(carried, _Completed) or not future.done() or future.exception() is not None:
                continue
            self._prefetch[k] = (use, future, _Completed(carried.arrived(future.result()[1].values[names:])))

    @property
    def lookahead(self) -> int:
        """Steps between a pull riding on a push and the step that uses its values (with
        ``overlap``). 1: step t + 1 reads values that include every push of this worker up to
        step t, and its ``pull`` waits for that exchange. 2 (ASYNC jobs): step t + 2 reads
        the values pulled with step t's push, so the exchange overlaps step t + 1's compute,
        and a step's values lack this worker's previous step (one step staler, as if one
        more worker were in flight). SYNC and SSP jobs always use 1: their steps are ordered
        by the servers' clocks."""
        return 1 if self.report_steps else self.requested_lookahead

    @property
    def report_steps(self) -> bool:
        """Whether each push also reports its step to every server: SYNC and SSP servers
        wait for every worker's report, including servers this step sent nothing to. The
        default (``report_steps=None``) follows the job's consistency mode."""
        if self._report_steps is None:
            from shardps.tables import Consistency
            group = self.client.group()
            self._report_steps = group is not None and group.consistency is not Consistency.ASYNC
        return self._report_steps

    def _set_clock(self, clock: int) -> None:
        """The clock the embeddings' pulls carry from now on (the dense pulls name theirs):
        their one ``StepClock``."""
        self._clock.value = clock

    def flush(self) -> None:
        """Send the push held for the next pull, or wait for the push in flight
        (``overlap``); raises its error."""
        pending, self._flow.pending_push = self._flow.pending_push, None
        if pending is not None:
            pending.result()
        held, self._flow.held = self._flow.held, None
        if held is not None:
            self.client.push_many(held[0], clock=held[1], report_step=self.report_steps)

    def settle(self) -> None:
        """Wait for the push in flight, then load the servers' latest values (for evaluation
        and export)."""
        self.flush()
        self._prefetch.clear()
        self._pull_now()


def _step_local(optimizer: torch.optim.Optimizer | None) -> float:
    """Step and zero the worker's own optimizer (of the parameters kept local); its seconds."""
    started = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _under(name: str, prefixes: Sequence[str]) -> bool:
    """Whether parameter ``name`` lies under one of the module paths ``prefixes``."""
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def _exchange(model: PSModel, requests: list[tuple]) -> tuple[futures.Future | None, tuple | None]:
    """With ``overlap``: this push (``requests``) and the next step's dense values and
    announced embedding rows in one round trip per server (each server applies the push, then
    serves the pull). Returns (its future, the prefetch for step ``step + lookahead``), or
    (None, None) when there is nothing to pull."""
    use = model.step + model.lookahead           # the step that reads this pull
    wanted = Wanted.take(model.embeddings.values(), use, model.step + 1)
    requests_next = [(b.table,) for b in model.buckets] + wanted.requests()
    if not requests_next:
        return None, None
    model._set_clock(model.step + 1)
    future = model.client.exchange_async(requests, requests_next, clock=model.step, report_step=model.report_steps)
    return future, (use, future, wanted)


def _send_from_backward(model: PSModel) -> tuple | None:
    """``hybrid.BackwardPush``'s send: in an ASYNC job whose next lookups were announced
    before this backward pass, the step's push with their pull (``_exchange``); else None,
    and ``push`` sends it as without the hook (SYNC and SSP steps report to the servers'
    clocks once, at ``push``)."""
    if model.report_steps or all(emb.stage.wanted is None for emb in model.embeddings.values()):
        return None
    requests = step_data.gradient_requests(model.buckets, model.embeddings.values(), model.copies, model._flow.batches)
    model.flush()
    model._cache_arrived()
    return _exchange(model, requests)


def _sent_in_backward(model: PSModel, requests: list[tuple]) -> tuple:
    """(future, prefetch) of the exchange the backward pass sent, once (raising its error);
    (None, None) when it sent none. ``requests``: gradients of a backward pass after it
    (gradient accumulation): ``push`` sends them once that exchange is done (its prefetch
    kept), and the model pushes at ``push`` from then on."""
    sent = None if model._backward_push is None else model._backward_push.take()
    if sent is None or not requests:
        return sent or (None, None)
    model._backward_push = None
    for emb in model.embeddings.values():
        emb._on_rows = None
    model._flow.pending_push = sent[0]                # flush waits for it before the rest is sent
    return None, sent[1]


class _Flow:
    """A ``PSModel``'s calls between steps, in plain slots (past ``nn.Module.__setattr__``):
    ``deferred_pull`` (a pull waiting for the next forward), ``held`` (the push riding with
    the next pull: (requests, clock)), ``pending_push`` (the exchange in flight),
    ``batches`` (the forwards' batched lookups whose gradients the next push sends)."""

    __slots__ = ("deferred_pull", "held", "pending_push", "batches")

    def __init__(self):
        self.deferred_pull = False
        self.held: tuple[list, int] | None = None
        self.pending_push: futures.Future | None = None
        self.batches: list[LookupBatch] = []


class _Completed(list):
    """A prefetch's (embedding, ids, rows), completed by ``_cache_arrived``."""


class PSLambdaLR:
    """Like ``torch.optim.lr_scheduler.LambdaLR`` for server-side optimizers: ``step()`` sets
    every table's lr to ``base_lr * lr_lambda(epoch)``."""

    def __init__(self, ps_model: PSModel, lr_lambda: Callable[[int], float]):
        self.ps_model = ps_model
        self.lr_lambda = lr_lambda
        self.epoch = 0

    def step(self) -> None:
        self.epoch += 1
        factor = self.lr_lambda(self.epoch)
        if not math.isfinite(factor) or factor < 0:
            raise InvalidArgument(f"lr_lambda({self.epoch}) = {factor}: must be a finite number >= 0")
        self.ps_model.set_lr(lambda base: base * factor)
