"""The lookups a ``PSModel`` pull fetches rows for, every table's together.

At a pull (or the exchange a push sends) the model takes the distinct ids each embedding
announced for a coming lookup (``Wanted.take``), pulls them beside the dense values
(``requests``), and gives each embedding its rows (``arrived``). Every step's tables are
handled by C-level passes (``map``, ``compress``) over parallel lists, with Python per table
only where an embedding has a row cache (its plan and its completion are its own).
"""

from __future__ import annotations

import itertools
import operator
from itertools import repeat
from typing import Iterable

import numpy as np

from shardps.worker.embeddings import PSRows, set_each
from shardps.worker.row_cache import CachePlan, wanted_ids

_STAGE, _CACHE = operator.attrgetter("stage"), operator.attrgetter("cache")
_ANNOUNCED, _FETCHED = operator.attrgetter("stage.wanted"), operator.attrgetter("stage.fetched")
_TABLE = operator.attrgetter("table")


def _any_given(values: Iterable) -> bool:
    """Whether any of ``values`` is not None."""
    return any(map(operator.is_not, values, repeat(None)))


class Wanted:
    """The embeddings (``embeddings``) whose announced distinct ids (``ids``) a pull
    fetches, their cache plans (``plans``: None where an embedding has no cache, or does
    not use it) and the step whose values the pulled rows are (``refreshed``)."""

    __slots__ = ("embeddings", "ids", "plans", "refreshed")

    def __init__(self, embeddings: list[PSRows], ids: list[np.ndarray], plans: list[CachePlan | None],
                 refreshed: int):
        self.embeddings, self.ids, self.plans, self.refreshed = embeddings, ids, plans, refreshed

    @classmethod
    def take(cls, embeddings: Iterable[PSRows], use_step: int, refreshed: int, unfetched: bool = False) -> "Wanted":
        """The embeddings that announced ids since the last pull, their announcements
        cleared; ``unfetched``: only those whose rows for those ids have not arrived
        already. ``use_step``: the step whose lookups read the rows (the caches' plans)."""
        embs = list(embeddings)
        announced = list(map(_ANNOUNCED, embs))
        if not _any_given(announced):
            return cls([], [], [], refreshed)                      # none announced
        some = list(map(operator.is_not, announced, repeat(None)))
        embs, ids = list(itertools.compress(embs, some)), list(itertools.compress(announced, some))
        set_each(map(_STAGE, embs), "wanted", repeat(None))
        if unfetched and _any_given(map(_FETCHED, embs)):      # some have rows waiting
            keep = list(map(operator.not_, map(PSRows._has_rows_for, embs, ids)))
            embs, ids = list(itertools.compress(embs, keep)), list(itertools.compress(ids, keep))
        if _any_given(map(_CACHE, embs)):
            plans = list(map(PSRows.cache_plan, embs, ids, repeat(use_step)))
        else:
            plans = [None] * len(embs)
        return cls(embs, ids, plans, refreshed)

    def __len__(self) -> int:
        return len(self.embeddings)

    def requests(self) -> list[tuple]:
        """The pull requests ``(table, ids)``: each embedding's ids, or its cache's misses."""
        tables = map(_TABLE, self.embeddings)
        if not _any_given(self.plans):
            return list(zip(tables, self.ids))
        return list(zip(tables, map(wanted_ids, self.ids, self.plans)))

    def arrived(self, pulled: list[np.ndarray]) -> list[tuple]:
        """(embedding, distinct ids, rows) of each, from the rows ``pulled`` for
        ``requests`` (a cache's plan completed with its misses, which refresh it)."""
        rows = pulled
        if _any_given(self.plans):
            rows = list(map(PSRows.complete, self.embeddings, self.plans, pulled, repeat(self.refreshed)))
        return list(zip(self.embeddings, self.ids, rows))


def unannounced(lookups: list[tuple]) -> list[tuple]:
    """The (embedding, ids) of ``lookups`` whose embedding has neither announced ids nor
    rows waiting for its lookup."""
    embs = list(map(operator.itemgetter(0), lookups))
    free = map(operator.and_, map(operator.is_, map(_ANNOUNCED, embs), repeat(None)),
               map(operator.is_, map(_FETCHED, embs), repeat(None)))
    return list(itertools.compress(lookups, free))


def give_rows(arrived: list[tuple]) -> None:
    """Each embedding of ``arrived`` ((embedding, ids, rows)) holds its rows for its lookup."""
    set_each(map(_STAGE, map(operator.itemgetter(0), arrived)), "fetched",
             zip(map(operator.itemgetter(1), arrived), map(operator.itemgetter(2), arrived)))
