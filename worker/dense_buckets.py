"""A model's dense parameters as flat buckets: one dense table per optimizer (and device), as
DDP buckets its gradients, so that a step's pull and push cost the same whatever the number
of tensors.

A ``DenseBucket`` lays its parameters end to end in one flat tensor and makes each parameter
a view of its piece: a pull's values reach every parameter in one copy. A push sends the
bucket's gradients in one flat array (one ``torch.cat``). The servers' optimizers are
elementwise, so a flat table of the parameters is stepped exactly as the parameters one by
one (SGD, Adagrad, Adam: ``tests/test_dense_buckets.py`` compares them bit for bit).

Frozen parameters (``requires_grad=False``) get buckets of their own, which are pulled and
never pushed. When a trained parameter has no gradient in a step (the forward did not use
it), the runs of its neighbours that have one are sent, so its values and optimizer state do
not move; a block that several runs of one push reach takes one optimizer step for them
(``BlockOp.same_step``), so that too trains bit for bit as a table per parameter.

``state_dict`` keys stay the parameters' names (``PSModel.state_dict`` is the module's);
``bucket_of`` / ``pieces`` map names to their place in a bucket's table.
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from shardps.errors import InvalidArgument

_GRAD = operator.attrgetter("grad")
_FLAT = torch.Tensor.flatten


class DenseBucket:
    """Parameters sharing one optimizer config and device, as the flat table ``table``.
    ``names[i]``'s values are ``[offsets[i], offsets[i + 1])`` of the table."""

    def __init__(self, table: str, names: Sequence[str], params: Sequence[nn.Parameter],
                 shape: tuple[int, ...] | None = None):
        self.table = table
        self.names = list(names)
        self.params = list(params)
        for n, p in zip(self.names, self.params):
            if p.dtype != torch.float32:
                raise InvalidArgument(f"parameter {n!r} is {p.dtype}: PSModel's tables hold float32 (convert the "
                                      f"module with .float(); for mixed precision use torch.autocast)")
        sizes = [p.numel() for p in self.params]
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64).tolist()
        self.numel = int(self.offsets[-1])
        self.shape = shape or (self.numel,)         # the table's shape
        self.flat = torch.empty(0)
        self.bind()

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def bind(self) -> None:
        """Make every parameter a view of its piece of one flat tensor, keeping its values
        (again after ``.to(device)`` and the like replaced the parameters' tensors)."""
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            for p, a, z in zip(self.params, self.offsets, self.offsets[1:]):
                p.data = self.flat[a:z].view_as(p)

    def bound(self) -> bool:
        """Whether the parameters still share ``flat``: not after ``.to(device)``, ``.cuda()``
        and the like gave them new tensors (the first and last parameter are looked at, so
        one parameter's tensor replaced by hand in between goes unseen)."""
        first, last = self.params[0], self.params[-1]
        return (first.data_ptr() == self.flat.data_ptr() and first.device == self.flat.device
                and last.data_ptr() == self.flat[self.offsets[-2]:].data_ptr())

    def load(self, values: torch.Tensor) -> None:
        """Copy pulled values (the whole table, on the bucket's device) into the parameters."""
        if not self.bound():
            self.bind()
        with torch.no_grad():
            self.flat.copy_(values.reshape(-1))

    def gradients(self) -> list[tuple[int, torch.Tensor]]:
        """(start, flat gradient) to push: the whole bucket in one piece when every parameter
        has a gradient, else each run of neighbours that have one; none without gradients.
        The common case walks the parameters in C (``map``), not a Python loop per tensor."""
        grads = list(map(_GRAD, self.params))
        if all(map(operator.is_not, grads, itertools.repeat(None))):   # one: its own gradient, not a copy
            return [(0, grads[0].reshape(-1) if len(grads) == 1 else torch.cat(list(map(_FLAT, grads))))]
        runs: list[tuple[int, list[torch.Tensor]]] = []
        end = -1
        for g, a, z in zip(grads, self.offsets, self.offsets[1:]):
            if g is None:
                continue
            if a == end:
                runs[-1][1].append(g.reshape(-1))
            else:
                runs.append((a, [g.reshape(-1)]))
            end = z
        return [(a, torch.cat(gs)) for a, gs in runs]

    def zero_grad(self) -> None:
        """Every parameter's gradient to None (in C: ``map`` over the parameters)."""
        collections.deque(map(setattr, self.params, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)

    def values(self) -> torch.Tensor:
        """The parameters' values as the flat table (a copy on the CPU)."""
        if not self.bound():
            self.bind()
        return self.flat.detach().to("cpu", copy=True)

    def piece(self, name: str) -> tuple[int, int]:
        """The flat range of parameter ``name`` in the table."""
        i = self.names.index(name)
        return self.offsets[i], self.offsets[i + 1]


def buckets(dense: dict[str, nn.Parameter], config_of, name: str | None, embeddings: Iterable) -> list[DenseBucket]:
    """The buckets of ``dense`` (name -> parameter): one per (optimizer config
    ``config_of(name)``, device, whether it is trained: ``requires_grad``), in the order
    their first parameter appears; the tables are named ``name``, ``name.1``, ... (``name``
    None: a table per parameter, named and shaped as it). InvalidArgument when one of those
    names is the table of one of ``embeddings``."""
    if name is None:
        return [DenseBucket(n, [n], [p], tuple(p.shape)) for n, p in dense.items()]
    groups: dict[tuple, list[str]] = {}
    for n, p in dense.items():           # frozen parameters apart: never a gap in a trained bucket's push
        groups.setdefault((config_of(n), p.device, p.requires_grad), []).append(n)
    out = []
    for i, names in enumerate(groups.values()):
        table = name if i == 0 else f"{name}.{i}"
        out.append(DenseBucket(table, names, [dense[n] for n in names]))
    clash = sorted({b.table for b in out} & {emb.table for emb in embeddings})
    if clash:
        raise InvalidArgument(f"dense bucket table {clash[0]!r} is also an embedding's table: pass another "
                              f"dense_table= to PSModel")
    return out


def for_job(chosen: list[DenseBucket], dense: dict[str, nn.Parameter], tables: dict) -> list[DenseBucket]:
    """The layout to train in a job that may have tables already (``tables``: name -> its
    view): ``chosen``, unless the job holds none of its tables but a table per parameter of
    ``dense``, each of its parameter's shape (a job trained before buckets, or with
    ``dense_table=None``), whose values it then trains on: a table per parameter."""
    if not dense or any(b.table in tables for b in chosen):
        return chosen
    if all(n in tables and tuple(tables[n].spec.shape) == tuple(p.shape) for n, p in dense.items()):
        return buckets(dense, None, None, ())
    return chosen


def bucket_of(all_buckets: Sequence[DenseBucket], name: str) -> DenseBucket | None:
    """The bucket holding parameter ``name`` (None: not bucketed)."""
    for b in all_buckets:
        if name in b.names:
            return b
    return None
