"""``CheckpointCoordinator``: cuts consistent checkpoints of a job and restores them. It
carries out what ``checkpoint_plan.py`` decides: the RPCs to the servers (HoldJob,
SnapshotBlocks, LoadBlocks) and the files (``checkpoint_files.py``)."""

from __future__ import annotations

import logging
import threading
import time

from shardps import names
from shardps.errors import DeadlineExceeded, FailedPrecondition, NotFound, ShardpsError, Unavailable
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.convert import spec_from_proto
from shardps.rpc.status import translated
from shardps.server.manager.checkpoint_files import latest, read_checkpoint, write_checkpoint
from shardps.server.manager.checkpoint_plan import (
    CutPlan,
    PendingCheckpoint,
    barrier_checkpoint_id,
    live_servers,
    on_demand_checkpoint_id,
    plan_cut,
    plan_load,
    restore_tables,
)
from shardps.server.manager.runtime import ManagerRuntime

log = logging.getLogger("shardps.manager")


class CheckpointCoordinator:
    """Cuts consistent checkpoints of a job and restores them. Thread-safe.

    With live workers, every one of them stops at a step boundary and arrives at a barrier
    (``barrier``) with its local state; once all live workers arrived, the job's pushes are
    held on every server, each table's blocks are copied from their primaries and written
    with the workers' states (``checkpoint_files.py``), then everything resumes.
    Without live workers the servers' hold alone makes the cut consistent.
    """

    def __init__(self, rt: ManagerRuntime, default_dir: str = "", barrier_timeout: float = 120.0):
        self.rt = rt
        self.default_dir = default_dir
        self.barrier_timeout = barrier_timeout
        self._cond = threading.Condition()
        self._pending: dict[str, PendingCheckpoint] = {}
        self._requests: dict[str, str] = {}             # job -> on-demand checkpoint id

    def requested(self, job: str) -> str:
        with self._cond:
            return self._requests.get(job, "")

    def _directory(self, directory: str, field: str = "directory") -> str:
        """``directory`` of a request resolved inside the checkpoint root (``names.inside_root``):
        the root itself when empty; FailedPrecondition without a root, InvalidArgument outside."""
        return str(names.inside_root(directory, self.default_dir, field))

    def _live(self, job: str) -> dict[str, tuple[int, str]]:
        """The job's live workers: session -> (rank, name)."""
        with self.rt.lock:
            rec = self.rt.state.job(job)
            return {m.session: (m.rank, m.name) for m in rec.members.values()}

    @staticmethod
    def _missing(p: PendingCheckpoint, live: dict[str, tuple[int, str]]) -> str:
        """The live workers (``_live``) that have not arrived, as ``rank 1 ('name')``."""
        missing = sorted(live[s] for s in set(live) - set(p.arrived))
        return ", ".join(f"rank {rank} ({name!r})" if name else f"rank {rank}" for rank, name in missing)

    # ------------------------------------------------------------------ the barrier
    def barrier(self, job: str, session: str, step: int, state: bytes, checkpoint_id: str,
                directory: str = "", deadline: float | None = None) -> str:
        """A worker's arrival; returns the checkpoint's path once it is written."""
        live = self._live(job)
        if session not in live:
            raise NotFound(f"session {session!r} is not a live member of job {job!r}: join first")
        with self._cond:
            p = self._pending.get(job)
            if p is None or p.done:
                p = self._pending[job] = PendingCheckpoint(barrier_checkpoint_id(checkpoint_id, step),
                                                           self._directory(directory))
            p.arrived[session] = (live[session][0], step, state)
            self._cond.notify_all()
        return self._wait(job, p, deadline)

    def request(self, job: str, directory: str = "", deadline: float | None = None) -> str:
        """An on-demand checkpoint (admin): asks the live workers to arrive, or cuts directly."""
        directory = self._directory(directory)
        live = self._live(job)
        with self._cond:
            p = self._pending.get(job)
            if p is None or p.done:
                p = self._pending[job] = PendingCheckpoint(on_demand_checkpoint_id(time.time()), directory)
            if live:
                self._requests[job] = p.id
        return self._wait(job, p, deadline)

    def _wait(self, job: str, p: PendingCheckpoint, deadline: float | None) -> str:
        start = time.monotonic()
        waited = f"{self.barrier_timeout:g} s"             # the seconds the message reports
        limit = start + self.barrier_timeout
        if deadline is not None and deadline < limit:       # the call's deadline comes first
            limit = deadline
            waited = f"{max(0.0, deadline - start):.1f} s (the request's deadline)"
        while True:
            with self._cond:
                if p.done:
                    if p.error is not None:
                        raise p.error
                    return p.path
                live = self._live(job)
                if p.ready({session: rank for session, (rank, _) in live.items()}):
                    p.taking = True
                elif time.monotonic() > limit:
                    raise DeadlineExceeded(
                        f"checkpoint {p.id} of job {job!r}: {self._missing(p, live)} of "
                        f"{len(live)} live worker(s) did not reach the checkpoint barrier within "
                        f"{waited}; nothing was written. Workers join a checkpoint "
                        f"at a step boundary: shardps worker does it by itself; a custom loop calls "
                        f"ps_model.maybe_checkpoint() once per step (or client.checkpoint_barrier() "
                        f"when client.checkpoint_request is set). Stop those workers, or let them "
                        f"leave the group, and ask again")
                else:
                    self._cond.wait(timeout=0.2)
                    continue
            try:
                p.path = str(self.cut(job, p))
            except ShardpsError as exc:
                p.error = exc
            finally:
                with self._cond:
                    p.done = True
                    if self._requests.get(job) == p.id:
                        del self._requests[job]
                    self._cond.notify_all()

    # ------------------------------------------------------------------ cut and restore
    def cut(self, job: str, p: PendingCheckpoint):
        """Hold the job's pushes, copy every block from its primary, write the files."""
        msg = self.rt.published
        plan = plan_cut(msg, job)
        self._hold(plan.hold, job, True)
        try:
            if plan.unplaced:
                raise Unavailable(plan.unplaced)
            snapshots = self._snapshot(msg, plan)
            workers = p.worker_states()
            p.step = p.last_step()
            path = write_checkpoint(p.directory, job, p.id, p.step, plan.consistency, plan.tables,
                                    snapshots, workers)
            log.info("checkpoint of job %s written to %s (%d tables, %d workers)", job, path,
                     len(plan.tables), len(workers))
            return path
        finally:
            self._hold(plan.hold, job, False)

    def _snapshot(self, msg: pb.ShardMap, plan: CutPlan) -> dict[str, list]:
        """Every block of the plan (made from ``msg``), from its primary: table -> snapshots."""
        from shardps.rpc.chunks import decode_snapshots
        snapshots: dict[str, list] = {t.spec.name: [] for t in plan.tables}
        for index, refs in plan.snapshots.items():
            server = msg.servers[index]
            with translated(f"snapshot from {server.name}"):
                stream = self.rt.pool.get(server.address).SnapshotBlocks(
                    ps.SnapshotBlocksRequest(epoch=plan.epoch, blocks=refs), timeout=120,
                    metadata=self.rt.pool.metadata)
                _, snaps = decode_snapshots(stream)
            for snap in snaps:
                snapshots[snap.header.ref.table].append(snap)
        return snapshots

    def _hold(self, servers, job: str, hold: bool) -> None:
        for s in servers:
            try:
                with translated(f"hold job {job} on {s.name}"):
                    self.rt.pool.get(s.address).HoldJob(ps.HoldJobRequest(job=job, hold=hold, hold_seconds=60),
                                                        timeout=30, metadata=self.rt.pool.metadata)
            except ShardpsError as err:
                if hold:
                    raise
                log.warning("releasing the hold of job %s on %s failed (it expires by itself): %s",
                            job, s.name, err.details)

    def restore(self, job: str, path: str) -> tuple[int, int, int]:
        """Recreate the job's tables from a checkpoint onto the current servers.
        Returns (epoch, step, tables). Run it with the job's workers stopped."""
        if not path:
            found = latest(self._directory(""), job)
            if found is None:
                raise NotFound(f"no checkpoint of job {job!r} under {self.default_dir}")
            path = str(found)
        else:
            path = self._directory(path, "path")
        ck = read_checkpoint(path)
        mode, staleness, tables = restore_tables(ck, job, path)
        # No block moves while the restored blocks are empty (a copy would carry the empty
        # state to a replica the next map lists), and the job's pushes are held from before
        # the tables are recreated until their values are loaded: when this returns, every
        # block is readable with the checkpoint's values on the replicas the map names.
        with self.rt.moves_lock:
            servers = live_servers(self.rt.published)
            self._hold(servers, job, True)
            try:
                self.rt.change(lambda s: s.restore_job(job, mode, staleness, tables, path,
                                                       ck.step, list(ck.workers)))
                msg = self.rt.published
                self._load(msg, job, ck.blocks)
            finally:
                self._hold(servers, job, False)
        log.info("job %s restored from %s (step %d) onto %d servers", job, path, ck.step, len(servers))
        return msg.epoch, ck.step, len(tables)

    def _load(self, msg: pb.ShardMap, job: str, blocks: dict[str, list]) -> None:
        """Send ``blocks`` (table -> snapshots in block order; None: skip that block) of ``job``
        to every replica ``msg`` lists."""
        from shardps.rpc.stubs import encode_snapshots
        for index, snaps in plan_load(msg, job, blocks).items():
            server = msg.servers[index]
            with translated(f"load blocks on {server.name}"):
                self.rt.pool.get(server.address).LoadBlocks(
                    encode_snapshots(snaps, msg.epoch), timeout=300,
                    metadata=self.rt.pool.metadata + (("x-shardps-source", "manager"),))

    # ------------------------------------------------------------------ lost blocks
    def recover_lost(self) -> None:
        """Restore every job's pending lost blocks (``DataLoss`` PENDING) from the job's
        latest checkpoint: hold the job's pushes, load the checkpoint's copies of those
        blocks on every replica the map lists, then serve them again (the loss records say
        from which checkpoint and step). A job without a usable checkpoint gives up: its
        lost blocks then refuse requests with DATA_LOSS until they are restored or reset.
        Called by the manager's reconcile loop (``ManagerRuntime.after_tick``)."""
        with self.rt.lock:
            pending = {d_job: self.rt.state.lost_blocks(d_job) for d_job, rec in self.rt.state.jobs.items()
                       if any(d.recovery == "pending" for d in rec.data_loss)}
        for job, lost in pending.items():
            try:
                path, ck = self._checkpoint_for(job, lost)
                with self.rt.moves_lock:
                    self._restore_blocks(job, lost, path, ck)
            except ShardpsError as exc:
                detail = f"not restored: {exc.message}"
                log.error("job %s: %d lost block(s) cannot be restored (%s); requests touching them "
                          "fail with DATA_LOSS until `shardps restore %s` or `shardps reset-lost %s TABLE`",
                          job, sum(map(len, lost.values())), exc.message, job, job)
                self.rt.change(lambda s, d=detail, j=job: s.give_up_recovery(j, d))

    def _checkpoint_for(self, job: str, lost: dict[tuple[str, str], list[int]]):
        """The latest checkpoint of ``job`` and its contents; NotFound / FailedPrecondition
        when there is none, or when it lacks a lost table as it is now (another spec)."""
        if not self.default_dir:
            raise NotFound("the manager has no checkpoint directory (--checkpoint-dir)")
        found = latest(self.default_dir, job)
        if found is None:
            raise NotFound(f"job {job!r} has no checkpoint under {self.default_dir}")
        ck = read_checkpoint(found)
        specs = {spec_from_proto(spec).name: spec_from_proto(spec) for spec, _ in ck.table_specs()}
        with self.rt.lock:
            current = {table: self.rt.state.table(job, table).spec for _, table in lost}
        for table, spec in current.items():
            if specs.get(table) != spec:
                raise FailedPrecondition(f"checkpoint {found} does not hold table {table!r} as it is "
                                         f"now (created again since?)")
        return str(found), ck

    def _restore_blocks(self, job: str, lost: dict[tuple[str, str], list[int]], path: str, ck) -> None:
        """Load checkpoint ``ck``'s copies of ``lost`` blocks on their replicas, the job's
        pushes held meanwhile, then mark them restored (moves_lock held: no block moves)."""
        servers = live_servers(self.rt.published)
        self._hold(servers, job, True)
        try:
            msg = self.rt.published
            wanted = {table: set(blocks) for (_, table), blocks in lost.items()}
            snaps = {table: [s if s.header.ref.block in wanted.get(table, ()) else None for s in blocks]
                     for table, blocks in ck.blocks.items() if table in wanted}
            self._load(msg, job, snaps)
            for (_, table), blocks in lost.items():
                self.rt.change(lambda s, t=table, b=blocks: s.recover_lost(job, t, b, "restored", path, ck.step))
        finally:
            self._hold(servers, job, False)
        log.warning("job %s: %d lost block(s) of %s restored from checkpoint %s (step %d): their updates "
                    "after step %d are lost", job, sum(map(len, lost.values())),
                    sorted(t for _, t in lost), path, ck.step, ck.step)

    def worker_state(self, job: str, rank: int, newest: bool = False) -> tuple[bytes, int]:
        """The state worker ``rank`` of a restored ``job`` resumes from, and its step; the
        rank is no longer pending a restore (persisted). ``newest``: from the job's latest
        checkpoint instead, restored or not (NotFound when there is none)."""
        if newest:
            found = latest(self.default_dir, job) if self.default_dir else None
            if found is None:
                raise NotFound(f"job {job!r} has no checkpoint under the manager's --checkpoint-dir "
                               f"({self.default_dir or 'none set'})")
            path = str(found)
            ck = read_checkpoint(path, verify=False)
            step = ck.step
        else:
            path, step = self.rt.change(lambda s: s.claim_restored_state(job, rank), wait_published=False)
            if not path:
                raise NotFound(f"job {job!r} was not restored from a checkpoint")
            ck = read_checkpoint(path, verify=False)
        if rank not in ck.workers:
            raise NotFound(f"checkpoint {path} holds no state for rank {rank} "
                           f"(ranks: {sorted(ck.workers)})")
        return ck.workers[rank], step
