"""Whether a server that stopped running for a while may still serve its blocks.

The manager declares a server dead once it has not heard from it for its lease
(``lease_seconds``) and gives its blocks to their backups. A server process that was stopped
(SIGSTOP, a frozen VM, a swap storm) cannot know that happened: when it runs again it still
holds its old map, and a client whose map is as old (its pull was waiting in the server's
socket) would be answered from blocks that newer pushes, acknowledged by the new primary,
never reached. So a server that notices it did not run for ``stall_seconds`` refuses data
requests until a heartbeat sent after the stall is answered and the map that heartbeat
reported is installed: either it is still the primary (nothing changed) or the new map fences
the old clients with ``StaleEpoch`` (the manager answers a server it declared dead with
``FailedPrecondition``, and it registers again, empty).

``stall_seconds`` is shorter than the time the manager needs to declare the server dead (its
lease less two heartbeat intervals), so a stall the server does not notice cannot have cost
it its blocks. A manager that is down does not stop the data path: the ticks go on, only a
stall of the process itself counts. A network partition between a running server and the
manager is not detected here.

Plain and thread-safe: ``tick`` from a thread that wakes often (``ServerProcess``'s stall
watch), ``heartbeat_sent`` / ``heartbeat_answered`` from the heartbeat loop, ``refusal`` on
each data request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


def stall_seconds(lease_seconds: float, heartbeat_seconds: float) -> float:
    """The longest a server may go without running and keep serving: its lease less two
    heartbeat intervals (the last heartbeat the manager heard may be one interval older than
    the stall, and be one interval in flight), at least one interval."""
    return max(heartbeat_seconds, lease_seconds - 2.0 * heartbeat_seconds)


@dataclass
class Stall:
    """A stall noticed at ``noticed`` (monotonic seconds), after ``lasted`` seconds without a
    tick; ``epoch``: the manager's epoch as a heartbeat sent after it reported (None: not yet)."""

    noticed: float
    lasted: float
    epoch: int | None = None


class Liveness:
    """See the module docstring. Until ``configure`` (a node without a manager: tests, tools)
    it never refuses."""

    def __init__(self):
        self._lock = threading.Lock()
        self.stall_seconds: float | None = None
        self._last_tick = 0.0
        self.stall: Stall | None = None     # the stall requests are refused for, if any
        self.last_stall: Stall | None = None
        self.stalls = 0                     # stalls noticed so far

    def configure(self, lease_seconds: float, heartbeat_seconds: float, now: float) -> None:
        """Start watching: the manager's lease and heartbeat interval for this server."""
        with self._lock:
            self.stall_seconds = stall_seconds(lease_seconds, heartbeat_seconds)
            self._last_tick = now

    def tick(self, now: float) -> None:
        """This process runs at ``now``; a tick after a stall notices it."""
        with self._lock:
            self._notice(now)
            self._last_tick = max(self._last_tick, now)

    def heartbeat_sent(self, now: float) -> float:
        """A heartbeat is being sent at ``now`` (a stall before it is noticed first); returns
        ``now``, to pass to ``heartbeat_answered``."""
        self.tick(now)
        return now

    def heartbeat_answered(self, sent: float, epoch: int) -> None:
        """The heartbeat sent at ``sent`` was answered: the manager's map is at ``epoch`` and
        this server is still registered."""
        with self._lock:
            if self.stall is not None and sent >= self.stall.noticed:
                self.stall.epoch = epoch if self.stall.epoch is None else max(self.stall.epoch, epoch)

    def refusal(self, now: float, installed_epoch: int) -> str | None:
        """Why a data request must be refused at ``now`` with map ``installed_epoch``
        installed; None: serve it."""
        last = self._last_tick      # read before ``stall``: a tick moves it past a stall only after setting ``stall``
        if self.stall is None and (self.stall_seconds is None or now - last <= self.stall_seconds):
            return None             # no stall, none to notice: the common case, without the lock
        with self._lock:
            self._notice(now)
            stall = self.stall
            if stall is None:
                return None
            if stall.epoch is not None and installed_epoch >= stall.epoch:
                self.stall = None
                return None
            return (f"this server did not run for {stall.lasted:.1f} s (stopped or starved; longer than "
                    f"{self.stall_seconds:.1f} s) and may have been replaced: it serves again once the "
                    f"manager has answered it; ask the manager for the current map")

    def _notice(self, now: float) -> None:
        if self.stall_seconds is None or self.stall is not None:
            return
        lasted = now - self._last_tick
        if lasted > self.stall_seconds:
            self.stall = self.last_stall = Stall(noticed=now, lasted=lasted)
            self.stalls += 1
