"""``PSClient``: the client library of a shardps cluster, for one job.

    client = PSClient("127.0.0.1:7070", job="demo")
    client.create_job()                                  # idempotent
    client.create_dense("w", shape=(1000, 16), optimizer=sgd(lr=0.1))
    w = client.pull_dense("w")                           # float32 array of shape (1000, 16)
    client.push_dense("w", np.ones_like(w))              # applied by the servers' SGD

Contract:
* Blocking calls take ``timeout=`` (seconds; default ``PSClient.timeout``) and raise
  ``shardps.errors.ShardpsError`` subclasses, never ``grpc.RpcError``. ``*_async`` variants
  check their arguments at once, then return ``concurrent.futures.Future``; the blocking call
  does the same work in the caller's thread.
* Data calls fan out in parallel to the servers that own the touched blocks; a server that
  answers FAILED_PRECONDITION (stale epoch) or UNAVAILABLE makes the client refresh its shard
  map and re-send just that server's share, until the deadline. Pushes keep their sequence
  number across retries, so a retried push is applied once. Every push carries a session:
  the worker group's (``join``), or, for a client that did not join, its own, opened at its
  first push and ended by ``close`` (common.proto, ``RequestHeader``).
* ``clock=`` on data calls is this worker's number of completed steps (SYNC / SSP jobs:
  pulls wait as the consistency model requires, pushes report the step); default 0.
* Sparse ids are int64 (any order, repeats allowed): pulls send each distinct id once, pushes
  sum the rows of repeated ids before sending. Dense ranges are flat and half-open.
* Thread-safe: one client may be shared by threads (each call is independent, and returns
  its own results: ``PullResult`` / ``PushResult``).

Layers: ``admin.Admin`` (manager calls, shard map), ``membership.GroupMember`` (join, leave,
heartbeats, exactly-once numbers), ``data.DataPath`` (routing, retries, decoding) over a
``transport.Transport`` (``GrpcTransport`` today). This class only wires them and checks
arguments (``requests``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import weakref
from concurrent import futures
from typing import Sequence

import numpy as np

from shardps.dtypes import WireDType
from shardps.errors import InvalidArgument, ShardpsError
from shardps.group import Heartbeat
from shardps.messages import GRADIENT, INITIALIZE
from shardps.metrics import WorkerMetrics
from shardps.rpc import channels
from shardps.rpc.codec import CHUNK_BYTES
from shardps.rpc.dataplane_transport import DataPlaneTransport
from shardps.rpc.stubs import ManagerStub, StubPool
from shardps.tables import Consistency
from shardps.worker.client import requests as rq
from shardps.worker.client.admin import Admin, ManagerCalls
from shardps.worker.client.data import DataPath
from shardps.worker.client.export import TableTransfer
from shardps.worker.client.fanout import abandon_dead
from shardps.worker.client.membership import GroupMember, Membership, Session
from shardps.worker.client.results import PullResult, PushResult
from shardps.worker.client.transport import GrpcTransport, Transport

log = logging.getLogger("shardps.client")


class PSClient(ManagerCalls, TableTransfer):
    """Client of one job on a shardps cluster. See the module docstring for the contract.

    ``transport``: how data calls reach a server (default: each server's socket data plane,
    per ``data_plane``, else gRPC with the shared-memory fast path, per ``shared_memory``);
    the client closes it."""

    def __init__(self, manager: str = "", job: str = "", *, token: str = "", tls: channels.TlsConfig | None = None,
                 timeout: float = 30.0, wire_dtype: str | WireDType = "float32",
                 chunk_bytes: int = CHUNK_BYTES, threads: int = 16,
                 metrics: WorkerMetrics | None = None, shared_memory: bool = True,
                 data_plane: bool = True, transport: Transport | None = None):
        manager, job = _cluster_and_job(manager, job)
        self.manager_address = manager
        self.job = job
        self.metrics = metrics or WorkerMetrics()
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._closed = threading.Event()    # ends the retries of calls in flight
        self._channel = channels.manager_channel(manager, tls)     # "a,b,c": follows the leader
        self._manager = ManagerStub(self._channel)
        self._admin = Admin(manager, job, self._manager, self.metrics, metadata=metadata,
                            default_timeout=timeout, closed=self._closed)
        self._session = Session()
        self._member = GroupMember(self._admin, self._session)
        self._session.opener = self._member.open_client     # a session at the first push (exactly-once)
        self._calls = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-call")
        self._rpcs = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-rpc")
        if transport is None:
            transport = GrpcTransport(job, StubPool(tls=tls, metadata=metadata), self.metrics, metadata=metadata,
                                      chunk_bytes=chunk_bytes, shared_memory=shared_memory)
            if data_plane:          # servers' socket data plane where they offer one
                transport = DataPlaneTransport(job, transport, tls=tls, metadata=metadata)
        self._transport = transport
        self._admin.map_listeners.append(functools.partial(abandon_dead, transport))    # see fanout
        self._data = DataPath(job, self._transport, self._admin, self._session, executor=self._rpcs,
                              metrics=self.metrics, wire_dtype=WireDType.parse(wire_dtype),
                              chunk_bytes=chunk_bytes, default_timeout=timeout)
        self._member.completed = lambda: self._data.completed
        self._before_leaving: list[weakref.WeakMethod] = []

    def before_leaving(self, flush) -> None:
        """Run ``flush`` (a bound method, held weakly) before ``leave``,
        ``checkpoint_barrier`` and ``close``: a ``PSModel`` sends the push it holds."""
        self._before_leaving.append(weakref.WeakMethod(flush))

    def _send_held(self, closing: bool = False) -> None:
        _run_flushes(self._before_leaving, closing)

    def close(self) -> None:
        """Stop heartbeats and retries, leave nothing running. Does not leave the group
        (see ``leave``). A push a ``PSModel`` still holds is sent first; a flush that fails
        with anything but a ShardpsError (logged) is raised once everything is stopped."""
        try:
            self._send_held(closing=True)
        finally:
            self._closed.set()
            self._member.close()
            self._calls.shutdown(wait=False, cancel_futures=True)
            self._rpcs.shutdown(wait=False, cancel_futures=True)
            self._transport.close()
            self._channel.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ================================================================== settings and state
    @property
    def timeout(self) -> float:
        """Default seconds of a call without ``timeout=`` (settable: applies to later calls)."""
        return self._data.default_timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._admin.default_timeout = self._data.default_timeout = seconds

    @property
    def membership(self) -> Membership | None:
        """This client's place in the worker group (None before ``join`` / after ``leave``)."""
        m = self._session.membership
        return None if m is None or m.client else m

    @property
    def progress(self) -> dict:
        """Training progress the heartbeats report: update ``step``, ``samples_per_second``, ``loss`` in place."""
        return self._member.progress

    @property
    def checkpoint_request(self) -> str:
        """The id of an on-demand checkpoint the last heartbeat announced ("" when none)."""
        return self._member.checkpoint_request

    @property
    def clock(self) -> int:
        """The clock of the data call that completed last (any thread; read-only)."""
        return self._data.last_clock

    @property
    def last_staleness(self) -> int:
        """``PullResult.staleness`` of the pull that completed last (any thread)."""
        return self._data.last_pull.staleness

    # ================================================================== jobs, groups, operations
    def join(self, name: str = "", rank_hint: int = -1, previous_session: str = "",
             heartbeat: bool = True, timeout: float | None = None) -> Membership:
        """Join the job's worker group; starts a background heartbeat (about once a second)
        that keeps the membership lease and reports ``self.progress``. In SYNC and SSP jobs
        the client adopts the group's current step (``server_clock``): a worker that joins
        late, or a script run again in the same job, goes on from there. Under torchrun or
        ``shardps run`` (``RANK`` in the environment) it asks for rank ``RANK`` and, without
        ``name``, names itself after it, so a restarted process takes its rank back (see
        ``Membership``: ``previous_step``, and ``world_size`` at least ``WORLD_SIZE``)."""
        name, rank_hint, launched = _torchrun_place(name, rank_hint)
        membership = self._member.join(name, rank_hint, previous_session, heartbeat, timeout, launched)
        group = self.group()
        if group is not None and group.consistency is not Consistency.ASYNC:
            self._data.step = max(self._data.step, self.server_clock(timeout))
        return membership

    def leave(self, timeout: float | None = None) -> None:
        """Leave the worker group (SYNC/SSP groups stop waiting for this worker), once a
        push a ``PSModel`` holds is sent."""
        self._send_held()
        self._member.leave(timeout)

    def heartbeat(self, timeout: float | None = None) -> Heartbeat:
        return self._member.heartbeat(timeout)

    def checkpoint_barrier(self, step: int, worker_state: bytes, checkpoint_id: str = "",
                           timeout: float | None = 300.0) -> str:
        """This worker's part of a checkpoint: blocks until every live worker arrived and the
        checkpoint is written; returns its path (see ``GroupMember.checkpoint_barrier``).
        A push a ``PSModel`` holds is sent first (the checkpoint includes it)."""
        self._send_held()
        return self._member.checkpoint_barrier(step, worker_state, checkpoint_id, timeout)

    def worker_state(self, timeout: float | None = None, latest: bool = False,
                     rank: int | None = None) -> tuple[bytes, int]:
        """This rank's (``rank``'s) state and step in the job's restored (``latest``: newest) checkpoint."""
        return self._member.worker_state(timeout, latest, rank)

    # ================================================================== data: pulls
    def pull_dense(self, table: str, start: int = 0, stop: int | None = None,
                   timeout: float | None = None, clock: int | None = None) -> np.ndarray:
        """Values of the flat range [start, stop) (default: the whole table, returned in the
        table's shape; a sub-range is returned flat). float32."""
        return self._pull_dense_call(table, start, stop, timeout, clock)()

    def pull_dense_async(self, table: str, start: int = 0, stop: int | None = None,
                         timeout: float | None = None, clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._pull_dense_call(table, start, stop, timeout, clock))

    def _pull_dense_call(self, table, start, stop, timeout, clock):
        return self._pull_call([rq.dense_pull(0, self._admin.table(table), start, stop, None)], timeout, clock, True)

    def pull_rows(self, table: str, ids, timeout: float | None = None, clock: int | None = None) -> np.ndarray:
        """Rows of ``ids`` (int64, any order, repeats allowed): float32 ``[len(ids), dim]``.
        Each distinct id travels once; never-pushed rows come back at their initial value."""
        return self._pull_call([rq.rows_pull(0, self._admin.table(table), ids)], timeout, clock, True)()

    def pull_rows_async(self, table: str, ids, timeout: float | None = None,
                        clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._pull_call([rq.rows_pull(0, self.table(table), ids)], timeout, clock, True))

    def pull_many(self, requests: Sequence[tuple], timeout: float | None = None,
                  clock: int | None = None) -> PullResult:
        """Pull several tables in one round: ``requests`` are ``(table,)`` (whole dense table),
        ``(table, start, stop)`` or ``(table, ids)``. Returns values in request order (dense
        whole tables in their shape; sparse rows ``[len(ids), dim]``) with the call's
        versions, clock, waited seconds and staleness."""
        return self._pull_many_call(requests, timeout, clock)()

    def pull_many_async(self, requests: Sequence[tuple], timeout: float | None = None,
                        clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._pull_many_call(requests, timeout, clock))

    def _pull_many_call(self, requests, timeout, clock):
        requests = rq.request_list(requests, "pull")
        return self._pull_call(rq.pull_pieces(self._admin.tables_named(requests), requests), timeout, clock, False)

    def _pull_call(self, call: rq.PullCall | list, timeout, clock, values_only: bool):
        """A function running the pull ``call`` (or of its parts: (piece, output, finish) per item)."""
        rq.check_call(timeout, clock)
        pieces, outputs, finishes = call if isinstance(call, rq.PullCall) else rq.PullCall.of(call)

        def run():
            res = self._data.pull(pieces, outputs, timeout, clock)
            res.values = rq.finished(finishes, res.values)
            return res.values[0] if values_only else res
        return run

    def exchange(self, push_requests: Sequence[tuple], pull_requests: Sequence[tuple], clock: int,
                 timeout: float | None = None, report_step: bool = False) -> tuple[PushResult, PullResult]:
        """``exchange_async``, in the calling thread: ``(PushResult, PullResult)``."""
        return self._exchange_call(push_requests, pull_requests, clock, timeout, report_step)()

    def exchange_async(self, push_requests: Sequence[tuple], pull_requests: Sequence[tuple], clock: int,
                       timeout: float | None = None, report_step: bool = False) -> futures.Future:
        """``push_many(push_requests, clock=clock, report_step=...)`` then ``pull_many(
        pull_requests, clock=clock + 1)`` in one round trip per server (each server applies
        the push, then serves the pull). The future's result: ``(PushResult, PullResult)``."""
        return self._calls.submit(self._exchange_call(push_requests, pull_requests, clock, timeout, report_step))

    def _exchange_call(self, push_requests, pull_requests, clock, timeout, report_step):
        rq.check_call(timeout, clock)           # arguments checked now, the exchange run by the function returned
        push_requests, pull_requests = rq.request_list(push_requests, "push"), rq.request_list(pull_requests, "pull")
        pushes = rq.push_pieces(self._admin.tables_named(push_requests), push_requests)
        pieces, outputs, finishes = rq.pull_pieces(self._admin.tables_named(pull_requests), pull_requests)

        def run():
            pushed, pulled = self._data.exchange(pushes, pieces, outputs, timeout, clock, report_step)
            pulled.values = rq.finished(finishes, pulled.values)
            return pushed, pulled
        return run

    # ================================================================== data: pushes
    def push_dense(self, table: str, grad, start: int | None = None, timeout: float | None = None,
                   clock: int | None = None) -> PushResult:
        """Push a float32 gradient: of the whole table (in the table's shape, or flat), or,
        with ``start=``, of the flat range beginning there (flat, or whole rows beginning at
        a row boundary). Another shape or dtype is refused (InvalidArgument)."""
        return self._push_call([rq.dense_push(0, self._admin.table(table), grad, start)], timeout, clock)()

    def push_dense_async(self, table: str, grad, start: int | None = None, timeout: float | None = None,
                         clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._push_call([rq.dense_push(0, self._admin.table(table), grad, start)],
                                                  timeout, clock))

    def push_rows(self, table: str, ids, grads, timeout: float | None = None,
                  clock: int | None = None) -> PushResult:
        """Push gradient rows for ``ids`` (repeated ids are summed before sending)."""
        return self._push_call([rq.rows_push(0, self._admin.table(table), ids, grads, allow_empty=True)],
                               timeout, clock)()

    def push_rows_async(self, table: str, ids, grads, timeout: float | None = None,
                        clock: int | None = None) -> futures.Future:
        return self._calls.submit(self._push_call(
            [rq.rows_push(0, self._admin.table(table), ids, grads, allow_empty=True)], timeout, clock))

    def push_many(self, requests: Sequence[tuple], timeout: float | None = None,
                  clock: int | None = None, report_step: bool = False) -> PushResult:
        """Push several tables as one push (one sequence number): ``(table, grad)`` (dense,
        whole table), ``(table, grad, start)`` or ``(table, ids, grads)`` (sparse).
        ``report_step``: also report step ``clock`` to every server (SYNC / SSP groups)."""
        return self._push_many_call(requests, timeout, clock, report_step)()

    def push_many_async(self, requests: Sequence[tuple], timeout: float | None = None,
                        clock: int | None = None, report_step: bool = False) -> futures.Future:
        return self._calls.submit(self._push_many_call(requests, timeout, clock, report_step))

    def _push_many_call(self, requests, timeout, clock, report_step):
        requests = rq.request_list(requests, "push")
        return self._push_call(rq.push_pieces(self._admin.tables_named(requests), requests), timeout, clock,
                               report_step)

    def _push_call(self, pieces, timeout, clock, report_step: bool = False, kind: int = GRADIENT):
        rq.check_call(timeout, clock)
        return lambda: self._data.push(pieces, kind, timeout, clock, report_step)

    def initialize_dense(self, table: str, values, timeout: float | None = None) -> PushResult:
        """Write the initial values of an ASSIGNED table (the first writer wins; later calls
        are acknowledged and ignored). ``values`` covers the whole table."""
        piece = rq.initial_values(self._admin.table(table), values)
        return self._push_call([piece], timeout, None, kind=INITIALIZE)()

    # ================================================================== steps
    @property
    def current_step(self) -> int:
        """This worker's current step: the clock that pulls and pushes carry when they name
        none (``clock=``). Advanced by ``next_step`` (or leaving ``with client.step():``)."""
        return self._data.step

    def next_step(self, timeout: float | None = None) -> int:
        """End the current step: in SYNC and SSP jobs, report it to every server (SYNC
        applies a step once every worker reported it; a server this step pushed nothing to
        learns it here); then advance. Returns the new step. Not thread-safe with calls of
        the same step still running."""
        group = self.group()
        if group is not None and group.consistency is not Consistency.ASYNC:
            self.report_step(self._data.step, timeout)
        self._data.step += 1
        return self._data.step

    @contextlib.contextmanager
    def step(self, timeout: float | None = None):
        """``with client.step(): pull ...; push ...`` is one step (the block gets its number):
        ``next_step`` on leaving (not when the block raised)."""
        yield self._data.step
        self.next_step(timeout)

    def report_step(self, clock: int, timeout: float | None = None) -> None:
        """Tell every server this worker finished step ``clock`` without sending data."""
        self._data.push([], GRADIENT, timeout, clock, True)

    def server_clock(self, timeout: float | None = None) -> int:
        """The group's step as the servers see it (the largest applied / slowest clock)."""
        return self._data.server_clock(timeout)


def _cluster_and_job(manager: str, job: str) -> tuple[str, str]:
    """``manager`` and ``job``, from SHARDPS_MANAGER and SHARDPS_JOB where not given (`shardps
    run` puts both in the environment of the processes it starts)."""
    manager = os.environ.get("SHARDPS_MANAGER", "") if manager == "" else manager
    job = os.environ.get("SHARDPS_JOB", "") if job == "" else job
    if manager == "" or job == "":           # anything else is checked where it is used
        raise InvalidArgument(f"PSClient(manager={manager!r}, job={job!r}): name both, or set "
                              f"SHARDPS_MANAGER and SHARDPS_JOB (shardps run sets them)")
    return manager, job


def default_worker_name(environ=os.environ) -> str:
    """A worker's name when none is given: the host's, and under torchrun (or `shardps run`)
    its RANK after it (``host-rank1``), so the processes of one host are distinct members and
    a restarted one takes its rank back."""
    rank = environ.get("RANK", "")
    return f"{socket.gethostname()}-rank{rank}" if rank.isdigit() else socket.gethostname()


def _torchrun_place(name: str, rank_hint: int) -> tuple[str, int, int]:
    """(name, rank hint, processes launched) of a join: torchrun's (and `shardps run`'s)
    RANK where set and not given, and a name after it (``default_worker_name``); WORLD_SIZE
    (0 when not set)."""
    rank = os.environ.get("RANK", "")
    if rank.isdigit():
        rank_hint = int(rank) if rank_hint < 0 else rank_hint
        name = name or default_worker_name()
    world = os.environ.get("WORLD_SIZE", "")
    return name, rank_hint, int(world) if world.isdigit() else 0


def _run_flushes(refs: list, closing: bool) -> None:
    """Call each live weakly-held flush, dropping the refs of collected ones. While closing a
    ShardpsError is logged, not raised, and every flush runs: the first other error is raised
    after the last."""
    error: BaseException | None = None
    for ref in list(refs):
        flush = ref()
        if flush is None:
            with contextlib.suppress(ValueError):       # another thread dropped it first
                refs.remove(ref)
            continue
        try:
            flush()
        except ShardpsError as exc:
            if not closing:
                raise
            log.warning("closing with a push not sent (%s): call the model's flush() before close()", exc.message)
        except Exception as exc:
            if not closing:
                raise
            log.warning("closing: a flush before leaving failed (%r)", exc)
            error = error or exc
    if error is not None:
        raise error
