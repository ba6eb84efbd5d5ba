"""The data rules of the client API, stated and checked once: callers' arguments in, routing
``Piece`` objects and output arrays out. Pure (numpy and the table's view).

* Dense ranges are flat and half-open: ``0 <= start < stop <= numel``.
* Sparse ids are int64, any order, repeats allowed. Pulls send each distinct id once (and
  spread the rows back); pushes sum the rows of repeated ids before sending.
* Values are float32 (anything ``np.asarray`` or a torch tensor converts); gradient rows are
  ``[len(ids), dim]``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from shardps import kernels
from shardps.errors import InvalidArgument
from shardps.shardmap import TableView
from shardps.tables import TableKind, coalesce
from shardps.worker.routing import Piece

Finish = Callable[[np.ndarray], np.ndarray]       # pulled values -> what the caller gets


def as_float32(values) -> np.ndarray:
    if hasattr(values, "detach"):            # a torch tensor: no torch import needed here
        values = values.detach().cpu().numpy()
    return np.ascontiguousarray(values, dtype=np.float32)


def distinct(ids: np.ndarray) -> tuple[np.ndarray, Finish]:
    """(each distinct id once, ascending; a function taking their rows to the rows of
    ``ids``). Ids already distinct and ascending (e.g. from ``torch.unique``) are neither
    sorted again nor gathered afterwards."""
    if ids.shape[0] <= 1 or bool(np.all(ids[1:] > ids[:-1])):
        return ids, lambda rows: rows
    unique, inverse = kernels.unique_inverse(ids)
    return unique, lambda rows: rows[inverse]


def as_ids(ids, t: TableView) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"ids for table {t.name!r} must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def check_dense(t: TableView, start: int, stop: int) -> None:
    if t.spec.kind is not TableKind.DENSE:
        raise InvalidArgument(f"table {t.name!r} is sparse: use pull_rows / push_rows")
    if not (0 <= start < stop <= t.spec.numel):
        raise InvalidArgument(f"range [{start}, {stop}) of table {t.name!r}: must satisfy "
                              f"0 <= start < stop <= {t.spec.numel}")


# ====================================================================== pulls
def dense_pull(item: int, t: TableView, start: int, stop: int | None, whole: bool
               ) -> tuple[Piece, np.ndarray, Finish]:
    """A pull of the flat range [start, stop) (``stop`` None: to the end); ``whole``: the
    result takes the table's shape."""
    stop = t.spec.numel if stop is None else stop
    check_dense(t, start, stop)
    shape = t.spec.shape if whole else None
    return (Piece(item, t.name, True, start, stop), np.empty(stop - start, np.float32),
            lambda v: v.reshape(shape) if shape else v)


def rows_pull(item: int, t: TableView, ids) -> tuple[Piece, np.ndarray, Finish]:
    unique, spread = distinct(as_ids(ids, t))
    piece = Piece(item, t.name, False, ids=unique, positions=np.arange(unique.shape[0]))
    return piece, np.empty((unique.shape[0], t.spec.dim), np.float32), spread


def many_pull(item: int, t: TableView, request: tuple) -> tuple[Piece, np.ndarray, Finish]:
    """One request of ``pull_many``: ``(table,)``, ``(table, start, stop)`` or ``(table, ids)``."""
    if t.spec.kind is TableKind.DENSE:
        if len(request) == 3:
            return dense_pull(item, t, request[1], request[2], whole=False)
        return dense_pull(item, t, 0, None, whole=len(request) == 1)
    return rows_pull(item, t, request[1])


# ====================================================================== pushes
def dense_push(item: int, t: TableView, grad, start: int = 0) -> Piece:
    """A gradient (any shape, taken flat) for the range starting at ``start``."""
    values = as_float32(grad).reshape(-1)
    check_dense(t, start, start + values.shape[0])
    return Piece(item, t.name, True, start, start + values.shape[0], values=values)


def rows_push(item: int, t: TableView, ids, grads, allow_empty: bool = False) -> Piece:
    """Gradient rows for ``ids``, repeated ids summed. ``allow_empty``: no ids with grads of
    any shape (``push_rows`` accepts that)."""
    ids = as_ids(ids, t)
    if allow_empty and not ids.shape[0]:
        grads = np.empty((0, t.spec.dim), np.float32)
    else:
        grads = as_float32(grads).reshape(ids.shape[0], t.spec.dim)
    ids, grads = coalesce(ids, grads)
    return Piece(item, t.name, False, ids=ids, positions=np.arange(ids.shape[0]), values=grads)


def many_push(item: int, t: TableView, request: tuple) -> Piece:
    """One request of ``push_many``: ``(table, grad)``, ``(table, grad, start)`` (dense) or
    ``(table, ids, grads)`` (sparse)."""
    if t.spec.kind is TableKind.DENSE:
        return dense_push(item, t, request[1], request[2] if len(request) > 2 else 0)
    return rows_push(item, t, request[1], request[2])


def initial_values(t: TableView, values) -> Piece:
    """The whole table's initial values (ASSIGNED tables)."""
    flat = as_float32(values).reshape(-1)
    if flat.shape[0] != t.spec.numel:
        raise InvalidArgument(f"initial values of {t.name!r} have {flat.shape[0]} elements; "
                              f"the table has {t.spec.numel}")
    return Piece(0, t.name, True, 0, flat.shape[0], values=flat)
