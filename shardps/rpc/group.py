"""The worker group's manager calls (``JoinWorkerGroup``, ``LeaveWorkerGroup``,
``WorkerHeartbeat``, ``CheckpointBarrier``, ``GetWorkerState``): plain arguments in, the plain
values of ``shardps.group`` out. ``caller`` makes the call: an object with ``stub`` (the
manager's ``ManagerStub``) and ``call(what, fn, request, timeout, idempotent=)``, which honours
the deadline, retries what may be retried and raises ``ShardpsError`` (the client's ``Admin``)."""

from __future__ import annotations

from typing import Any

from shardps.group import Heartbeat, Joined
from shardps.protos.v1 import manager_pb2 as mg


def join(caller: Any, job: str, name: str = "", rank_hint: int = -1, previous_session: str = "",
         client: bool = False, timeout: float | None = None) -> Joined:
    """Join ``job``'s worker group (``client``: a session beside it, without a rank)."""
    resp = caller.call("JoinWorkerGroup", caller.stub.JoinWorkerGroup, mg.JoinWorkerGroupRequest(
        job=job, name=name, rank_hint=rank_hint, previous_session=previous_session, client=client), timeout)
    return Joined(-1 if client else resp.rank, resp.session, resp.incarnation, len(resp.group.members),
                  resp.epoch, resp.heartbeat_seconds, resp.restored, int(resp.step))


def leave(caller: Any, job: str, session: str, step: int = 0, timeout: float | None = None,
          idempotent: bool = False) -> None:
    """End ``session`` (``step``: the steps it completed, which the job keeps)."""
    caller.call("LeaveWorkerGroup", caller.stub.LeaveWorkerGroup,
                mg.LeaveWorkerGroupRequest(job=job, session=session, step=step), timeout, idempotent=idempotent)


def heartbeat(caller: Any, job: str, session: str, incarnation: int, step: int, samples_per_second: float,
              loss: float, timeout: float | None = None) -> Heartbeat:
    """Keep ``session``'s lease and report its progress."""
    resp = caller.call("WorkerHeartbeat", caller.stub.WorkerHeartbeat, mg.WorkerHeartbeatRequest(
        job=job, session=session, incarnation=incarnation, step=step, samples_per_second=samples_per_second,
        loss=loss), timeout, idempotent=True)
    return Heartbeat(resp.rank, resp.world_size, resp.epoch, resp.checkpoint_id, resp.membership_version)


def checkpoint_barrier(caller: Any, job: str, session: str, step: int, worker_state: bytes, checkpoint_id: str,
                       timeout: float | None = None) -> str:
    """This worker's part of checkpoint ``checkpoint_id``; returns the checkpoint's path."""
    return caller.call("CheckpointBarrier", caller.stub.CheckpointBarrier, mg.CheckpointBarrierRequest(
        job=job, session=session, step=step, worker_state=worker_state, checkpoint_id=checkpoint_id), timeout).path


def worker_state(caller: Any, job: str, rank: int, latest: bool = False,
                 timeout: float | None = None) -> tuple[bytes, int]:
    """Rank ``rank``'s local state from a checkpoint of ``job``, and its step."""
    resp = caller.call("GetWorkerState", caller.stub.GetWorkerState,
                       mg.GetWorkerStateRequest(job=job, rank=rank, latest=latest), timeout, idempotent=True)
    return resp.worker_state, resp.step
