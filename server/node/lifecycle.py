"""Sparse tables within a memory budget: admission by frequency, TTL and budget eviction.

The state (``TableLifecycle``, one per ``SparseRows``: one sparse table on one server) is
kept per block, so that every replica of a block, a checkpoint of it and a restore onto
any number of servers hold the same state:

* an admission count-min sketch per block (``DEPTH`` x ``WIDTH`` 8-bit saturating
  counters). It counts the pushes of rows the block does not store; a row is admitted
  (stored) on the push that brings its estimate to ``admit_after``. After ``RESET_AFTER``
  counts a block's counters are halved (TinyLFU's reset), so the sketch measures recent
  frequency and never saturates under an id stream that does not repeat;
* the block's clock ``now`` (the largest tick pushed to it);
* per row (in ``SparseRows.ticks``): the tick of the last push that touched it.

A tick is the push's clock (the job's step, ``RequestHeader.clock``); a SYNC step applied
to a block uses the block's own clock plus one (each replica computes the same).

Semantics (the decisions are functions of that state and the pushes, in block order):

* admission: ``admit_after <= 1`` stores every pushed row; otherwise a row not stored is
  counted and stored only once the estimate reaches k; the gradients of rows not admitted
  are dropped (``not_admitted``), and a pull returns their initial value.
* TTL: a row whose last push is more than ``ttl_steps`` ticks behind the push being applied
  (or whose last tick ended more than ``ttl_seconds`` ago, primary-side) is evicted. A block
  is scanned on a push that moves its clock into a new interval of ``ttl_steps / 8`` ticks
  (for seconds: on a push at least ``ttl_seconds / 8`` after the previous scan).
* budget: each block may take ``budget_bytes / num_blocks`` bytes (its rows at
  ``row_bytes``, plus its sketch when admission is on). A push that leaves a block above
  it evicts the block's least recently pushed rows (LRU on ticks, ties by smaller id first)
  down to ``LOW_WATERMARK`` of its share. Eviction is decided after the push is applied.
* cold tier (``cold``): the rows a budget eviction chose move to the table's cold tier on
  the server's disk (``server/node/cold.py``) instead of being dropped, with their state and
  tick; a pull reads them there, and the next push of such a row brings it back to RAM
  before it is applied (it was admitted once: admission does not count it again). TTL
  expires rows in both tiers.

The primary decides (``apply_push``) and forwards the decision with its APPLY op; a backup
replays it (``apply_decided``) without deciding anything. Plain numpy; no grpc.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardps import id_blocks
from shardps.server.node import cold, storage_kernels
from shardps.tables import LifecyclePolicy, TableConfig, splitmix64

if TYPE_CHECKING:
    from shardps.server.node.storage import SparseRows

DEPTH = 4
WIDTH = 4096                      # 12 bits of the hash per row of the sketch
CELLS = DEPTH * WIDTH
SKETCH_BYTES = CELLS              # one block's sketch: 16 KiB of uint8
RESET_AFTER = 8 * WIDTH           # counts to a block's sketch before its counters halve
LOW_WATERMARK = 0.90              # a block over budget is evicted down to this share of it
TTL_SCANS = 8                     # TTL scans per TTL period
_SEED = np.uint64(0x6C69666563796C65)
_MASK = np.uint64(WIDTH - 1)
_EMPTY = np.empty(0, dtype=np.int64)


def sketch_cells(ids: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Flat sketch cell of each (id, depth): ``[n, DEPTH]`` int64 into a ``[blocks, CELLS]``
    array (independent of the block hash: a differently seeded splitmix64)."""
    z = splitmix64(ids.view(np.uint64) ^ _SEED)
    cols = np.empty((ids.shape[0], DEPTH), dtype=np.int64)
    for d in range(DEPTH):
        cols[:, d] = ((z >> np.uint64(12 * d)) & _MASK).astype(np.int64) + d * WIDTH
    cols += (blocks * CELLS)[:, None]
    return cols


@dataclass
class Outcome:
    """A push's lifecycle decisions: ids pushed but not admitted, ids evicted after it from
    RAM to the cold tier (``cooled``), ids gone (evicted from RAM, or expired from either
    tier)."""

    dropped: np.ndarray
    cooled: np.ndarray
    gone: np.ndarray


class TableLifecycle:
    """Lifecycle state of one sparse table on one server (see the module docstring).
    Not thread-safe: the owning ``SparseRows.lock`` is held."""

    def __init__(self, num_blocks: int):
        from shardps.server.node.storage import storage
        self.num_blocks = num_blocks
        n = num_blocks * CELLS
        # a mapping of its own is zero-filled and resident only for the blocks that count
        self.sketch = (storage((num_blocks, CELLS), np.uint8) if n >= 1 << 16
                       else np.zeros((num_blocks, CELLS), dtype=np.uint8))
        self.counted = np.zeros(num_blocks, dtype=np.int64)   # counts since the last halving
        self.sketched = np.zeros(num_blocks, dtype=bool)      # sketch in use (memory counted)
        self.now = np.zeros(num_blocks, dtype=np.int64)       # largest tick pushed per block
        self.policy = LifecyclePolicy()                       # the last one applied
        # primary-side map of ticks to wall time (ttl_seconds): (first time seen, tick)
        self._tick_times: list[tuple[float, int]] = []
        self._next_seconds_scan = 0.0
        self.counters = dict(admitted=0, not_admitted=0, evicted_ttl=0, evicted_budget=0,
                             cooled=0, evicted_replicated=0, pulled=0, pulled_evicted=0,
                             pulled_not_admitted=0)

    # ------------------------------------------------------------------ sketch
    def count(self, ids: np.ndarray, blocks: np.ndarray) -> None:
        """Count one push of each id (unique per block) in its block's sketch; halve the
        counters of a block that reached ``RESET_AFTER`` counts."""
        if ids.shape[0] == 0:
            return
        flat = self.sketch.reshape(-1)
        cells, times = np.unique(sketch_cells(ids, blocks).reshape(-1), return_counts=True)
        flat[cells] = np.minimum(flat[cells].astype(np.int64) + times, 255).astype(np.uint8)
        per_block = np.bincount(blocks, minlength=self.num_blocks)
        self.counted += per_block
        self.sketched |= per_block > 0
        full = self.counted >= RESET_AFTER
        if full.any():
            self.sketch[full] >>= 1
            self.counted[full] //= 2

    def estimate(self, ids: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Estimated recent pushes of each id while not stored (count-min: never below)."""
        return self.sketch.reshape(-1)[sketch_cells(ids, blocks)].min(axis=1)

    def sketch_bytes(self) -> int:
        return int(self.sketched.sum()) * SKETCH_BYTES

    def forget_block(self, block: int) -> None:
        self.sketch[block] = 0
        self.counted[block] = self.now[block] = 0
        self.sketched[block] = False

    # ------------------------------------------------------------------ snapshots
    def block_state(self, block: int) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"now": int(self.now[block]), "counted": int(self.counted[block]),
                "sketched": bool(self.sketched[block])}
        arrays = {"lifecycle.sketch": self.sketch[block].copy()} if self.sketched[block] else {}
        return meta, arrays

    def load_block(self, block: int, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        self.forget_block(block)
        self.now[block] = int(meta.get("now", 0))
        self.counted[block] = int(meta.get("counted", 0))
        if "lifecycle.sketch" in arrays:
            self.sketch[block] = np.asarray(arrays["lifecycle.sketch"]).reshape(CELLS).astype(np.uint8)
            self.sketched[block] = True

    # ------------------------------------------------------------------ reads
    def count_pull(self, ids: np.ndarray, missing: np.ndarray | None) -> None:
        """Count a pull of ``ids`` (``missing``: the rows not stored, or None)."""
        c = self.counters
        c["pulled"] += ids.shape[0]
        if missing is None:
            return
        n = int(missing.sum())
        if self.policy.admit_after <= 1:
            c["pulled_evicted"] += n        # every pushed row is admitted: not stored = evicted
            return
        gone = ids[missing]
        was = int((self.estimate(gone, id_blocks.sparse_block_of(gone, self.num_blocks))
                   >= self.policy.admit_after).sum())
        c["pulled_evicted"] += was
        c["pulled_not_admitted"] += n - was

    # ------------------------------------------------------------------ ttl seconds
    def _seconds_threshold(self, tick: int, wall: float) -> int | None:
        """Primary: the oldest tick still within ``ttl_seconds`` (rows last pushed at a
        smaller tick are expired), or None when no tick is that old yet."""
        times = self._tick_times
        if not times or times[-1][1] < tick:
            times.append((wall, tick))
        cut = wall - self.policy.ttl_seconds
        i = bisect.bisect_right(times, (cut, 1 << 62))
        if i == 0:
            return None
        del times[:i - 1]                     # keep the newest entry at or before the cut
        return times[0][1]


def limit_rows(rows: "SparseRows", policy: LifecyclePolicy) -> int:
    """Rows one block may hold under ``policy``'s budget."""
    share = policy.budget_bytes // rows.spec.num_blocks
    if policy.admit_after > 1:
        share -= SKETCH_BYTES
    return max(0, share // rows.row_bytes())


def apply_push(rows: "SparseRows", config: TableConfig, ids: np.ndarray, grad: np.ndarray,
               tick: int, wall: float | None) -> Outcome:
    """Primary (and a SYNC step on every replica): admit, apply ``grad`` to the admitted
    rows of ``ids`` (unique), stamp them with ``tick``, then evict in the blocks pushed.
    ``wall`` (seconds) enables ``ttl_seconds``; None (a replayed SYNC step) ignores it."""
    life = rows.lifecycle()
    policy = life.policy = config.lifecycle
    nb = rows.spec.num_blocks
    blocks = id_blocks.sparse_block_of(ids, nb)
    pushed = np.bincount(blocks, minlength=nb) > 0
    dropped = _EMPTY
    missing = _missing_warmed(rows, ids)
    if missing.any():
        new_ids, new_blocks = ids[missing], blocks[missing]
        if policy.admit_after > 1:
            life.count(new_ids, new_blocks)
            admitted = life.estimate(new_ids, new_blocks) >= policy.admit_after
            keep = ~missing
            keep[missing] = admitted
            dropped = new_ids[~admitted]
            life.counters["not_admitted"] += dropped.shape[0]
            ids, grad, blocks = ids[keep], grad[keep], blocks[keep]
            life.counters["admitted"] += int(admitted.sum())
        else:
            life.counters["admitted"] += new_ids.shape[0]
    due = None
    if policy.ttl_steps:         # a scan when the block's clock enters a new scan interval
        every = max(1, policy.ttl_steps // TTL_SCANS)
        due = pushed & (life.now // every < tick // every)
    _touch(rows, life, config, ids, grad, pushed, tick)
    cooled, gone = _choose_evictions(rows, life, policy, pushed, due, tick, wall)
    cooled = cold.cool(rows, cooled)             # those the tier cannot take stay in RAM
    life.counters["cooled"] += cooled.shape[0]
    cold.forget(rows, gone)
    return Outcome(dropped, cooled, gone)


def _missing_warmed(rows: "SparseRows", ids: np.ndarray) -> np.ndarray:
    """Which of ``ids`` (unique) are not in RAM, after the rows the cold tier holds of them
    came back to RAM (a stored row: never subject to admission again)."""
    missing = rows.lookup(ids) < 0
    if rows.cold is not None and missing.any():
        missing[missing] = ~cold.warm(rows, ids[missing])
    return missing


def apply_decided(rows: "SparseRows", config: TableConfig, ids: np.ndarray, grad: np.ndarray,
                  dropped: np.ndarray, cooled: np.ndarray, gone: np.ndarray, tick: int) -> None:
    """Backup: replay the primary's decision (apply ``ids``, count ``dropped``, move
    ``cooled`` to the cold tier, drop ``gone``), leaving the block's state identical to the
    primary's."""
    life = rows.lifecycle()
    life.policy = config.lifecycle
    nb = rows.spec.num_blocks
    missing = _missing_warmed(rows, ids)
    counted = np.concatenate([ids[missing], dropped])
    counted_blocks = id_blocks.sparse_block_of(counted, nb)
    if config.lifecycle.admit_after > 1:
        life.count(counted, counted_blocks)
    life.counters["admitted"] += int(missing.sum())
    life.counters["not_admitted"] += dropped.shape[0]
    pushed = np.bincount(counted_blocks, minlength=nb) > 0
    if ids.shape[0]:
        pushed[id_blocks.sparse_block_of(ids[:1], nb)] = True
    _touch(rows, life, config, ids, grad, pushed, tick)
    cold.cool(rows, cooled)
    cold.forget(rows, gone)
    life.counters["evicted_replicated"] += cooled.shape[0] + gone.shape[0]


def _touch(rows: "SparseRows", life: TableLifecycle, config: TableConfig, ids: np.ndarray,
           grad: np.ndarray, pushed: np.ndarray, tick: int) -> None:
    """Apply ``grad`` to rows ``ids`` (storing new ones), stamp them and the blocks
    ``pushed`` (a mask) with ``tick``."""
    if ids.shape[0]:
        slots = rows.apply_rows(config, ids, grad)
        rows.ensure_ticks().put(slots, tick)
    life.now[pushed] = np.maximum(life.now[pushed], tick)


def _choose_evictions(rows: "SparseRows", life: TableLifecycle, policy: LifecyclePolicy,
                      pushed: np.ndarray, due_steps: np.ndarray | None, tick: int,
                      wall: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids to move to the cold tier, ids to drop) of the blocks ``pushed`` (a mask;
    ``due_steps``: those due a TTL scan in steps), per the module docstring."""
    threshold = None
    if policy.ttl_seconds and wall is not None:
        threshold = life._seconds_threshold(tick, wall)
        if wall < life._next_seconds_scan:
            threshold = None
    limit = limit_rows(rows, policy) if policy.budget_bytes else -1
    over = pushed & (rows.block_counts > limit) if limit >= 0 else None
    scan = np.zeros(life.num_blocks, dtype=bool)
    for mask in (due_steps, over):
        if mask is not None:
            scan |= mask
    if threshold is not None:
        scan |= pushed
    if not scan.any():
        return _EMPTY, _EMPTY
    ids, slots = rows.index.stored()
    b = id_blocks.sparse_block_of(ids, life.num_blocks)
    sel = scan[b]
    ids, slots, b = ids[sel], slots[sel], b[sel]
    seen = rows.ensure_ticks().take(slots).astype(np.int64)
    ttl = _expired(seen, b, due_steps, threshold, policy, tick)
    if threshold is not None and wall is not None:
        life._next_seconds_scan = wall + policy.ttl_seconds / TTL_SCANS
    evict = ttl.copy()
    cooled = _EMPTY
    if over is not None and over.any():
        left = np.flatnonzero(~ttl & over[b])
        counts = np.bincount(b[left], minlength=life.num_blocks)
        excess = np.maximum(counts - int(limit * LOW_WATERMARK), 0)
        # per block: the oldest, then the smaller id (``stored`` lists ids ascending)
        chosen = left[storage_kernels.oldest_rows(b[left], seen[left], excess)]
        if policy.cold:
            cooled = np.sort(ids[chosen])
        else:
            evict[chosen] = True
            life.counters["evicted_budget"] += chosen.shape[0]
    life.counters["evicted_ttl"] += int(ttl.sum())
    gone = ids[evict]
    ttl_blocks = np.zeros(life.num_blocks, dtype=bool)
    if due_steps is not None:
        ttl_blocks |= due_steps
    if threshold is not None:
        ttl_blocks |= pushed
    if rows.cold is not None and rows.cold.count and ttl_blocks.any():
        cold_ids, cold_slots = rows.cold.stored(ttl_blocks, ordered=False)    # TTL holds in the cold tier too
        cold_seen = rows.cold.ticks.data[cold_slots].astype(np.int64)
        cold_b = id_blocks.sparse_block_of(cold_ids, life.num_blocks)
        expired = cold_ids[_expired(cold_seen, cold_b, due_steps, threshold, policy, tick)]
        if expired.shape[0]:
            rows.cold.counters["expired"] += expired.shape[0]
            life.counters["evicted_ttl"] += expired.shape[0]
            gone = np.concatenate([gone, expired])
    return cooled, gone


def _expired(seen: np.ndarray, b: np.ndarray, due_steps: np.ndarray | None, threshold: int | None,
             policy: LifecyclePolicy, tick: int) -> np.ndarray:
    """Which rows (last pushed at ``seen``, of blocks ``b``) TTL expires now."""
    ttl = np.zeros(seen.shape[0], dtype=bool)
    if due_steps is not None and due_steps.any():
        ttl |= due_steps[b] & (tick - seen > policy.ttl_steps)
    if threshold is not None:
        ttl |= seen < threshold
    return ttl


def report(rows: "SparseRows", blocks_held: int) -> dict | None:
    """This server's lifecycle figures of one table (None without a policy ever applied):
    its share of the budget (the blocks it holds), rows, bytes, counters since it took the
    blocks up, the share of pulled rows that were not stored, and, with a cold tier, its
    rows, bytes and counters (``cold_*``)."""
    life = rows.life
    if life is None:
        return None
    c = life.counters
    pulled = max(1, c["pulled"])
    cold = rows.cold.counters if rows.cold is not None else {"read": 0}
    out = {"budget_bytes": life.policy.budget_bytes * blocks_held // rows.spec.num_blocks,
           "rows": int(rows.block_counts.sum()), "memory_bytes": rows.memory_bytes(),
           "rows_admitted": c["admitted"], "rows_not_admitted": c["not_admitted"],
           "rows_evicted_ttl": c["evicted_ttl"], "rows_evicted_budget": c["evicted_budget"],
           "rows_evicted_replicated": c["evicted_replicated"], "rows_cooled": c["cooled"],
           "pull_miss_evicted": c["pulled_evicted"] / pulled,
           "pull_miss_not_admitted": c["pulled_not_admitted"] / pulled,
           "hot_hit_ratio": 1.0 - (c["pulled_evicted"] + c["pulled_not_admitted"] + cold["read"]) / pulled
           if c["pulled"] else 1.0}
    if rows.cold is not None:
        out.update(cold_rows=rows.cold.count, cold_bytes=rows.cold.disk_bytes(),
                   **{f"cold_{k}": v for k, v in cold.items()})
    return out


def publish(metrics, sparse_rows: dict, tables: dict) -> None:
    """Set the lifecycle gauges (``NodeMetrics.set_lifecycle``) of every sparse table here
    from ``report``; ``tables``: ``BlockTable.usage()["tables"]`` (blocks held per table)."""
    reports = {}
    for key, rows in list(sparse_rows.items()):
        with rows.lock:
            r = report(rows, tables.get(key, [0])[0])
        if r is not None:
            reports[key] = r
    metrics.set_lifecycle(reports)
