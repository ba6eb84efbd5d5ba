"""Child processes that never outlive their parent.

A parent starts children with ``child_env()`` (it names the parent in SHARDPS_PARENT_PID);
each child calls ``die_with_parent`` first thing (``shardps.tools.cli.main`` does), so the kernel
ends it when the parent dies, even by SIGKILL. Used by ``shardps local`` (``LocalCluster``)
and by tests that start processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time

PARENT_ENV = "SHARDPS_PARENT_PID"


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (PR_SET_PDEATHSIG); exit
    at once if the parent ``parent_pid`` is already gone. Called first thing by children that
    ``LocalCluster`` starts (it sets SHARDPS_PARENT_PID). Done in the child, after exec: a
    ``preexec_fn`` in the parent can deadlock a process that uses gRPC threads."""
    if not parent_pid:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:
        os._exit(0)


def child_env(env: dict | None = None) -> dict:
    """An environment for a child that must not outlive this process."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def stop_processes(popens, grace: float = 10.0) -> None:
    """Stop ``popens`` (``subprocess.Popen``): SIGTERM to the running ones, then SIGKILL to
    those still running ``grace`` seconds later; returns once every one has exited."""
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in popens:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
