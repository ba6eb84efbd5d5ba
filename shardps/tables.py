"""Tables: the immutable spec, the mutable config, and the block layout they imply.

A job owns named tables. A DENSE table is an N-d float32 tensor, flattened (row-major) and cut
into blocks of ``block_size`` elements; block ``b`` holds the half-open range
``[b * block_size, min((b + 1) * block_size, numel))``. A SPARSE table is an embedding table of
``dim``-wide rows keyed by int64 ids; row ``id`` lives in block
``splitmix64(id) % num_blocks`` (``shardps.id_blocks``), with ``num_blocks`` fixed at creation (by default one block per
4 MiB of the table's float32 values, from 1 to 64: ``default_sparse_blocks``). The block is the
unit of placement, replication, migration and checkpoints.

This module is pure (numpy only) and shared by the client, the servers and the manager.
Validation raises ``InvalidArgument`` naming the bad value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from shardps.budget import MAX_ADMIT_AFTER, LifecyclePolicy  # noqa: F401 (part of this module's vocabulary)
from shardps.errors import InvalidArgument, ResourceExhausted

DEFAULT_BLOCK_SIZE = 1 << 16      # dense elements per block: 256 KiB of float32
DEFAULT_SPARSE_BLOCKS, SPARSE_BLOCK_BYTES = 64, 4 << 20    # see default_sparse_blocks
MAX_BLOCKS_PER_TABLE = 1 << 16
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")
_JOB_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class TableKind(Enum):
    DENSE = 1
    SPARSE = 2


class OptimizerKind(Enum):
    SGD = 1
    ADAGRAD = 2
    ADAM = 3


class InitKind(Enum):
    ZEROS = 1
    CONSTANT = 2
    UNIFORM = 3
    NORMAL = 4
    ASSIGNED = 5   # written once by an INITIALIZE push (first writer wins)


class Consistency(Enum):
    """Consistency model of a worker group: ASYNC (ASP), SYNC (BSP) or SSP (bounded
    staleness T; BOUNDED in the proto enum, and the member's name here, ``Consistency.SSP``
    being the same member).

    ``str()`` gives ``"async"``, ``"sync"`` or ``"ssp"``, the names ``create_job`` and the
    CLI take. ``Consistency.parse(text)`` accepts those, ``asp``, ``bsp`` and ``bounded``, in
    any case, and raises ``InvalidArgument`` naming anything else; ``Consistency(text)``
    accepts the same (and raises ValueError, as every Enum)."""

    ASYNC = 1
    SYNC = 2
    BOUNDED = 3
    SSP = 3          # an alias: Consistency.SSP is Consistency.BOUNDED

    def __str__(self) -> str:
        return _MODE_NAMES[self]

    @classmethod
    def parse(cls, text: str | Consistency) -> Consistency:
        """A mode from its name (see the class); a ``Consistency`` is returned as it is."""
        if isinstance(text, Consistency):
            return text
        mode = _MODES.get(str(text).lower())
        if mode is None:
            raise InvalidArgument(f"consistency {text!r}: use async, sync or ssp")
        return mode

    @classmethod
    def _missing_(cls, value: object) -> Consistency | None:
        return _MODES.get(value.lower()) if isinstance(value, str) else None


_MODES = {"async": Consistency.ASYNC, "asp": Consistency.ASYNC, "sync": Consistency.SYNC,
          "bsp": Consistency.SYNC, "ssp": Consistency.BOUNDED, "bounded": Consistency.BOUNDED}
_MODE_NAMES = {Consistency.ASYNC: "async", Consistency.SYNC: "sync", Consistency.BOUNDED: "ssp"}


@dataclass(frozen=True)
class OptimizerConfig:
    """Server-side optimizer with ``torch.optim`` semantics (see ``shardps.server.optimizers``).

    Defaults follow torch: Adam betas (0.9, 0.999) and eps 1e-8; Adagrad eps 1e-10.
    """

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float | None = None
    initial_accumulator_value: float = 0.0
    lr_decay: float = 0.0

    @property
    def effective_eps(self) -> float:
        if self.eps is not None:
            return self.eps
        return 1e-10 if self.kind is OptimizerKind.ADAGRAD else 1e-8

    def validate(self) -> None:
        def number(name: str, value) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"optimizer {name}={value!r}: must be a number")
            return float(value)

        def finite_nonneg(name: str, value: float) -> None:
            if not (math.isfinite(number(name, value)) and value >= 0):
                raise InvalidArgument(f"optimizer {name}={value!r}: must be a finite number >= 0")

        finite_nonneg("lr", self.lr)
        finite_nonneg("momentum", self.momentum)
        finite_nonneg("dampening", self.dampening)
        finite_nonneg("weight_decay", self.weight_decay)
        finite_nonneg("initial_accumulator_value", self.initial_accumulator_value)
        finite_nonneg("lr_decay", self.lr_decay)
        finite_nonneg("eps", self.effective_eps)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (0.0 <= number(name, value) < 1.0):
                raise InvalidArgument(f"optimizer {name}={value!r}: must lie in [0, 1)")
        if not isinstance(self.nesterov, bool):
            raise InvalidArgument(f"optimizer nesterov={self.nesterov!r}: must be True or False")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgument(
                f"optimizer nesterov=True needs momentum > 0 and dampening = 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})"
            )


def sgd(lr: float = 0.01, momentum: float = 0.0, dampening: float = 0.0,
        nesterov: bool = False, weight_decay: float = 0.0) -> OptimizerConfig:
    return OptimizerConfig(OptimizerKind.SGD, lr=lr, momentum=momentum, dampening=dampening,
                           nesterov=nesterov, weight_decay=weight_decay)


def adagrad(lr: float = 0.01, lr_decay: float = 0.0, weight_decay: float = 0.0,
            initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> OptimizerConfig:
    return OptimizerConfig(OptimizerKind.ADAGRAD, lr=lr, lr_decay=lr_decay,
                           weight_decay=weight_decay,
                           initial_accumulator_value=initial_accumulator_value, eps=eps)


def adam(lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> OptimizerConfig:
    return OptimizerConfig(OptimizerKind.ADAM, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                           weight_decay=weight_decay)


@dataclass(frozen=True)
class Initializer:
    """Initial values: a pure function of (seed, element or row id); see ``initial_values``."""

    kind: InitKind = InitKind.ZEROS
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    mean: float = 0.0
    std: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        for name in ("value", "low", "high", "mean", "std"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"initializer {name}={getattr(self, name)!r}: must be finite")
        if self.kind is InitKind.UNIFORM and not self.low <= self.high:
            raise InvalidArgument(f"uniform initializer needs low <= high (got {self.low}, {self.high})")
        if self.kind is InitKind.NORMAL and self.std < 0:
            raise InvalidArgument(f"normal initializer std={self.std}: must be >= 0")
        if not 0 <= self.seed < 1 << 64:
            raise InvalidArgument(f"initializer seed={self.seed}: must be in [0, 2**64)")


def zeros() -> Initializer:
    return Initializer(InitKind.ZEROS)


def constant(value: float) -> Initializer:
    return Initializer(InitKind.CONSTANT, value=value)


def uniform(low: float, high: float, seed: int = 0) -> Initializer:
    return Initializer(InitKind.UNIFORM, low=low, high=high, seed=seed)


def normal(mean: float = 0.0, std: float = 1.0, seed: int = 0) -> Initializer:
    return Initializer(InitKind.NORMAL, mean=mean, std=std, seed=seed)


def assigned() -> Initializer:
    return Initializer(InitKind.ASSIGNED)


@dataclass(frozen=True)
class TableSpec:
    """Immutable description of a table (see the module docstring for the layout).

    ``shape``: the dense tensor's shape, or ``(num_rows, dim)`` for a sparse table, where
    ``num_rows == 0`` admits any int64 id and otherwise ids must lie in ``[0, num_rows)``.
    """

    name: str
    kind: TableKind
    shape: tuple[int, ...]
    init: Initializer = field(default_factory=zeros)
    block_size: int = 0
    num_blocks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.kind is TableKind.DENSE and self.block_size == 0:
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)
        if self.kind is TableKind.SPARSE and self.num_blocks == 0:
            object.__setattr__(self, "num_blocks", default_sparse_blocks(*self.shape) if len(self.shape) == 2
                               else DEFAULT_SPARSE_BLOCKS)

    # --- derived layout: computed on first use, then read as plain attributes (the data
    # path reads them per request and table) ---
    @functools.cached_property
    def numel(self) -> int:
        """Dense: number of elements. Sparse: row width (dim)."""
        return math.prod(self.shape) if self.kind is TableKind.DENSE else self.dim

    @functools.cached_property
    def dim(self) -> int:
        return self.shape[1] if self.kind is TableKind.SPARSE else 1

    @functools.cached_property
    def num_rows(self) -> int:
        return self.shape[0] if self.kind is TableKind.SPARSE else 0

    @functools.cached_property
    def block_count(self) -> int:
        if self.kind is TableKind.DENSE:
            return -(-self.numel // self.block_size)
        return self.num_blocks

    def block_range(self, block: int) -> tuple[int, int]:
        """Dense: the half-open flat range of ``block``."""
        start = block * self.block_size
        return start, min(start + self.block_size, self.numel)

    def validate(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise InvalidArgument(
                f"table name {self.name!r}: use 1-128 characters from [A-Za-z0-9_.:/-]")
        self.init.validate()
        if self.kind is TableKind.DENSE:
            if len(self.shape) == 0 or any(s <= 0 for s in self.shape):
                raise InvalidArgument(
                    f"dense table {self.name!r} shape {list(self.shape)}: every dimension must be >= 1")
            if not 1 <= self.block_size <= 1 << 26:
                raise InvalidArgument(
                    f"table {self.name!r} block_size={self.block_size}: must be in [1, 2**26]")
            if self.block_count > MAX_BLOCKS_PER_TABLE:
                raise ResourceExhausted(
                    f"table {self.name!r} would have {self.block_count} blocks; the limit "
                    f"MAX_BLOCKS_PER_TABLE is {MAX_BLOCKS_PER_TABLE}: raise block_size")
        elif self.kind is TableKind.SPARSE:
            if len(self.shape) != 2 or self.shape[0] < 0 or self.shape[1] <= 0:
                raise InvalidArgument(
                    f"sparse table {self.name!r} shape {list(self.shape)}: must be "
                    f"[num_rows >= 0 (0: any id), dim >= 1]")
            if self.num_blocks < 1:
                raise InvalidArgument(f"table {self.name!r} num_blocks={self.num_blocks}: must be >= 1")
            if self.num_blocks > MAX_BLOCKS_PER_TABLE:
                raise ResourceExhausted(
                    f"table {self.name!r} num_blocks={self.num_blocks}; the limit "
                    f"MAX_BLOCKS_PER_TABLE is {MAX_BLOCKS_PER_TABLE}")
            if self.init.kind is InitKind.ASSIGNED:
                raise InvalidArgument(
                    f"sparse table {self.name!r}: ASSIGNED initial values are for dense tables; "
                    f"use ZEROS, CONSTANT, UNIFORM or NORMAL")
        else:
            raise InvalidArgument(f"table {self.name!r}: unknown kind {self.kind!r}")


def default_sparse_blocks(num_rows: int, dim: int) -> int:
    """A sparse table's blocks when created without ``num_blocks``: one per 4 MiB of float32
    values, 1 to 64 (64 for unbounded ids). A small table is placed whole on one server
    (table-wise sharding, as TorchRec's planner does): each block a request touches costs a
    lock, an exactly-once record and a version, more than splitting a few MiB spreads."""
    if num_rows <= 0 or dim <= 0:
        return DEFAULT_SPARSE_BLOCKS
    return max(1, min(DEFAULT_SPARSE_BLOCKS, -(-num_rows * dim * 4 // SPARSE_BLOCK_BYTES)))


def dense_table(name: str, shape, init: Initializer | None = None, block_size: int = 0) -> TableSpec:
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return TableSpec(name, TableKind.DENSE, shape, init or zeros(), block_size=block_size)


def sparse_table(name: str, dim: int, num_rows: int = 0, init: Initializer | None = None,
                 num_blocks: int = 0) -> TableSpec:
    return TableSpec(name, TableKind.SPARSE, (num_rows, dim), init or zeros(), num_blocks=num_blocks)


MAX_CLOCK = 1 << 40       # a worker's completed steps: far beyond any real run, below int64 overflow
@dataclass(frozen=True)
class TableConfig:
    """Mutable, versioned configuration of a table (the manager assigns ``version``).
    ``lifecycle`` applies to sparse tables only (see ``LifecyclePolicy``)."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    allow_non_finite: bool = False
    version: int = 0
    lifecycle: LifecyclePolicy = field(default_factory=LifecyclePolicy)

    def validate(self) -> None:
        self.optimizer.validate()
        self.lifecycle.validate()

    def replace(self, **changes) -> "TableConfig":
        return dataclasses.replace(self, **changes)


def validate_job_name(job: str) -> None:
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise InvalidArgument(f"job name {job!r}: use 1-64 characters from [A-Za-z0-9_.-]")


# --- block math (vectorised) ---

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic). Stable across versions."""
    z = np.asarray(x).astype(_U64, copy=True)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        z ^= z >> _U64(30)
        z *= _M1
        z ^= z >> _U64(27)
        z *= _M2
        z ^= z >> _U64(31)
    return z


def dense_blocks_of_range(spec: TableSpec, start: int, stop: int) -> range:
    """Blocks overlapping the flat range [start, stop)."""
    if stop <= start:
        return range(0)
    return range(start // spec.block_size, (stop - 1) // spec.block_size + 1)


def check_range(spec: TableSpec, start: int, stop: int) -> None:
    if not (0 <= start < stop <= spec.numel):
        raise InvalidArgument(
            f"range [{start}, {stop}) of table {spec.name!r}: must satisfy "
            f"0 <= start < stop <= {spec.numel}")


def check_ids(spec: TableSpec, ids: np.ndarray) -> None:
    if spec.num_rows > 0 and ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= spec.num_rows:
            bad = lo if lo < 0 else hi
            raise InvalidArgument(
                f"row id {bad} of table {spec.name!r} is out of bounds: ids must lie in "
                f"[0, {spec.num_rows})")


# --- initial values: counter-based, a pure function of (seed, row, column) ---

def _uniform01(seed: int, rows: np.ndarray, cols: np.ndarray, stream: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        key = splitmix64(np.asarray(rows).astype(np.int64).view(_U64)
                         ^ splitmix64(np.array([seed ^ stream], dtype=_U64)))
        mixed = splitmix64(key[:, None] * _GOLDEN + cols.astype(_U64)[None, :])
    # the top 24 bits give an exact float32 in [0, 1)
    return (mixed >> _U64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def initial_values(init: Initializer, rows: np.ndarray, dim: int) -> np.ndarray:
    """Initial values of ``rows`` (int64, any values) of width ``dim``, float32 ``[len(rows), dim]``.

    Dense tables use row = flat element index and dim = 1. ASSIGNED tables start at zero
    (they are overwritten by their INITIALIZE push before use).
    """
    rows = np.asarray(rows, dtype=np.int64)
    n = rows.shape[0]
    if init.kind in (InitKind.ZEROS, InitKind.ASSIGNED):
        return np.zeros((n, dim), dtype=np.float32)
    if init.kind is InitKind.CONSTANT:
        return np.full((n, dim), init.value, dtype=np.float32)
    cols = np.arange(dim, dtype=np.int64)
    if init.kind is InitKind.UNIFORM:
        u = _uniform01(init.seed, rows, cols, 0)
        return (np.float32(init.low) + u * np.float32(init.high - init.low)).astype(np.float32)
    if init.kind is InitKind.NORMAL:
        u1 = _uniform01(init.seed, rows, cols, 1)
        u2 = _uniform01(init.seed, rows, cols, 2)
        radius = np.sqrt(-2.0 * np.log1p(-u1.astype(np.float64)))   # 1 - u1 in (0, 1]
        z = radius * np.cos(2.0 * np.pi * u2.astype(np.float64))
        return (init.mean + init.std * z).astype(np.float32)
    raise InvalidArgument(f"unknown initializer kind {init.kind!r}")


def dense_initial_values(spec: TableSpec, start: int, stop: int) -> np.ndarray:
    """Initial values of a dense table's flat range [start, stop), float32 1-d."""
    return initial_values(spec.init, np.arange(start, stop, dtype=np.int64), 1).reshape(-1)


def coalesce(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of duplicate ids: returns (unique ids sorted ascending, summed rows).

    Sort-based (``np.add.reduceat``): ``np.add.at`` is slow for duplicates. Returns the
    inputs unchanged when the ids are already unique and sorted.
    """
    if ids.shape[0] <= 1:
        return ids, values
    if np.all(ids[1:] > ids[:-1]):
        return ids, values
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    if starts.shape[0] == ids.shape[0]:
        return sorted_ids, values[order]
    return sorted_ids[starts], np.add.reduceat(values[order], starts, axis=0)


def group_by_block(block_of_row: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Group row positions by block: [(block, positions into the original arrays)], blocks ascending."""
    if block_of_row.shape[0] == 0:
        return []
    keys = block_of_row
    if keys.dtype.kind in "iu" and 0 <= keys.min() and keys.max() < (1 << 16):
        keys = keys.astype(np.uint16)        # a stable sort of 16-bit keys is a radix sort
    order = np.argsort(keys, kind="stable")
    sorted_blocks = block_of_row[order]
    cuts = np.flatnonzero(sorted_blocks[1:] != sorted_blocks[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [order.shape[0]]))
    return [(int(sorted_blocks[s]), order[s:e]) for s, e in zip(starts, ends)]
