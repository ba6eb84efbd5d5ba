"""Where each embedding's ids come from, so that a step's rows travel before its forward.

In the plain loop (``model.pull()``, ``model(x)``, ``backward``, ``model.push()``) every
``PSEmbedding`` looks its ids up inside the forward, one table after another: without help,
one pull per table per step. ``LookupPlanner`` watches a forward: a lookup whose ids tensor
is a view of one of the forward's inputs (``x``, ``x[:, 3]``, ``x[..., 2:5]``, ``x.t()``) is
kept as a ``Recipe``: which input (by position among the forward's tensor arguments), that
input's shape and strides, the view's shape, strides and offset. Before the next forward,
``predict`` cuts each embedding's ids out of the new inputs the same way, so ``PSModel``
fetches every table's rows and the dense values in one pull (one call per server).

A prediction is checked at the lookup: ids that differ (computed ids, an input laid out
differently, a table looked up twice in one forward) are pulled at the lookup as before, and
the forward's lookups are learned again. Nothing here changes what a step reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a forward's arguments, in order (inside tuples, lists and dicts too)."""
    out: list[torch.Tensor] = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])

    walk(args)
    walk(kwargs)
    return out


@dataclass(frozen=True)
class Recipe:
    """How to cut a lookup's ids out of a forward's inputs (see the module docstring)."""

    input: int                              # position among ``input_tensors``
    layout: tuple                           # the input's (dtype, shape, strides): ``layout``
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int                             # storage offset from the input's

    @classmethod
    def of(cls, ids: torch.Tensor, inputs: list[torch.Tensor]) -> "Recipe | None":
        """The recipe of ``ids`` if it is a view of one of ``inputs``, else None."""
        if ids.numel() == 0:
            return None
        ptr = ids.untyped_storage().data_ptr()
        for i, x in enumerate(inputs):
            if (x.dtype == ids.dtype and x.device == ids.device
                    and x.untyped_storage().data_ptr() == ptr):
                return cls(i, layout(x), tuple(ids.shape), tuple(ids.stride()),
                           int(ids.storage_offset() - x.storage_offset()))
        return None

    def cut(self, inputs: list[torch.Tensor], layouts: list[tuple] | None = None) -> torch.Tensor | None:
        """The ids this recipe names in ``inputs`` (whose ``layout``s may be given); None
        where they are laid out otherwise."""
        if self.input >= len(inputs):
            return None
        x = inputs[self.input]
        if (layout(x) if layouts is None else layouts[self.input]) != self.layout:
            return None
        return x.as_strided(self.shape, self.stride, x.storage_offset() + self.offset)


def layout(x: torch.Tensor) -> tuple:
    """A tensor's dtype, shape and strides: a recipe cuts its view out of an input laid out so."""
    return x.dtype, tuple(x.shape), tuple(x.stride())


def _key(ids: torch.Tensor) -> tuple:
    """Which memory a lookup's ids are, and how they lie in it."""
    return ids.data_ptr(), ids.dtype, ids.device, tuple(ids.shape), tuple(ids.stride())


class LookupPlanner:
    """The lookups of the last forward, and their predictions for the next one.

    ``begin(args, kwargs)`` at the start of a forward, ``observe(table, ids)`` at each
    lookup, ``end()`` once the forward returned; ``predict()`` (between ``begin`` and the
    first lookup) gives ``(table, ids)`` for each table looked up once in the last forward
    from a view of its inputs. ``table`` is any hashable (``PSModel`` passes the module).
    A lookup of the very ids predicted for it (the same memory, laid out alike) keeps its
    table's recipe without searching the inputs again.
    Not thread-safe (one training loop)."""

    def __init__(self):
        self.recipes: dict = {}                   # table -> Recipe, learned from the last forward
        self._inputs: list[torch.Tensor] | None = None
        self._seen: dict | None = None            # table -> Recipe | None (None: not predictable)
        self._predicted: dict = {}                # table -> ``_key`` of the ids predicted for it

    @property
    def learned(self) -> bool:
        return bool(self.recipes)

    def begin(self, args: tuple, kwargs: dict) -> None:
        self._inputs = input_tensors(args, kwargs)
        self._seen = {}
        self._predicted = {}

    def observe(self, table, ids: torch.Tensor) -> None:
        if self._seen is None or self._inputs is None:
            return                                # a lookup outside a watched forward
        # a table looked up twice in one forward is not predicted (its rows are pulled per lookup)
        known = self._predicted.get(table)
        if table in self._seen:
            self._seen[table] = None
        elif known is not None and known == _key(ids):
            self._seen[table] = self.recipes[table]
        else:
            self._seen[table] = Recipe.of(ids, self._inputs)

    def end(self, kept: Sequence[tuple] = ()) -> None:
        """The forward returned. ``kept``: (table, ids) of its lookups that took the ids
        announced for them without ``observe`` (``lookup_batch``): each keeps the recipe
        that predicted them (or is learned from its ids), unless it was looked up twice."""
        if self._seen is not None:
            seen = self._seen
            for table, ids in kept:
                recipe = self.recipes.get(table)
                seen[table] = None if table in seen else recipe or Recipe.of(ids, self._inputs or [])
            self.recipes = {t: r for t, r in seen.items() if r is not None}
        self._inputs = self._seen = None

    def predict(self) -> list[tuple[object, torch.Tensor]]:
        if self._inputs is None:
            return []
        layouts = list(map(layout, self._inputs))
        cut = [(table, recipe.cut(self._inputs, layouts)) for table, recipe in self.recipes.items()]
        out = [(table, ids) for table, ids in cut if ids is not None]
        self._predicted = {table: _key(ids) for table, ids in out}
        return out

