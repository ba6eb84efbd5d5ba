"""Per-job admission control on a server: no job may crowd the others out.

``Admission.admit(job, nbytes)`` runs before a job's data request (Push, Pull, each half of an
Exchange) is applied. It refuses with ``AdmissionRefused`` (RESOURCE_EXHAUSTED, with a retry
hint in seconds) when the job is over either limit on this server:

* **request rate**: a token bucket per job, ``rate`` requests per second with bursts of
  ``burst`` requests (default: a tenth of a second's worth, at least 8);
* **bytes in flight**: the payload bytes of the job's requests being applied right now,
  at most ``max_bytes_in_flight`` (one request larger than that is still admitted when the
  job has nothing else in flight, so no request size is refused forever).

Refused requests cost the server a dictionary lookup; nothing queues, so a flooding job gets
refusals at once instead of a growing queue, and the other jobs keep the server's threads.
The retry hint is at least ``min_retry`` seconds (default 50 ms), and the data plane reads
nothing more from a refused connection before the hint has passed
(``shardps.rpc.dataplane_server``): a client that ignores the hint is slowed by TCP's flow
control instead of making the server read and refuse its requests as fast as it sends them.
A limit of 0 turns that limit off; ``Admission()`` admits everything. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from shardps.errors import ResourceExhausted


class AdmissionRefused(ResourceExhausted):
    """RESOURCE_EXHAUSTED from admission control; ``retry_after``: seconds to wait (at least
    the ``Admission``'s ``min_retry``)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class _Job:
    __slots__ = ("tokens", "stamp", "in_flight", "refused")

    def __init__(self, tokens: float, stamp: float):
        self.tokens = tokens
        self.stamp = stamp
        self.in_flight = 0
        self.refused = 0


class Admission:
    """Per-job request rate and bytes in flight on one server (see the module docstring)."""

    def __init__(self, rate: float = 0.0, max_bytes_in_flight: int = 0, burst: float = 0.0,
                 where: str = "this server", clock: Callable[[], float] = time.monotonic,
                 min_retry: float = 0.05):
        if rate < 0 or max_bytes_in_flight < 0 or burst < 0 or min_retry < 0:
            raise ValueError(f"admission limits must be >= 0 (0: off), got rate={rate}, "
                             f"max_bytes_in_flight={max_bytes_in_flight}, burst={burst}, "
                             f"min_retry={min_retry}")
        self.min_retry = float(min_retry)
        self.rate = float(rate)
        self.burst = float(burst) or max(8.0, self.rate / 10)
        self.max_bytes_in_flight = int(max_bytes_in_flight)
        self.where = where
        self.clock = clock
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.rate or self.max_bytes_in_flight)

    @contextmanager
    def admit(self, job: str, nbytes: int = 0) -> Iterator[None]:
        """Hold ``nbytes`` of ``job``'s in-flight budget while the block runs; refuse with
        ``AdmissionRefused`` when the job is over its rate or its bytes in flight."""
        if not self.enabled:
            yield
            return
        self._enter(job, nbytes)
        try:
            yield
        finally:
            with self._lock:
                self._jobs[job].in_flight -= nbytes

    def _enter(self, job: str, nbytes: int) -> None:
        now = self.clock()
        with self._lock:
            j = self._jobs.get(job)
            if j is None:
                j = self._jobs[job] = _Job(self.burst, now)
            if self.rate:
                j.tokens = min(self.burst, j.tokens + (now - j.stamp) * self.rate)
                j.stamp = now
                if j.tokens < 1.0:
                    j.refused += 1
                    wait = max(self.min_retry, (1.0 - j.tokens) / self.rate)
                    raise AdmissionRefused(
                        f"job {job!r} is over its request rate on {self.where} ({self.rate:g} "
                        f"requests/s, bursts of {self.burst:g}): retry in {wait:.3f} s", wait)
            limit = self.max_bytes_in_flight
            if limit and j.in_flight and j.in_flight + nbytes > limit:
                j.refused += 1
                wait = max(self.min_retry, 0.01)
                raise AdmissionRefused(
                    f"job {job!r} has {j.in_flight} bytes in flight on {self.where}; with {nbytes} "
                    f"more it would pass its limit of {limit}: retry in {wait:.3f} s", wait)
            if self.rate:
                j.tokens -= 1.0
            j.in_flight += nbytes

    def refused(self, job: str) -> int:
        """How many of ``job``'s requests were refused here."""
        j = self._jobs.get(job)
        return j.refused if j is not None else 0
