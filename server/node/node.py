"""``ServerNode``: one server node's logic, a facade over its layers.

``shardps.server.node_service`` is the thin gRPC layer in front of it, and ``Peers`` (passed
in, or set later as ``node.peers``) carries its calls to other servers. The layers, each a
plain class with its contract in its docstring:

* ``decode``: request bytes -> plain segments and per-block parts, validated whole;
* ``table.BlockTable``: the blocks held under the installed shard map, fencing (``EpochGate``)
  and the node's lock order;
* ``apply.PushApplier``: the push path (holds, exactly-once, quotas, optimizers);
* ``replication``: ``Forwarder`` (primary: forward, resync, copy, snapshot) and
  ``BackupApplier`` (backup: apply forwarded ops, load whole blocks);
* ``steps.SyncSteps``: job clocks and SYNC step application;
* ``pull.PullReader``: the read path.

Data path rules (the .proto states the same contract):

* Only a block's primary serves it. A request is refused with ``StaleEpoch``
  (FAILED_PRECONDITION) when, under this node's map, the block's primary is another node or
  the block moved after the request's epoch; with ``Unavailable`` when the node's map is
  older than the request's or the block's state has not been loaded here yet.
* Every request is validated whole before anything is applied: a rejected request changes
  nothing.
* Push is exactly-once per block: (session, incarnation, sequence) is remembered by every
  replica. A push is acknowledged once it is applied on every listed backup (and on every
  node a block is being copied to). Primary-backup replication: the primary applies an
  operation, then forwards it (in its order, holding the block's lock) to the backups, whose
  copies are therefore identical; readers read the primary only, so a pull sees every
  acknowledged push (linearizable per block).
* A backup applies an operation only if its version follows on from its own; otherwise it
  reports the block out of sync and the primary sends the whole block before acknowledging.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from shardps import id_blocks, kernels, mapdelta
from shardps.blockops import BlockOp, BlockSnapshot
from shardps.errors import Unavailable
from shardps.messages import Header, PullReply, PullRequest, PushAck, PushRequest, StepReply, StepRequest
from shardps.metrics import NodeMetrics
from shardps.rpc import step
from shardps.server.node import execute, hash_index, lifecycle, optimizer_kernels, storage_kernels
from shardps.server.node.apply import JobHolds, PushApplier, forget_departed_writers
from shardps.server.node.backup import BackupApplier
from shardps.server.node.blocks import BlockKey, Writer
from shardps.server.node.decode import NodeLimits
from shardps.server.node.liveness import Liveness
from shardps.server.node.plan import Planner
from shardps.server.node.pull import PullReader
from shardps.server.node.replication import Forwarder, NoPeers, Peers
from shardps.server.node.steps import SyncSteps
from shardps.server.node.table import BlockTable
from shardps.shardmap import ShardMap, ShardMapView

log = logging.getLogger("shardps.server")


def warm_up_kernels() -> tuple[float, int, int]:
    """The node's kernels compiled or loaded, and logged (``kernels.prepare``). The server
    image runs it at build time so that its containers load every kernel and compile none."""
    return kernels.prepare(log, id_blocks, storage_kernels, optimizer_kernels, hash_index, step)


def _table_attr(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.table, name), doc=doc)


class ServerNode:
    """One server node's blocks and duties. Thread-safe; methods may block (see each)."""

    def __init__(self, name: str, peers: Peers | None = None, limits: NodeLimits = NodeLimits(),
                 metrics: NodeMetrics | None = None, clock=time.monotonic, defect: str = "", cold_dir: str = ""):
        """``defect``: TEST-ONLY, a fixed defect to re-introduce (``shardps.tools.verify.defects``);
        ``cold_dir``: where sparse tables' cold tiers go ("": the system's temp directory)."""
        self.name = name
        self.limits = limits
        # the kernels' first use would otherwise land in the first requests (~0.3 s)
        threading.Thread(target=warm_up_kernels, name="kernels-warm-up", daemon=True).start()
        self.metrics = metrics or NodeMetrics()
        self._now = clock
        self.incarnation = 0
        self.on_epoch: Callable[[int], object] | None = None   # callback(epoch) after each install (logging)
        self.table = BlockTable(name, defect, cold_dir)
        self.forwarder = Forwarder(self.table, self.metrics, peers or NoPeers(), clock)
        self.steps = SyncSteps(self.table, self.forwarder, clock, defect)
        self.backup = BackupApplier(self.table, self.steps, defect)
        self.holds = JobHolds(self.table.gate, clock)
        self.planner = Planner(self.table, self.holds, limits.max_rows, limits.max_response_bytes)
        self.pusher = PushApplier(self.table, self.planner, self.steps, self.forwarder, self.holds, limits,
                                  self.metrics, clock)
        self.reader = PullReader(self.table, self.planner, self.steps, limits, self.metrics, clock)
        self.liveness = Liveness()          # ServerProcess configures it (the manager's lease)

    # ================================================================== state, read-only
    view = _table_attr("view", "The installed shard map (a ShardMapView).")
    my_index = _table_attr("my_index", "This node's index in the map's servers (-1: absent).")
    blocks = _table_attr("blocks", "Blocks held: key -> Block (BlockTable.blocks).")
    sparse_rows = _table_attr("sparse_rows", "Sparse tables' rows here: (job, table) -> SparseRows.")
    staged = _table_attr("staged", "Copies received before a map lists them: key -> (block, source).")
    missing = _table_attr("missing", "Blocks listed here whose state has not been loaded.")
    extra = _table_attr("extra", "Copy destinations a primary forwards to: key -> nodes.")
    needs_resync = _table_attr("needs_resync", "Backups owed a whole block: key -> nodes.")

    @property
    def clocks(self):
        """Job clocks: job -> JobClock (SyncSteps.clocks)."""
        return self.steps.clocks

    @property
    def peers(self) -> Peers:
        """How this node reaches others; may be replaced (e.g. once the transport exists)."""
        return self.forwarder.peers

    @peers.setter
    def peers(self, peers: Peers) -> None:
        self.forwarder.peers = peers

    @property
    def epoch(self) -> int:
        return self.table.view.epoch

    def _is_primary(self, key: BlockKey) -> bool:
        return self.table.is_primary(key)

    # ================================================================== shard map
    def reset(self, incarnation: int) -> None:
        """Start incarnation ``incarnation``: a new one forgets every block and the map (it is
        fenced until blocks are copied to it again); the same one keeps everything."""
        if incarnation == self.incarnation:
            return
        with self.table.gate.exclusive():
            with self.table.lock:
                self.table.clear_locked()
                self.steps.clear_locked()
            self.incarnation = incarnation
        self._update_usage_metrics()

    def view_address(self, name: str) -> str:
        """Address of server ``name`` under the installed map (KeyError if unknown)."""
        return self.table.view.address(name)

    def install_map(self, msg: ShardMap) -> int:
        """Install a newer shard map, whole or as its changes (``ShardMap.changes``, since
        the installed epoch: else ``mapdelta.StaleBase``, a FailedPrecondition); older or
        equal epochs are ignored. Waits for in-flight data requests under the old map to
        finish. Returns the installed epoch."""
        base = self.table.view
        if msg.epoch <= base.epoch:
            return base.epoch
        view = ShardMapView(mapdelta.whole(base.msg, msg))
        # forwards to a node this map declares dead (paused, cut off) would hold the data
        # requests the gate waits for until their timeout: they fail now instead
        alive = set(view.server_names) - view.dead
        self.forwarder.declare_dead(view.epoch, {s.name for s in (*base.servers, *view.servers)} - alive)
        with self.table.gate.exclusive():
            if view.epoch <= self.table.view.epoch:
                return self.table.view.epoch
            held = self.table.install(view, self.steps.set_groups_locked)
            forget_departed_writers(view, held)
            self.metrics.epoch.set(view.epoch)
            self._update_usage_metrics()
            if self.on_epoch is not None:
                self.on_epoch(view.epoch)
        # work the new map may unlock: resync listed backups (one that cannot be reached
        # stays marked, it does not fail the install), apply completed SYNC steps
        self.forwarder.resync_marked()
        self.steps.apply_all_ready()
        return view.epoch

    # ================================================================== data path
    def push(self, request: PushRequest, deadline: float | None = None) -> PushAck:
        """See ``PushApplier.push``; refused with ``Unavailable`` after a stall (``liveness``)."""
        self._check_live()
        return self.pusher.push(request, deadline)

    def pull(self, request: PullRequest, deadline: float | None = None,
             out_buffer=None) -> tuple[PullReply, list[np.ndarray]]:
        """See ``PullReader.pull``; refused with ``Unavailable`` after a stall (``liveness``),
        also one that began while the values were read."""
        self._check_live()
        out = self.reader.pull(request, deadline, out_buffer)
        self._check_live()
        return out

    def step(self, request: StepRequest, deadline: float | None = None, out_buffer=None) -> StepReply:
        """A worker's step against this node (the data plane's Step): its push, if any, as
        ``push``, then its pull, if any, as ``pull`` (``out_buffer`` as there). Admitted
        together (``plan.Planner.step``) and executed (``execute.step``) under one entry of the
        gate; a step no plan serves goes to ``push`` and then ``pull``, which leave the same
        state. Raises as ``push`` and ``pull`` (a refused push: nothing pulled)."""
        self._check_live()
        started = time.perf_counter()
        header = request.header
        pull = PullReply() if request.pull is not None else None
        with self.table.gate.shared():
            plan = self.planner.step(header, request.kind, request.push, request.pull)
            if plan is not None:
                in_place = out_buffer is not None and plan.pull is not None and plan.pull.nbytes <= len(out_buffer)
                writer = Writer(header.session, header.incarnation, header.sequence, header.acked_below)
                done = execute.step(self.table, plan, writer, self.forwarder, self.pusher.updates_between, pull,
                                    out_buffer if in_place else None)
        if plan is None or done is None:
            return self._step_apart(request, deadline, out_buffer)
        ack, values, applied = done
        reply = StepReply(ack)
        clock = self.steps.clocks.get(header.job)
        if plan.push is not None:
            if clock is not None:
                clock.report(header.session, int(header.clock), int(header.sequence))
            spent = applied - started
            self.metrics.observe_part("push", plan.push.rows, plan.push.nbytes, (("optimizer", spent),),
                                      plan.push.units[0].entry.optimizer, spent)
        if pull is not None:
            if clock is not None:
                pull.min_clock = clock.min_completed()
            pull.payload_bytes = plan.pull.nbytes       # type: ignore[union-attr]
            pull.in_shared_memory = in_place
            reply.pull, reply.values = pull, [] if in_place else values
            self.metrics.observe_part("pull", plan.pull.rows, plan.pull.nbytes,     # type: ignore[union-attr]
                                      (("lookup", time.perf_counter() - applied),))
            self._check_live()
        return reply

    def _step_apart(self, request: StepRequest, deadline: float | None, out_buffer) -> StepReply:
        """A Step no plan serves: its push by ``push``, then its pull by ``pull`` (each
        planned there when it can be)."""
        reply = StepReply()
        if request.push is not None:
            reply.ack = self.pusher.push(PushRequest(request.header, request.kind, [], None, request.push), deadline)
        if request.pull is not None:
            reply.pull, reply.values = self.reader.pull(PullRequest(_pull_header(request), [], None, request.pull),
                                                        deadline, out_buffer)
            self._check_live()
        return reply

    def _check_live(self) -> None:
        reason = self.liveness.refusal(self._now(), self.epoch)
        if reason is not None:
            raise Unavailable(f"server {self.name}: {reason}")

    def apply_replicated(self, epoch: int, source: str, ops: Sequence[BlockOp],
                         payload) -> tuple[int, list[BlockKey]]:
        """See ``BackupApplier.apply_replicated``."""
        return self.backup.apply_replicated(epoch, source, ops, payload)

    # ================================================================== block transfer
    def copy_blocks(self, epoch: int, refs: Sequence[tuple[str, str, int]], destination: str) -> tuple[int, int]:
        """See ``Forwarder.copy_blocks``."""
        return self.forwarder.copy_blocks(epoch, refs, destination)

    def load_blocks(self, epoch: int, source: str, snapshots: Sequence[BlockSnapshot]) -> int:
        """See ``BackupApplier.load_blocks``; then updates the usage gauges."""
        loaded = self.backup.load_blocks(epoch, source, snapshots)
        self._update_usage_metrics()
        return loaded

    def snapshot_blocks(self, refs: Sequence[tuple[str, str, int]] | None = None,
                        job: str | None = None) -> list[BlockSnapshot]:
        """See ``Forwarder.snapshot_blocks``."""
        return self.forwarder.snapshot_blocks(refs, job)

    # ================================================================== jobs
    def hold_job(self, job: str, hold: bool, seconds: float = 30.0) -> None:
        """Hold (or release) new pushes of ``job``; a hold expires after ``seconds``."""
        self.holds.hold(job, hold, seconds)

    def drop_tables(self, job: str, tables: Sequence[str] = ()) -> int:
        """Drop the blocks of ``job`` (of ``tables`` only, if given); returns how many."""
        dropped = self.table.drop(job, tables)
        self._update_usage_metrics()
        return dropped

    # ================================================================== status
    def usage(self) -> dict:
        """See ``BlockTable.usage``."""
        return self.table.usage()

    def _update_usage_metrics(self) -> None:
        self.publish_usage(self.usage())

    def publish_usage(self, u: dict) -> None:
        """Set the per-table and per-role gauges from ``usage()``."""
        self.metrics.blocks.labels("primary").set(u["primary_blocks"])
        self.metrics.blocks.labels("backup").set(u["backup_blocks"])
        self.metrics.table_parameters.clear()
        self.metrics.table_bytes.clear()
        for (job, table), (_, params, b) in u["tables"].items():
            self.metrics.table_parameters.labels(job, table).set(params)
            self.metrics.table_bytes.labels(job, table).set(b)
        lifecycle.publish(self.metrics, self.table.sparse_rows, u["tables"])   # budgets (issue 18)


def _pull_header(step: StepRequest) -> Header:
    """A Step's header as its pull's: the pull's clock."""
    h = step.header
    return Header(h.job, h.epoch, h.session, h.incarnation, h.sequence, h.acked_below, step.pull_clock,
                  h.wire_dtype)
