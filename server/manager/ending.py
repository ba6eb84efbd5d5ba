"""A cluster that lives as long as one job: ``shardps manager --exit-when-job-ends JOB``.

A launcher that starts a manager, servers and workers for one job (TorchX:
``shardps.tools.torchx_job``) ends that cluster with the job: once JOB has ended (it existed
and was ended, or ``shardps job end JOB`` was asked though it never started), the manager
answers every server's heartbeat with ``retired`` (the server exits, as a drained one does),
and exits itself when every live server has heard it, or when their leases have run out.
``JobEnding`` decides; the manager process and its service act.
"""

from __future__ import annotations

from collections.abc import Collection


class JobEnding:
    """When the cluster of ``job`` ends, and when its manager may exit."""

    def __init__(self, job: str):
        self.job = job
        self.seen = False            # the job existed
        self.asked = False           # EndJob named it (also before it existed: a failed start)
        self.closed = False          # the job ended: every server is told to exit
        self.told: set[str] = set()  # servers answered ``retired`` since

    def end_asked(self, job: str) -> None:
        """An EndJob call named ``job``."""
        self.asked = self.asked or job == self.job

    def job_ended(self, jobs: Collection[str]) -> bool:
        """True once the job, seen in ``jobs`` before, is no longer there (or was asked to end
        and is not there)."""
        if self.job in jobs:
            self.seen = True
            return False
        return self.seen or self.asked

    def close(self) -> None:
        self.closed = True

    def tell(self, server: str) -> bool:
        """Whether ``server``'s heartbeat answer says ``retired`` (noted when it does)."""
        if self.closed:
            self.told.add(server)
        return self.closed

    def may_exit(self, live_servers: Collection[str]) -> bool:
        """Every live server has been told to exit."""
        return self.closed and set(live_servers) <= self.told
