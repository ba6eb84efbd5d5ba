"""The lookups a ``PSModel`` pull fetches rows for, every table's together.

At a pull (or the exchange a push sends) the model takes the distinct ids each embedding
announced for a coming lookup (``Wanted.take``), pulls them beside the dense values
(``requests``), and gives each embedding its rows (``arrived``, ``give_rows``): one object
where the model's pull, its exchange and its arrivals each had their own tuples.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from shardps.worker.embeddings import PSRows
from shardps.worker.row_cache import CachePlan, wanted_ids


class Wanted:
    """What a pull fetches for the lookups announced since the last one: ``items``, each
    (embedding, its announced distinct ids, its cache plan: None where it has no cache or
    does not use it), and the step whose values the pulled rows are (``refreshed``)."""

    __slots__ = ("items", "refreshed")

    def __init__(self, items: list[tuple[PSRows, np.ndarray, CachePlan | None]], refreshed: int):
        self.items, self.refreshed = items, refreshed

    @classmethod
    def take(cls, embeddings: Iterable[PSRows], use_step: int, refreshed: int, unfetched: bool = False) -> "Wanted":
        """The embeddings that announced ids since the last pull, their announcements
        cleared; ``unfetched``: only those whose rows for those ids have not arrived
        already. ``use_step``: the step whose lookups read the rows (the caches' plans)."""
        wanted = [(emb, emb.stage.wanted) for emb in embeddings if emb.stage.wanted is not None]
        for emb, _ in wanted:
            emb.stage.wanted = None
        return cls([(emb, ids, emb.cache_plan(ids, use_step)) for emb, ids in wanted
                    if not (unfetched and emb._has_rows_for(ids))], refreshed)

    def __len__(self) -> int:
        return len(self.items)

    def requests(self) -> list[tuple]:
        """The pull requests ``(table, ids)``: each embedding's ids, or its cache's misses."""
        return [(emb.table, wanted_ids(ids, plan)) for emb, ids, plan in self.items]

    def arrived(self, pulled: list[np.ndarray]) -> list[tuple]:
        """(embedding, distinct ids, rows) of each, from the rows ``pulled`` for
        ``requests`` (a cache's plan completed with its misses, which refresh it)."""
        return [(emb, ids, emb.complete(plan, rows, self.refreshed))
                for (emb, ids, plan), rows in zip(self.items, pulled)]


def give_rows(arrived: list[tuple]) -> None:
    """Each embedding of ``arrived`` ((embedding, ids, rows)) holds its rows for its lookup."""
    for emb, ids, rows in arrived:
        emb.stage.fetched = (ids, rows)
