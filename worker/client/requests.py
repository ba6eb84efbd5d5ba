"""The data rules of the client API, stated and checked once: callers' arguments in, routing
``Piece`` objects and output arrays out. Pure (numpy and the table's view).

* Dense ranges are flat and half-open: ``0 <= start < stop <= numel``.
* A whole dense table's gradient (or initial values) has the table's shape, or is flat with
  its ``numel`` elements; a sub-range's gradient (``start=`` given) is flat, or whole rows of
  the table (``[k, *shape[1:]]``) starting at a row boundary. Anything else (a half-size
  gradient, a transposed one) is refused: a push never lands on rows by accident.
* Sparse ids are integers, any order, repeats allowed. Pulls send each distinct id once (and
  spread the rows back); pushes sum the rows of repeated ids before sending. Gradient rows
  are ``[len(ids), dim]`` (or ``ids.shape + (dim,)``).
* Values are float32 arrays (numpy or torch): another dtype is refused, never cast, so a
  float64 or integer gradient is a clear error instead of a silent conversion. Plain Python
  lists and numbers are taken as float32.
* Values hold no NaN or infinity unless the table's config sets ``allow_non_finite``; ids of
  a bounded table lie in ``[0, num_rows)``. Both are checked here, for the whole call, in one
  compiled pass each, before anything is sent: a call spread over several servers is refused
  whole, never applied by some of them (each server checks its own part again).
* Every refusal is ``InvalidArgument`` naming the table, what was expected and what was given
  (a bad value by its place in the caller's arrays).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Callable, NamedTuple

import numpy as np

from shardps import kernels
from shardps.errors import InvalidArgument, non_finite
from shardps.shardmap import TableView
from shardps.tables import MAX_CLOCK, Initializer, TableKind, TableSpec, dense_table, sparse_table
from shardps.worker.client import request_kernels
from shardps.worker.routing import Outputs, Piece

Finish = Callable[[np.ndarray], np.ndarray]       # pulled values -> what the caller gets


_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)
_SPARSE = TableKind.SPARSE
_FIRST = operator.itemgetter(0)


def _dtype_name(values) -> str | None:
    """The dtype of a numpy array or torch tensor as numpy names it (None: no dtype)."""
    dtype = getattr(values, "dtype", None)
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def as_float32(values, t: TableView, what: str = "gradient") -> np.ndarray:
    """``values`` as a C-contiguous float32 numpy array, without converting another dtype:
    InvalidArgument naming the table when it is not float32 (or not numbers at all)."""
    if type(values) is np.ndarray and values.dtype == _F32 and values.flags.c_contiguous:
        return values                         # the common case, checked in a few nanoseconds
    name = _dtype_name(values)
    if name is not None and name != "float32":
        raise InvalidArgument(f"{what} for table {t.name!r} has dtype {name}; the table holds "
                              f"float32: convert it first (.astype(np.float32) / .float())")
    if hasattr(values, "detach"):            # a torch tensor: no torch import needed here
        values = values.detach().cpu().numpy()
    try:
        return np.ascontiguousarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} for table {t.name!r} is not an array of numbers "
                              f"({type(values).__name__}: {exc})") from None


def check_finite(t: TableView, values: np.ndarray, where: Callable[[int], str]) -> None:
    """InvalidArgument naming the first NaN or infinity of ``values`` by ``where(flat index)``
    unless table ``t`` allows them (one compiled pass)."""
    if t.config.allow_non_finite:
        return
    bad = kernels.first_non_finite(values)
    if bad >= 0:
        raise non_finite(t.name, values.reshape(-1)[bad], where(bad))


def _element(i: int, shape: tuple, what: str, start: int = 0) -> str:
    """Flat element ``i`` of an array of ``shape`` (``what``), with its index in that shape
    and, for a sub-range beginning at ``start``, its element of the table."""
    place = f"element {i} of the {what}"
    if len(shape) > 1:
        place += f" (index {tuple(int(x) for x in np.unravel_index(i, shape))})"
    if start:
        place += f" (element {start + i} of the table)"
    return place


def distinct(ids: np.ndarray) -> tuple[np.ndarray, Finish | None]:
    """(each distinct id once, in order of first appearance; a function taking their rows
    to the rows of ``ids``, None when they are the rows of ``ids``). Ids already distinct,
    in any order, are neither copied nor gathered afterwards; none are sorted (servers take
    ids in any order)."""
    if kernels.distinct(ids):
        return ids, None
    unique, inverse = kernels.first_unique(ids)
    return unique, lambda rows: rows[inverse]


def as_ids(ids, t: TableView) -> np.ndarray:
    """``ids`` flattened to int64; InvalidArgument naming the table unless they are integers."""
    if t.spec.kind is not TableKind.SPARSE:
        raise InvalidArgument(f"table {t.name!r} is dense: use pull_dense / push_dense")
    if type(ids) is np.ndarray and ids.dtype == _I64 and ids.ndim == 1 and ids.flags.c_contiguous:
        flat = ids                            # the common case: already flat int64
    else:
        flat = _flat_ids(ids, t)
    bad = kernels.first_outside(flat, t.spec.num_rows)
    if bad >= 0:
        raise _outside(t, flat, bad)
    return flat


def _outside(t: TableView, ids: np.ndarray, bad: int) -> InvalidArgument:
    return InvalidArgument(f"row id {int(ids[bad])} (position {bad} of the ids) of table {t.name!r} "
                           f"is out of bounds: ids must lie in [0, {t.spec.num_rows})")


def _flat_ids(ids, t: TableView) -> np.ndarray:
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"ids for table {t.name!r} are not an array ({exc})") from None
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63):
        raise InvalidArgument(f"ids for table {t.name!r} must be int64 values, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)


def as_index(value, what: str, t: TableView) -> int:
    """An integer argument (a range bound): InvalidArgument naming it unless it is one."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{what} for table {t.name!r} must be an integer, got {value!r}")
    return int(value)


def check_dense(t: TableView, start: int, stop: int) -> None:
    """The flat range [start, stop) (integers: ``as_index``) of dense table ``t``."""
    if t.spec.kind is not TableKind.DENSE:
        raise InvalidArgument(f"table {t.name!r} is sparse: use pull_rows / push_rows")
    if not (0 <= start < stop <= t.spec.numel):
        raise InvalidArgument(f"range [{start}, {stop}) of table {t.name!r}: must satisfy "
                              f"0 <= start < stop <= {t.spec.numel}")


def check_call(timeout, clock) -> None:
    """A data call's ``timeout`` (None or seconds > 0) and ``clock`` (None or steps >= 0)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidArgument(f"timeout={timeout!r}: must be a finite number of seconds > 0 (or None)")
    if clock is not None and (isinstance(clock, bool) or not isinstance(clock, (int, np.integer))
                              or not 0 <= clock < MAX_CLOCK):
        raise InvalidArgument(f"clock={clock!r}: must be an integer in [0, {MAX_CLOCK}), this worker's "
                              f"completed steps (or None)")


def _integer(value, what: str, name) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"table {name!r}: {what}={value!r} must be an integer")
    if not -(1 << 63) <= int(value) < 1 << 63:
        raise InvalidArgument(f"table {name!r}: {what}={value} does not fit an int64")
    return int(value)


def _table_arguments(name, init) -> None:
    if not isinstance(name, str):
        raise InvalidArgument(f"table name {name!r}: must be a string")
    if init is not None and not isinstance(init, Initializer):
        raise InvalidArgument(f"table {name!r}: init={init!r} must be an Initializer (zeros(), "
                              f"uniform(a, b), normal(mean, std), ...)")


def dense_spec(name: str, shape, init: Initializer | None, block_size: int) -> TableSpec:
    """``create_dense``'s arguments as a spec; InvalidArgument naming a mistyped one (the
    spec's own rules are checked by ``TableSpec.validate``)."""
    _table_arguments(name, init)
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise InvalidArgument(f"dense table {name!r}: shape={shape!r} must be an integer or a tuple of them")
    return dense_table(name, tuple(_integer(d, "shape", name) for d in shape), init,
                       _integer(block_size, "block_size", name))


def sparse_spec(name: str, dim: int, num_rows: int, init: Initializer | None, num_blocks: int) -> TableSpec:
    """``create_sparse``'s arguments as a spec (as ``dense_spec``)."""
    _table_arguments(name, init)
    return sparse_table(name, _integer(dim, "dim", name), _integer(num_rows, "num_rows", name), init,
                        _integer(num_blocks, "num_blocks", name))


def request_list(requests, what: str) -> list:
    """The requests of ``pull_many`` / ``push_many`` / an exchange: a sequence of non-empty
    tuples (or lists) whose first item is a table name; InvalidArgument otherwise."""
    if not isinstance(requests, (list, tuple)):
        raise InvalidArgument(f"{what} requests must be a list of tuples, got {type(requests).__name__}")
    # checked in C (``map``), the offending request found only when there is one
    if not (all(map(isinstance, requests, itertools.repeat((list, tuple)))) and all(requests)
            and all(map(isinstance, map(_FIRST, requests), itertools.repeat(str)))):
        bad = next(r for r in requests if not isinstance(r, (list, tuple)) or not r or not isinstance(r[0], str))
        raise InvalidArgument(f"{what} request {bad!r}: expected a tuple whose first item is a table name")
    return list(requests)


# ====================================================================== a call's requests
class PullCall(NamedTuple):
    """A pull's pieces, the outputs they fill (``routing.Outputs``) and each item's finish
    (None: its output is the result as it is)."""

    pieces: list[Piece]
    outputs: Outputs
    finishes: list[Finish | None]

    @classmethod
    def of(cls, parts: list[tuple[Piece, np.ndarray, Finish | None]], flat: np.ndarray | None = None,
           starts: list[int] | None = None) -> "PullCall":
        """The call of ``parts`` ((piece, output, finish) per item)."""
        pieces, outputs, finishes = map(list, zip(*parts)) if parts else ([], [], [])
        return cls(pieces, Outputs(outputs, flat, starts), finishes)


def pull_pieces(tables: list[TableView], requests: list) -> PullCall:
    """``many_pull`` of each of a call's requests (``tables[i]``: request i's table). When
    every sparse request's ids are a flat int64 array (what ``PSModel`` sends), the sparse
    requests are checked and laid out together: their ids' bounds and distinctness in one
    compiled pass (``_SparseItems``), the rows of their distinct ids into views of one array
    (``routing.Outputs``), which one compiled call per server fills from its reply."""
    sparse = _SparseItems.of(tables, requests, 2)
    if sparse is None:
        return PullCall.of([many_pull(i, t, r) for i, (t, r) in enumerate(zip(tables, requests))])
    distinct = sparse.checked_ids()
    parts, flat, starts = sparse.pull_parts(distinct)
    for k in itertools.compress(range(len(parts)), map(operator.not_, distinct)):     # ids repeated: spread back
        parts[k] = rows_pull(sparse.items[k], sparse.tables[k], sparse.ids[k])
    in_call = starts
    if len(starts) < len(tables):
        in_call = [-1] * len(tables)
        for i, start in zip(sparse.items, starts):
            in_call[i] = start
    return PullCall.of(sparse.merged(parts, many_pull), flat, in_call)


def push_pieces(tables: list[TableView], requests: list) -> list[Piece]:
    """``many_push`` of each of a call's requests, as ``pull_pieces``: when every sparse
    request's ids are a flat int64 array and its rows a float32 ``[len(ids), dim]`` array,
    the sparse requests are checked together (the ids' bounds and distinctness in one
    compiled pass, the rows' finiteness in one compiled call each)."""
    sparse = _SparseItems.of(tables, requests, 3)
    rows = None if sparse is None else sparse.plain_rows()
    if sparse is None or rows is None:
        return [many_push(i, t, r) for i, (t, r) in enumerate(zip(tables, requests))]
    distinct = sparse.checked_ids()
    bad = next((k for k, g in enumerate(rows) if kernels.first_non_finite(g) >= 0), -1)     # one compiled pass each
    if bad >= 0:
        for i, t, x, g in zip(sparse.items[bad:], sparse.tables[bad:], sparse.ids[bad:], rows[bad:]):
            rows_push(i, t, x, g)             # refuses the first NaN/Inf row its table does not allow
    pieces = [Piece(i, t.name, False, ids=x, values=g)
              for i, t, x, g in zip(sparse.items, sparse.tables, sparse.ids, rows)]
    for k in itertools.compress(range(len(pieces)), map(operator.not_, distinct)):    # ids repeated: summed
        pieces[k] = rows_push(sparse.items[k], sparse.tables[k], sparse.ids[k], rows[k])
    return sparse.merged(pieces, many_push)


def _plain_ids(ids) -> bool:
    return type(ids) is np.ndarray and ids.dtype == _I64 and ids.ndim == 1 and ids.flags.c_contiguous


class _SparseItems:
    """A call's sparse requests when each one's ids are a flat int64 array (``of``):
    ``items`` (their places in the call), ``tables``, ``ids`` and ``requests``, checked as
    one batch and merged back among the call's other requests (``merged``)."""

    __slots__ = ("call", "requests_in_call", "items", "tables", "requests", "ids")

    def __init__(self, tables: list[TableView], requests: list, items: list[int]):
        self.call, self.requests_in_call, self.items = tables, requests, items
        self.tables = tables if len(items) == len(tables) else [tables[i] for i in items]
        self.requests = requests if len(items) == len(requests) else [requests[i] for i in items]
        self.ids: list[np.ndarray] = []

    @classmethod
    def of(cls, tables: list[TableView], requests: list, size: int) -> "_SparseItems | None":
        """The sparse requests of a call whose requests of sparse tables all have ``size``
        items and flat int64 ids (None: some request does not)."""
        found = cls(tables, requests, [i for i, t in enumerate(tables) if t.spec.kind is _SPARSE])
        if not all(len(r) == size and _plain_ids(r[1]) for r in found.requests):
            return None
        found.ids = [r[1] for r in found.requests]
        return found

    def plain_rows(self) -> list[np.ndarray] | None:
        """The pushes' gradient rows when each is a C-contiguous float32 ``[len(ids), dim]``
        array (else None)."""
        rows = [r[2] for r in self.requests]
        if all(type(g) is np.ndarray and g.dtype == _F32 and g.flags.c_contiguous
               and g.shape == (x.shape[0], t.spec.dim) for g, x, t in zip(rows, self.ids, self.tables)):
            return rows
        return None

    def pull_parts(self, distinct: list[bool]) -> tuple[list[tuple[Piece, np.ndarray, Finish | None]], np.ndarray,
                                                     list[int]]:
        """Each pull's (piece, an output for its rows, None): its ids sent as they are; the
        outputs of those whose ids are ``distinct`` are views of one float32 array (the
        others' are made by ``rows_pull``). Returns the parts, that array and where each
        one's output begins in it (-1: elsewhere)."""
        shapes = [(x.shape[0] if d else 0, t.spec.dim) for x, t, d in zip(self.ids, self.tables, distinct)]
        flat = np.empty(sum(n * dim for n, dim in shapes), np.float32)
        parts: list[tuple[Piece, np.ndarray, Finish | None]] = []
        starts, at = [], 0
        for i, t, x, (n, dim), d in zip(self.items, self.tables, self.ids, shapes, distinct):
            parts.append((Piece(i, t.name, False, ids=x), flat[at:at + n * dim].reshape(n, dim), None))
            starts.append(at if d else -1)
            at += n * dim
        return parts, flat, starts

    def checked_ids(self) -> list[bool]:
        """Whether each request's ids are distinct; InvalidArgument (``as_ids``') for the
        first id outside its table's bounds."""
        if not self.ids:
            return []
        bad, at, distinct = request_kernels.check_ids(self.ids, [t.spec.num_rows for t in self.tables])
        if bad >= 0:
            raise _outside(self.tables[bad], self.ids[bad], at)
        return distinct.tolist()

    def merged(self, parts: list, each: Callable) -> list:
        """The call's parts in request order: ``parts`` (of these requests) and ``each(i, table,
        request)`` of the call's other requests."""
        if len(parts) == len(self.call):
            return parts
        done = dict(zip(self.items, parts))
        return [done[i] if i in done else each(i, t, r)
                for i, (t, r) in enumerate(zip(self.call, self.requests_in_call))]


def finished(finishes: list, values: list) -> list:
    """A pull's ``values`` (a list) with each item's finish applied (``PullCall``: None where
    the value is the result as it is)."""
    values = list(values)
    for k in itertools.compress(range(len(finishes)), finishes):
        values[k] = finishes[k](values[k])
    return values


# ====================================================================== pulls
def dense_pull(item: int, t: TableView, start: int, stop: int | None, whole: bool | None
               ) -> tuple[Piece, np.ndarray, Finish]:
    """A pull of the flat range [start, stop) (``stop`` None: to the end); ``whole``: the
    result takes the table's shape (None: when the range is the whole table, start 0 and
    no stop)."""
    start = as_index(start, "start", t)
    if whole is None:
        whole = start == 0 and stop is None
    stop = t.spec.numel if stop is None else as_index(stop, "stop", t)
    check_dense(t, start, stop)
    shape = t.spec.shape if whole else None
    return (Piece(item, t.name, True, start, stop), np.empty(stop - start, np.float32),
            lambda v: v.reshape(shape) if shape else v)


def rows_pull(item: int, t: TableView, ids) -> tuple[Piece, np.ndarray, Finish | None]:
    unique, spread = distinct(as_ids(ids, t))
    piece = Piece(item, t.name, False, ids=unique)
    return piece, np.empty((unique.shape[0], t.spec.dim), np.float32), spread


def many_pull(item: int, t: TableView, request: tuple) -> tuple[Piece, np.ndarray, Finish | None]:
    """One request of ``pull_many``: ``(table,)``, ``(table, start, stop)`` or ``(table, ids)``."""
    if not isinstance(request, (tuple, list)):
        raise InvalidArgument(f"pull request {request!r}: expected (table,), (table, start, stop) "
                              f"or (table, ids)")
    if t.spec.kind is TableKind.DENSE:
        if len(request) == 3:
            return dense_pull(item, t, request[1], request[2], whole=False)
        if len(request) != 1:
            raise InvalidArgument(f"pull request for dense table {t.name!r} has {len(request)} items: "
                                  f"expected (table,) or (table, start, stop)")
        return dense_pull(item, t, 0, None, whole=True)
    if len(request) != 2:
        raise InvalidArgument(f"pull request for sparse table {t.name!r} has {len(request)} items: "
                              f"expected (table, ids)")
    return rows_pull(item, t, request[1])


# ====================================================================== pushes
def dense_push(item: int, t: TableView, grad, start: int | None = None) -> Piece:
    """A gradient for the whole table (``start`` None: the table's shape, or flat with its
    ``numel`` elements) or for the flat range beginning at ``start`` (flat, or whole rows of
    the table beginning at a row boundary). Anything else is InvalidArgument."""
    if t.spec.kind is not TableKind.DENSE:
        raise InvalidArgument(f"table {t.name!r} is sparse: use pull_rows / push_rows")
    values = as_float32(grad, t)
    shape, given = t.spec.shape, values.shape
    if start is None:                       # the whole table, in its shape or flat
        if given != shape and given != (t.spec.numel,):
            raise InvalidArgument(
                f"gradient for dense table {t.name!r} has shape {given}; the table's shape is "
                f"{shape}: push the whole table's gradient in its shape (or flat with "
                f"{t.spec.numel} elements), or a sub-range with start=")
        start = 0
    else:
        start = as_index(start, "start", t)
        row = shape[1:]
        row_numel = int(np.prod(row, dtype=np.int64)) if row else 1
        if len(given) > 1 and (given[1:] != row or start % row_numel):
            raise InvalidArgument(
                f"gradient of shape {given} for dense table {t.name!r} (shape {shape}) at "
                f"start={start}: a sub-range's gradient is flat, or whole rows of shape {row} "
                f"beginning at a row boundary (a multiple of {row_numel})")
    flat = values.reshape(-1)
    check_dense(t, start, start + flat.shape[0])
    check_finite(t, flat, lambda i: _element(i, given, "gradient", start))
    return Piece(item, t.name, True, start, start + flat.shape[0], values=flat)


def rows_push(item: int, t: TableView, ids, grads, allow_empty: bool = False) -> Piece:
    """Gradient rows for ``ids``, repeated ids summed: ``[len(ids), dim]`` (or
    ``ids.shape + (dim,)`` for a batch of ids). ``allow_empty``: no ids with grads of any
    shape (``push_rows`` accepts that)."""
    given_ids = ids
    ids = as_ids(ids, t)
    if allow_empty and not ids.shape[0]:
        grads = np.empty((0, t.spec.dim), np.float32)
    else:
        grads = as_float32(grads, t)
        n, dim = ids.shape[0], t.spec.dim
        ids_shape = tuple(np.shape(given_ids)) if not hasattr(given_ids, "detach") else tuple(given_ids.shape)
        if grads.shape not in ((n, dim), ids_shape + (dim,)):
            raise InvalidArgument(
                f"gradient rows for sparse table {t.name!r} have shape {tuple(grads.shape)}; "
                f"{n} ids of a table with dim {dim} need ({n}, {dim})")
        grads = grads.reshape(n, dim)
        check_finite(t, grads, lambda i: f"row {i // dim} (id {int(ids[i // dim])}), column {i % dim} of "
                                         f"the gradient rows")
    ids, grads = kernels.coalesce(ids, grads, keep_order=True)
    return Piece(item, t.name, False, ids=ids, values=grads)


def many_push(item: int, t: TableView, request: tuple) -> Piece:
    """One request of ``push_many``: ``(table, grad)``, ``(table, grad, start)`` (dense) or
    ``(table, ids, grads)`` (sparse)."""
    if not isinstance(request, (tuple, list)):
        raise InvalidArgument(f"push request {request!r}: expected (table, grad), (table, grad, "
                              f"start) or (table, ids, grads)")
    if t.spec.kind is TableKind.DENSE:
        if len(request) not in (2, 3):
            raise InvalidArgument(f"push request for dense table {t.name!r} has {len(request)} "
                                  f"items: expected (table, grad) or (table, grad, start)")
        return dense_push(item, t, request[1], request[2] if len(request) > 2 else None)
    if len(request) != 3:
        raise InvalidArgument(f"push request for sparse table {t.name!r} has {len(request)} items: "
                              f"expected (table, ids, grads)")
    return rows_push(item, t, request[1], request[2])


def initial_values(t: TableView, values, what: str = "initial values") -> Piece:
    """The whole table's values (initial ones of ASSIGNED tables, or assigned ones): the
    table's shape, or flat."""
    if t.spec.kind is not TableKind.DENSE:
        raise InvalidArgument(f"table {t.name!r} is sparse: {what} of a whole table are for dense tables")
    arr = as_float32(values, t, what)
    if tuple(arr.shape) not in (tuple(t.spec.shape), (t.spec.numel,)):
        raise InvalidArgument(f"{what} of {t.name!r} have shape {tuple(arr.shape)}; "
                              f"the table's shape is {tuple(t.spec.shape)}")
    flat = arr.reshape(-1)
    check_finite(t, flat, lambda i: _element(i, tuple(arr.shape), what))
    return Piece(0, t.name, True, 0, flat.shape[0], values=flat)
