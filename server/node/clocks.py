"""Worker clocks of one job on one server: the state behind SYNC (BSP) and SSP (BOUNDED in the proto).

A worker's clock is its number of completed steps. During step ``t`` it pulls with clock
``t``, then pushes its gradients for step ``t`` (reporting the step to every server, with an
empty push where it has nothing to send); the server then counts ``t + 1`` completed steps.

* SSP(T): a pull with clock ``c`` waits while ``c - min(completed of live workers) > T``.
* SYNC: step ``t`` is applied once every live worker completed it; a pull with clock ``c``
  waits until ``c`` steps have been applied here.

Membership follows the shard map's worker group: a worker that joins starts at the group's
current step; one that leaves no longer holds anyone back. Thread-safe.
"""

from __future__ import annotations

import itertools
import threading
import time

from shardps.errors import DeadlineExceeded
from shardps.tables import Consistency


class JobClock:
    def __init__(self, mode: Consistency = Consistency.ASYNC, staleness: int = 0,
                 clock=time.monotonic):
        self.mode = mode
        self.staleness = staleness
        self._now = clock
        self.cond = threading.Condition()
        self.completed: dict[str, int] = {}   # session -> completed steps
        self.live: set[str] = set()
        self.ranks: dict[str, int] = {}        # session -> rank, to name workers in messages
        self.reports: dict[str, tuple[int, int]] = {}   # session -> (step, push sequence) last reported
        self.applied_steps = 0                # SYNC: steps applied on this server
        # SYNC: sessions that left with steps completed but not applied here yet: their
        # gradients of those steps are accumulated, so they count in those steps' means
        self.departed: dict[str, int] = {}    # session -> completed steps when it left
        self.closed_below = 0                 # SYNC: steps below this take no more pushes
        self.fresh = True                     # SYNC: no step applied here yet (see adopt)

    def set_members(self, sessions: set[str], mode: Consistency, staleness: int,
                    ranks: dict[str, int] | None = None) -> None:
        """The group's live sessions (``ranks``: session -> rank, for messages)."""
        with self.cond:
            self.ranks = dict(ranks or {})
            self.mode, self.staleness = mode, staleness
            start = self._min_locked() if self.live else self.applied_steps
            if mode is Consistency.SYNC:
                start = max(start, self.applied_steps)
            for s in sessions - self.live:
                self.completed[s] = max(self.completed.get(s, 0), start)
                self.departed.pop(s, None)
            for s in self.live - sessions:
                done = self.completed.pop(s, 0)
                if done > self.applied_steps:
                    self.departed[s] = done
                self.reports.pop(s, None)
            self.live = set(sessions)
            self.cond.notify_all()

    def report(self, session: str, clock: int, sequence: int = 0) -> bool:
        """``session`` pushed step ``clock`` (with push ``sequence``): it has completed
        ``clock + 1`` steps. Returns whether that is news here."""
        with self.cond:
            if sequence:
                self.reports[session] = (clock, sequence)
            if session in self.live:
                if clock + 1 > self.completed.get(session, 0):
                    self.completed[session] = clock + 1
                    self.cond.notify_all()
                    return True
            return False

    def _min_locked(self) -> int:
        return min(map(self.completed.get, self.live, itertools.repeat(0)), default=self.applied_steps)

    def _behind(self, clock: int) -> str:
        """The live workers holding a pull at ``clock`` back, with their completed steps."""
        need = clock if self.mode is Consistency.SYNC else clock - self.staleness
        behind = sorted((self.ranks.get(s, -1), done) for s in self.live
                        if (done := self.completed.get(s, 0)) < need)
        if not behind:
            return "the step to be applied"
        return ", ".join(f"rank {r} ({done} steps completed)" if r >= 0 else f"a worker ({done} steps completed)"
                         for r, done in behind)

    def min_completed(self) -> int:
        with self.cond:
            return self._min_locked()

    def workers_of(self, step: int) -> int:
        """SYNC: how many workers step ``step``'s mean is over: the live ones, and those that
        completed the step and then left before it was applied here (their gradients of it
        are accumulated). A worker that left before completing it is not counted."""
        with self.cond:
            return len(self.live) + sum(1 for done in self.departed.values() if done > step)

    def steps_to_apply(self) -> range:
        """SYNC: steps every live worker completed that are not applied here yet."""
        with self.cond:
            if not self.live:
                return range(self.applied_steps, self.applied_steps)
            return range(self.applied_steps, self._min_locked())

    def reported_by(self, session: str, step: int, sequence: int) -> bool:
        """Whether push ``sequence`` of ``session`` already reported ``step`` here."""
        with self.cond:
            return bool(session) and sequence > 0 and self.reports.get(session) == (step, sequence)

    def close(self, steps: int) -> None:
        """SYNC: steps below ``steps`` are being applied; a push for one of them is refused
        from now on (it could no longer be part of its step)."""
        with self.cond:
            self.closed_below = max(self.closed_below, steps)

    def adopt(self, step: int, pushing: bool) -> bool:
        """SYNC: a member pushes (``pushing``) or pulls ``step``. A clock that has taken no
        push and applied no step yet (this server (re)joined a running group, or the group
        is new) learns the group's step from it: steps below it are taken as applied here
        (this server holds no data of them; its blocks arrived with their state). The first
        push taken ends that. Returns whether ``step`` is open or already applied here;
        False: it is further ahead than this clock allows. A push may be one step ahead:
        every worker completed the step before (the pusher pulled its step elsewhere), and
        this server waits for a report of it that went to the servers of an older map, or
        to this server's previous incarnation; the member's next push or pull here counts as
        that report (``SyncSteps.reached``)."""
        with self.cond:
            if step > self.applied_steps + (1 if pushing and not self.fresh else 0):
                if not self.fresh:
                    return False
                self.applied_steps = self.closed_below = step
                self.cond.notify_all()
            if pushing:
                self.fresh = False
            return True

    def skip_to(self, steps: int) -> None:
        """SYNC: ``steps`` steps are applied here (none of those skipped had data)."""
        self.mark_applied(steps - 1)

    def mark_applied(self, step: int) -> None:
        with self.cond:
            self.applied_steps = max(self.applied_steps, step + 1)
            self.departed = {s: done for s, done in self.departed.items() if done > self.applied_steps}
            self.closed_below = max(self.closed_below, self.applied_steps)
            self.fresh = False
            self.cond.notify_all()

    def wait_for_pull(self, clock: int, deadline: float | None) -> int:
        """Block until a pull at ``clock`` may proceed; returns the staleness at the pull
        (``clock - min completed``). Raises DeadlineExceeded past ``deadline``."""
        with self.cond:
            while True:
                low = self._min_locked()
                if self.mode is Consistency.BOUNDED:
                    ready = clock - low <= self.staleness
                elif self.mode is Consistency.SYNC:
                    ready = self.applied_steps >= clock
                else:
                    ready = True
                if ready:
                    return max(0, clock - low)
                remaining = None if deadline is None else deadline - self._now()
                if remaining is not None and remaining <= 0:
                    what = (f"staleness {clock - low} > {self.staleness}"
                            if self.mode is Consistency.BOUNDED
                            else f"step {clock - 1} not applied yet ({self.applied_steps} applied)")
                    raise DeadlineExceeded(
                        f"pull at clock {clock} waited until the deadline for {self._behind(clock)}: "
                        f"{what}; is a worker stuck, or not reporting its steps to this server?")
                self.cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
