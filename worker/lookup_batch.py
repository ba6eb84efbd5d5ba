"""A forward's embedding lookups in one call, as fbgemm's table-batched embedding does them.

When ``PSModel``'s pull brings the rows of the ids each table announced (``request_prefetch``,
``announce``, or the ``LookupPlanner``'s prediction), it keeps them together as a
``LookupBatch``. At the forward's first lookup, the batch looks every table up at once: the
tables' rows stacked into one ``[rows, dim]`` leaf, each id's index into it, and one
``lookup_kernels.lookup`` over all of their ids (whose backward, each distinct id's gradient
summed, is then one compiled pass for all the tables too). Each ``PSEmbedding`` takes its
part of the output (``take``: a view) when the ids it is given are the ids it announced and
the rows fetched for them are still its; any other lookup (ids not announced, a table looked
up twice, ``PSEmbeddingBag``, ids on a GPU) goes its own way (``PSRows._lookup``).

``PSModel.push`` sends each taken table's part of the leaf's gradient as that table's rows.
A table whose part of the output takes no part in the loss sends zero rows for its ids (a
lookup of its own would send none).

Batched: two or more tables of the first one's dim (others look up on their own), their ids
on the CPU (a GPU's lookups stay a table at a time).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shardps.worker.embeddings import PSEmbedding, PSRows, same_ids
from shardps.worker.lookup_kernels import lookup


class LookupBatch:
    """The rows fetched for a forward's announced lookups (``of``), looked up at once when
    the first table takes its part. ``members``: (embedding, its announced batch, the
    ``stage.fetched`` it was given) in the order of the leaf's and the output's parts."""

    __slots__ = ("members", "index", "backward_push", "weight", "output", "row_at", "out_at", "taken")

    def __init__(self, members: list, backward_push):
        self.members = members
        self.index = {emb: k for k, (emb, _, _) in enumerate(members)}
        self.backward_push = backward_push      # hybrid.BackwardPush (it watches the leaf), or None
        self.weight: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.row_at: list[int] = []
        self.out_at: list[int] = []
        self.taken: list[tuple[PSRows, torch.Tensor]] = []     # (embedding, ids) of each take

    @classmethod
    def of(cls, arrived: list, backward_push=None) -> "LookupBatch | None":
        """The batch of the ``PSEmbedding``s among ``arrived`` ((embedding, distinct ids,
        rows) of a pull) whose rows are for the batch they announced last, of the first
        one's dim; None for fewer than two."""
        dim = next((emb.embedding_dim for emb, _, _ in arrived if type(emb) is PSEmbedding), 0)
        members = [(emb, emb._planned[0], emb.stage.fetched) for emb, ids, _ in arrived if type(emb) is PSEmbedding
                   and emb.embedding_dim == dim and emb._planned and emb._planned[0].unique is ids]
        return cls(members, backward_push) if len(members) > 1 else None

    def take(self, emb: PSRows, ids: torch.Tensor) -> torch.Tensor | None:
        """``emb``'s looked-up rows for ``ids`` (``ids.shape + (dim,)``, a view of the batch's
        output) when they are the ids it announced, the rows fetched for them are still its,
        and it looks up in the grad mode of the batch's first lookup; else None (nothing
        changed: ``emb`` looks them up itself)."""
        k = self.index.get(emb)
        if k is None or emb.stage.fetched is not self.members[k][2] or not ids.is_cpu:
            return None
        planned = self.members[k][1]
        grad = emb.training and torch.is_grad_enabled()
        if not same_ids(planned.flat, ids.detach().reshape(-1).numpy()) or (
                self.weight is not None and grad != self.weight.requires_grad):    # looked up in another mode
            return None
        output = self.output if self.output is not None else self._look_up(grad)
        emb._planned.popleft()
        emb.stage.fetched, emb.stage.last_unique = None, planned.unique.shape[0]
        self.taken.append((emb, ids))
        return output[self.out_at[k]:self.out_at[k + 1]].view(*ids.shape, -1)

    def _look_up(self, grad: bool) -> torch.Tensor:
        """Every member's lookup: the leaf (collecting gradients where ``grad``) and the
        output, which it returns."""
        rows = [fetched[1] for _, _, fetched in self.members]
        inverses = [planned.inverse for _, planned, _ in self.members]
        ids = list(map(len, inverses))
        self.row_at = list(itertools.accumulate(map(len, rows), initial=0))
        self.out_at = list(itertools.accumulate(ids, initial=0))
        inverse = np.concatenate(inverses, dtype=np.int64)
        inverse += np.repeat(self.row_at[:-1], ids)             # each table's rows after those before
        self.weight = torch.from_numpy(np.concatenate(rows)).requires_grad_(grad)
        if grad and self.backward_push is not None:
            self.backward_push.watch(self.weight)
        self.output = lookup(self.weight, torch.from_numpy(inverse))
        return self.output

    @property
    def collecting(self) -> bool:
        """Whether tables took their parts and the leaf collects their gradients."""
        return self.weight is not None and self.weight.requires_grad

    def gradients(self) -> list[tuple]:
        """(table, distinct ids, gradient rows) of each table that took its part, once the
        backward pass gave the leaf its gradient (none before)."""
        grad = None if self.weight is None else self.weight.grad
        if grad is None:
            return []
        at, members = self.row_at, self.members
        taken = [self.index[emb] for emb, _ in self.taken]
        return [(members[k][0].table, members[k][1].unique, grad[at[k]:at[k + 1]]) for k in taken]
