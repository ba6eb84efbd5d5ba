"""Whole tables in and out of the servers: a job's parameters as plain arrays
(``PSClient.state_dict``), and values written back into them (``PSClient.load_state_dict``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from shardps.errors import InvalidArgument
from shardps.messages import ASSIGN
from shardps.shardmap import TableView
from shardps.tables import TableKind, check_ids
from shardps.worker.client import requests as rq
from shardps.worker.client.fanout import RETRYABLE
from shardps.worker.routing import Piece

if TYPE_CHECKING:
    from shardps.worker.client.data import DataPath


def export(data: "DataPath", tables: list[str], timeout: float | None) -> dict[str, np.ndarray]:
    """``tables`` as plain arrays: a dense table in its shape under its name; a sparse
    one as ``{name}.ids`` and ``{name}.rows`` (see ``pull_stored``)."""
    out = {}
    for name in tables:
        t = data.maps.table(name)
        if t.spec.kind is TableKind.DENSE:
            values = np.empty(t.spec.numel, np.float32)
            data.pull([Piece(0, name, True, 0, t.spec.numel)], [values], timeout)
            out[name] = values.reshape(t.spec.shape)
        else:
            out[f"{name}.ids"], out[f"{name}.rows"] = pull_stored(data, name, timeout)
    return out

def pull_stored(data: "DataPath", table: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Every stored row of a sparse table as (ids ascending, rows ``[n, dim]``); the
    whole export restarts if the map changes under it."""
    t = data.maps.table(table)
    deadline = data.deadline(timeout)
    while True:
        try:
            res = data.pull([Piece(0, table, False, all_stored=True)], [None],
                            max(0.001, deadline - time.monotonic()))
            break
        except RETRYABLE:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
            data.maps.refresh_map()
    ids, rows = res.values[0]
    order = np.argsort(ids)
    return ids[order], rows.reshape(-1, t.spec.dim)[order]



# rows of a sparse table per ASSIGN push of ``load_state_dict`` (a few MB at dim 16)
ASSIGN_ROWS = 1 << 16


class TableTransfer:
    """``PSClient``'s whole-table calls (a mixin): ``state_dict`` and ``load_state_dict``."""

    _data: "DataPath"

    if TYPE_CHECKING:
        def tables(self) -> list[TableView]: ...     # ManagerCalls's

    def state_dict(self, tables: Iterable[str] | None = None, timeout: float | None = None) -> dict:
        """The job's tables as plain arrays: dense tables in their shape; sparse tables as
        ``{name}.ids`` (int64, sorted) and ``{name}.rows`` (``[n, dim]``): every stored row."""
        names = list(tables) if tables is not None else [t.name for t in self.tables()]
        return export(self._data, names, timeout)

    def load_state_dict(self, state: Mapping[str, object], timeout: float | None = None) -> list[str]:
        """Write ``state`` (``state_dict``'s format) into the job's tables: a warm start. A
        dense table's values (its shape, or flat) replace the table's; a sparse table's rows
        ``{name}.ids`` / ``{name}.rows`` replace those rows (stored if absent; rows not named
        keep theirs). The rows written start their optimizer state afresh, as new rows do.
        The dense tables go in one push, a sparse table's rows (sorted by id) in pushes of
        ``ASSIGN_ROWS``; each push is deduplicated like any other (a retry is applied once). Returns the
        tables written. InvalidArgument, before anything is written, for an unknown table, a
        shape that does not match, repeated ids; and for a sparse table with a lifecycle
        policy (the servers refuse it: restore a checkpoint instead)."""
        if not isinstance(state, Mapping):
            raise InvalidArgument(f"load_state_dict takes a mapping of arrays, got {type(state).__name__}")
        known = {t.name: t for t in self.tables()}
        dense: list = []                    # every dense table's values: one push
        pushes: list[list] = []             # then each sparse table's rows, ASSIGN_ROWS a push
        written = []
        for name, key in _table_keys(state, known):
            t = known[name]
            if t.spec.kind is TableKind.DENSE:
                dense.append(rq.initial_values(t, state[key], "values"))
            else:
                ids = rq.as_ids(state[f"{name}.ids"], t)
                order = np.argsort(ids)
                ids = ids[order]            # ascending once: each chunk goes as it is (no coalescing)
                if bool(np.any(ids[1:] == ids[:-1])):
                    raise InvalidArgument(f"{name}.ids: repeated ids (each row is written once)")
                check_ids(t.spec, ids)
                rows = _rows_of(state[f"{name}.rows"], ids.shape[0], t)[order]
                for lo in range(0, ids.shape[0], ASSIGN_ROWS):
                    pushes.append([rq.rows_push(0, t, ids[lo:lo + ASSIGN_ROWS], rows[lo:lo + ASSIGN_ROWS])])
            written.append(name)
        if dense:
            pushes.insert(0, dense)
        for push in pushes:
            self._data.push(push, ASSIGN, timeout, None, False)
        return written


def _table_keys(state: Mapping[str, object], known: dict[str, TableView]) -> list[tuple[str, str]]:
    """(table, key) of every table ``state`` names; InvalidArgument naming the keys that name
    no table of the job (or a sparse table's ids without its rows)."""
    out, unknown = [], []
    for key in state:
        if not isinstance(key, str):
            unknown.append(repr(key))
        elif key in known:
            if known[key].spec.kind is not TableKind.DENSE:
                unknown.append(f"{key} (sparse: give {key}.ids and {key}.rows)")
            else:
                out.append((key, key))
        elif key.endswith(".ids") and _sparse(known.get(key[:-4])):
            if f"{key[:-4]}.rows" not in state:
                unknown.append(f"{key} (without {key[:-4]}.rows)")
            else:
                out.append((key[:-4], key))
        elif not (key.endswith(".rows") and _sparse(known.get(key[:-5])) and f"{key[:-5]}.ids" in state):
            unknown.append(key)         # .ids / .rows of a dense table too
    if unknown:
        raise InvalidArgument(f"load_state_dict: {', '.join(unknown)} name no table of this job "
                              f"(its tables: {', '.join(sorted(known)) or 'none'})")
    return out


def _sparse(t: TableView | None) -> bool:
    return t is not None and t.spec.kind is not TableKind.DENSE


def _rows_of(rows, n: int, t: TableView) -> np.ndarray:
    """``rows`` as float32 ``[n, dim]``; InvalidArgument naming the table otherwise."""
    arr = rq.as_float32(rows, t, "rows")
    if tuple(arr.shape) != (n, t.spec.dim):
        raise InvalidArgument(f"{t.name}.rows has shape {tuple(arr.shape)}; {n} ids of a table with dim "
                              f"{t.spec.dim} need ({n}, {t.spec.dim})")
    return arr
