"""The block table: which blocks this node holds under which shard map, and the fencing of
data requests against map changes.

``BlockTable`` owns the node's shard map view and the bookkeeping around its blocks: the
blocks it holds (``blocks``), a sparse table's rows (``sparse_rows``), copies received before a
map lists them (``staged``), listed blocks whose state has not arrived (``missing``), copy
destinations a primary forwards to (``extra``) and backups owed a whole block
(``needs_resync``). ``install`` moves all of them to a new map. It does no I/O.

Lock order
==========
The node's locks, outermost first. A thread holding one takes only locks listed below it;
locks on one line are never held together.

1. ``SyncSteps`` job apply lock (steps.py, one per job): a job's SYNC steps are applied
   under it; taken with nothing else held.
2. ``BlockTable.gate`` (``EpochGate``): shared by data requests (push, pull, a SYNC step's
   application), exclusive for a map install, a reset and ``hold_job``'s drain.
3. ``Block.lock`` (blocks.py): one block's state. Several at once only in sorted key order.
   Calls to peers (forward, resync, copy) are made holding the blocks' locks.
4. ``SparseRows.lock`` (storage.py) | ``BlockTable.lock``: leaves, taken inside block locks
   (a block is never locked while ``BlockTable.lock`` is held: blocks popped under it are
   released after it; copy_blocks and the SYNC bookkeeping take it inside block locks).
5. ``JobClock.cond`` (clocks.py): taken inside ``BlockTable.lock`` by an install, otherwise
   with at most the job apply lock held. ``JobHolds``' condition (apply.py) is taken with
   nothing held.

``BlockTable.lock`` guards the dicts and sets above and ``SyncSteps.pending``; ``view`` is
immutable and swapped under it, so readers read ``view`` without a lock (under the gate, it
cannot change). Exception, kept as it was: ``replication.Forwarder`` marks and clears a
block's ``needs_resync`` entry holding only that block's lock, and ``backups`` reads
``extra`` without the lock.
"""

from __future__ import annotations

import contextlib
import threading

from shardps.errors import Unavailable
from shardps.messages import Header
from shardps.server.node.blocks import AnyBlock, BlockKey, DenseBlock, SparseBlock, SparseRows, new_block
from shardps.shardmap import ShardMapView, TableView
from shardps.tables import TableKind


class EpochGate:
    """Data requests enter shared; a map install enters exclusive and waits for them.

    ``exclusive`` waits for every shared holder to leave and keeps new ones out until it
    exits. Not reentrant: a thread inside ``shared`` must not enter ``exclusive``.
    ``shared()`` returns one reusable context manager (every data request enters it: a
    plain lock and a counter, no generator)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._shared = _Shared(self)

    def shared(self) -> "_Shared":
        return self._shared

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._closed = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


class _Shared:
    """``EpochGate.shared()``'s context manager."""

    __slots__ = ("gate",)

    def __init__(self, gate: EpochGate):
        self.gate = gate

    def __enter__(self) -> None:
        gate = self.gate
        with gate._lock:
            while gate._closed:
                gate._cond.wait()
            gate._active += 1

    def __exit__(self, *exc) -> None:
        gate = self.gate
        with gate._lock:
            gate._active -= 1
            if not gate._active and gate._closed:
                gate._cond.notify_all()


class BlockTable:
    """The blocks one node holds and the map it obeys. Thread-safe as the module docstring
    says: methods named ``*_locked`` expect ``lock`` held, the others take it themselves."""

    def __init__(self, name: str, defect: str = "", cold_dir: str = ""):
        self.name = name
        self.cold_dir = cold_dir              # the sparse tables' cold tiers (server/node/cold.py)
        # TEST-ONLY (tools/verify/defects.py): "1" re-introduces defect 1 of issue 13 (copy
        # destinations never pruned on map install) so the verifier's tests can show they catch it
        self.defect = defect
        self.gate = EpochGate()
        self.lock = threading.Lock()          # guards the dicts below
        self.view = ShardMapView()
        self.my_index = -1
        self.blocks: dict[BlockKey, AnyBlock] = {}
        self.sparse_rows: dict[tuple[str, str], SparseRows] = {}  # a sparse table's rows here
        self.staged: dict[BlockKey, tuple[AnyBlock, str]] = {}   # copies received, not yet listed
        self.missing: set[BlockKey] = set()                    # listed here, state not loaded
        self.extra: dict[BlockKey, set[str]] = {}              # copy destinations to forward to
        self.needs_resync: dict[BlockKey, set[str]] = {}
        # one up (under ``lock``) whenever ``view``, ``blocks`` or ``missing`` change: what the
        # request plans (``plan.Planner``) derived from them is then derived again
        self.generation = 0

    def clear_locked(self) -> None:
        """Forget every block and the map (a new incarnation). ``lock`` held, gate exclusive."""
        self.generation += 1
        for d in (self.blocks, self.sparse_rows, self.staged, self.extra, self.needs_resync):
            d.clear()
        self.missing.clear()
        self.view = ShardMapView()
        self.my_index = -1

    # ------------------------------------------------------------------ map install
    def install(self, view: ShardMapView, under_lock=None) -> list[tuple[BlockKey, AnyBlock]]:
        """Take up ``view``: keep listed blocks, create fresh ones, take staged copies, mark
        the rest missing; drop what is no longer listed (its sparse rows are freed), and
        forget copy destinations that are listed or dead. ``under_lock(view)``, if given, runs
        under ``lock`` just before the view is swapped. Call with the gate held exclusive.
        Returns the blocks held under the new map."""
        me = self.name
        listed: set[BlockKey] = set()
        dropped: list[AnyBlock] = []
        with self.lock:
            self.generation += 1
            for (job, tname), t in view.tables.items():
                for b, reps in enumerate(t.replicas):
                    if me not in reps:
                        continue
                    key = (job, tname, b)
                    listed.add(key)
                    block = self.blocks.get(key)
                    if block is not None and block.spec != t.spec:
                        dropped.append(self.blocks.pop(key))   # a table re-created under the name
                        block = None
                    if block is None:
                        if key in self.staged:
                            block = self.staged.pop(key)[0]
                        elif t.since_epoch[b] == t.fresh_epoch[b]:
                            block = self.new_block_locked(key, t.spec)
                        else:
                            self.missing.add(key)
                            continue
                        self.blocks[key] = block
                    self.missing.discard(key)
            for key in [k for k in self.blocks if k not in listed]:
                dropped.append(self.blocks.pop(key))
            for table_key in [k for k in self.sparse_rows if k not in view.tables]:
                del self.sparse_rows[table_key]
            self.missing &= listed
            for d in (self.extra, self.needs_resync):
                for key in [k for k in d if k not in listed]:
                    del d[key]
            if self.defect != "1":
                self.prune_destinations_locked(view)
            for key in [k for k, (blk, _) in self.staged.items()
                        if (k[0], k[1]) not in view.tables]:
                del self.staged[key]
            if under_lock is not None:
                under_lock(view)
            self.view = view
            self.my_index = view.server_names.index(me) if me in view.server_names else -1
            held = list(self.blocks.items())
        self.release(dropped)
        return held

    def prune_destinations_locked(self, view: ShardMapView) -> None:
        """Forget copy destinations the map now lists as replicas (the copy is done: they are
        backups like any other) and any node the map declares dead, so that neither is sent
        ops or resyncs any more. Call with ``lock`` held."""
        dead = view.dead
        live = set(view.server_names) - dead
        for key in list(self.extra):
            t = view.tables[(key[0], key[1])]
            dests = (self.extra[key] - set(t.replicas[key[2]])) & live
            if dests:
                self.extra[key] = dests
            else:
                del self.extra[key]
        for key in list(self.needs_resync):
            nodes = self.needs_resync[key] & live
            if nodes:
                self.needs_resync[key] = nodes
            else:
                del self.needs_resync[key]

    def new_block_locked(self, key: BlockKey, spec) -> AnyBlock:
        """A new empty block; a sparse one stores its rows in the table's ``SparseRows`` here. Call
        with ``lock`` held."""
        if spec.kind is TableKind.SPARSE:
            rows = self.sparse_rows.get((key[0], key[1]))
            if rows is None or rows.spec != spec:
                rows = self.sparse_rows[(key[0], key[1])] = SparseRows(spec, self.cold_dir)
            return new_block(key, spec, rows)
        return new_block(key, spec)

    @staticmethod
    def release(blocks: list[AnyBlock]) -> None:
        """Free the rows of sparse blocks this node no longer holds. Takes each block's lock,
        so callers pop blocks under ``lock`` and release them after (see the lock order)."""
        for blk in blocks:
            if isinstance(blk, SparseBlock):
                with blk.lock:
                    blk.release()

    # ------------------------------------------------------------------ block changes
    def receive(self, key: BlockKey, t: TableView, source: str) -> AnyBlock:
        """The block a whole copy of ``key`` from ``source`` is loaded into: the held one (no
        longer missing) if the map lists this node, else a staged one."""
        with self.lock:
            self.generation += 1
            if self.name in t.replicas[key[2]]:
                blk = self.blocks.get(key)
                if blk is None:
                    blk = self.blocks[key] = self.new_block_locked(key, t.spec)
                self.missing.discard(key)
            else:
                staged = self.staged.get(key)
                blk = staged[0] if staged is not None else self.new_block_locked(key, t.spec)
                self.staged[key] = (blk, source)
        return blk

    def add_destination(self, key: BlockKey, node: str) -> None:
        """``node`` now holds a whole copy of ``key``: forward its later ops there too."""
        with self.lock:
            self.extra.setdefault(key, set()).add(node)
            self.needs_resync.get(key, set()).discard(node)

    def drop(self, job: str, tables=()) -> int:
        """Drop the blocks of ``job`` (of ``tables`` only, if given); returns how many."""
        with self.lock:
            self.generation += 1
            keys = [k for k in self.blocks if k[0] == job and (not tables or k[1] in tables)]
            dropped = [self.blocks.pop(k) for k in keys]
        self.release(dropped)
        return len(keys)

    # ------------------------------------------------------------------ queries
    def lookup(self, key: BlockKey) -> tuple[AnyBlock | None, tuple[AnyBlock, str] | None]:
        """(held block, (staged block, source)) of ``key``; either may be None."""
        with self.lock:
            return self.blocks.get(key), self.staged.get(key)

    def held(self, job: str) -> list[tuple[BlockKey, AnyBlock]]:
        """The blocks of ``job`` held here."""
        with self.lock:
            return [(k, b) for k, b in self.blocks.items() if k[0] == job]

    def loaded(self, key: BlockKey) -> bool:
        """Whether ``key`` is held here with its state (not waiting for a copy)."""
        return key not in self.missing and key in self.blocks

    def is_primary(self, key: BlockKey) -> bool:
        t = self.view.tables.get((key[0], key[1]))
        return t is not None and key[2] < len(t.replicas) and bool(t.replicas[key[2]]) \
            and t.replicas[key[2]][0] == self.name

    def has_backups(self, key: BlockKey) -> bool:
        """Whether ``backups(key)`` is not empty (without building it)."""
        return len(self.view.tables[(key[0], key[1])].replicas[key[2]]) > 1 or bool(self.extra.get(key))

    def backups(self, key: BlockKey) -> list[str]:
        """Nodes a primary forwards ``key``'s ops to: listed backups, then copy destinations."""
        t = self.view.tables[(key[0], key[1])]
        listed = list(t.replicas[key[2]][1:])
        return listed + sorted(self.extra.get(key, set()) - set(listed))

    def member(self, header: Header) -> bool:
        """Whether the request's session is a live member of its job's group."""
        group = self.view.groups.get(header.job)
        return bool(header.session) and group is not None and any(
            m.session == header.session for m in group.members)

    def check_epoch(self, header: Header) -> None:
        """Unavailable if the request comes from a map newer than this node's."""
        if header.epoch > self.view.epoch:
            raise Unavailable(
                f"server {self.name} is at epoch {self.view.epoch}, behind the request's epoch "
                f"{header.epoch}: retry shortly")

    def usage(self) -> dict:
        """Blocks held as primary and as backup, bytes, and per table (blocks, parameters,
        bytes). Reads the blocks without their locks (a gauge, not a snapshot)."""
        primary = backup = 0
        nbytes = 0
        tables: dict[tuple[str, str], list[int]] = {}
        with self.lock:
            items = list(self.blocks.items())
        for key, blk in items:
            if self.is_primary(key):
                primary += 1
            else:
                backup += 1
            b = blk.nbytes()
            nbytes += b
            params = (blk.values.size if isinstance(blk, DenseBlock) and blk.values is not None
                      else blk.count * blk.dim if isinstance(blk, SparseBlock) else 0)
            entry = tables.setdefault((key[0], key[1]), [0, 0, 0])
            entry[0] += 1
            entry[1] += params
            entry[2] += b
        return {"primary_blocks": primary, "backup_blocks": backup, "bytes": nbytes,
                "tables": tables}
