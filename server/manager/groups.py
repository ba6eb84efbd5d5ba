"""Worker groups: joining (ranks, sessions, incarnations), leaving, heartbeats, leases.

Functions of (``ManagerState``, arguments, ``now``); no I/O, no clock of their own. Every
membership change bumps the job's ``membership_version`` and, once, the epoch.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

from shardps.errors import FailedPrecondition, NotFound
from shardps.server.manager.records import JobRecord, MemberRecord
from shardps.tables import Consistency

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState

log = logging.getLogger("shardps.manager")


def open_client(st: ManagerState, job_name: str, name: str, now: float) -> MemberRecord:
    """A session for a client outside the worker group: its pushes are deduplicated like a
    member's (servers keep the exactly-once records of every session the map lists), it has
    no rank and no step of the group. Bumps the epoch (servers learn the writer)."""
    job = st.job(job_name)
    client = MemberRecord(-1, secrets.token_hex(8), 1, name, last_heartbeat=now)
    job.clients[client.session] = client
    st.bump()
    log.info("client %s of job %s opened session %s", name or "(unnamed)", job_name, client.session)
    return client


def join(st: ManagerState, job_name: str, name: str, rank_hint: int, previous_session: str,
         consistency: Consistency | None, staleness: int, now: float) -> MemberRecord:
    job = st.job(job_name)
    if consistency is not None and (consistency, staleness if consistency is Consistency.BOUNDED
                                    else job.staleness) != (job.consistency, job.staleness):
        raise FailedPrecondition(
            f"job {job_name!r} runs {job.consistency} (staleness {job.staleness}); "
            f"this worker asked for {consistency} (staleness {staleness})")
    taken = {m.rank: m for m in job.members.values()}
    replaced = None
    step = 0                       # what the rank had completed before, when it takes its place again
    if previous_session and previous_session in job.members:
        replaced = job.members[previous_session]
    elif name:
        replaced = next((m for m in job.members.values() if m.name == name), None)
    if replaced is not None:
        session, rank, incarnation = replaced.session, replaced.rank, replaced.incarnation + 1
        step = replaced.step
        del job.members[replaced.session]
    elif previous_session and previous_session in job.departed:
        rank, last_incarnation, *was = job.departed.pop(previous_session)
        session, incarnation, step = previous_session, last_incarnation + 1, (was[0] if was else 0)
        if rank in taken:
            rank = lowest_free(taken)
    else:
        session, incarnation = secrets.token_hex(8), 1
        rank = rank_hint if rank_hint >= 0 and rank_hint not in taken else lowest_free(taken)
    member = MemberRecord(rank, session, incarnation, name, last_heartbeat=now, step=step)
    job.members[session] = member
    job.membership_version += 1
    job.peak_members = max(job.peak_members, len(job.members))
    st.bump()
    log.info("worker %s joined job %s as rank %d (incarnation %d)", name or session, job_name,
             rank, incarnation)
    return member


def leave(st: ManagerState, job_name: str, session: str, step: int = 0) -> int:
    """A member leaves its group, or a client ends its session (idempotent), having completed
    ``step`` steps."""
    job = st.job(job_name)
    m = job.members.get(session) or job.clients.get(session)
    if m is not None and step > m.step:
        m.step = step                        # kept with its rank (``departed``)
    if m is not None and step > job.step:
        job.step = step
        st.unsaved = True
    if session in job.members:
        remove_member(job, session)
        st.bump()
    elif job.clients.pop(session, None) is not None:
        st.bump()
    return job.membership_version


def remove_member(job: JobRecord, session: str) -> None:
    """A member leaves (or its lease expired). Once none is left the group's peak starts again:
    the job's next run waits for its own workers, not for those of the last one."""
    m = job.members.pop(session)
    job.departed[session] = [m.rank, m.incarnation, m.step]
    job.membership_version += 1
    if not job.members:
        job.peak_members = 0


def worker_heartbeat(st: ManagerState, job_name: str, session: str, incarnation: int, step: int,
                     samples_per_second: float, loss: float, now: float) -> tuple[JobRecord, MemberRecord]:
    job = st.job(job_name)
    m = job.members.get(session) or job.clients.get(session)
    if m is None or m.incarnation != incarnation:
        raise NotFound(
            f"session {session!r} (incarnation {incarnation}) is not a member of job "
            f"{job_name!r}: its lease expired or a newer incarnation joined; join again")
    m.last_heartbeat, m.step, m.samples_per_second, m.loss = now, step, samples_per_second, loss
    job.step = max(job.step, step)       # saved with the next change (leaving saves it)
    return job, m


def expire_workers(st: ManagerState, now: float) -> list[str]:
    """Remove every worker whose lease expired from its group. Does not bump the epoch: the
    caller does, once for everything that expired."""
    changed = []
    for job in st.jobs.values():
        for session, m in list(job.members.items()):
            if now - m.last_heartbeat > st.settings.worker_lease_seconds:
                log.warning("worker rank %d of job %s lease expired: removed from group",
                            m.rank, job.name)
                remove_member(job, session)
                changed.append(f"worker:{job.name}/{m.rank}")
        for session, m in list(job.clients.items()):
            if now - m.last_heartbeat > st.settings.worker_lease_seconds:
                log.info("client session %s of job %s expired", session, job.name)
                del job.clients[session]
                changed.append(f"client:{job.name}/{session}")
    return changed


def lowest_free(taken) -> int:
    rank = 0
    while rank in taken:
        rank += 1
    return rank
