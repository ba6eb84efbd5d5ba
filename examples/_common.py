"""What the examples share: the --job / --keep-job flags and the end of a run (leave the
group, end the job unless --keep-job). Imported as ``_common``: each example runs as a
script (``python examples/dlrm.py``), so its own folder is first on ``sys.path``."""

from __future__ import annotations

import argparse

from shardps.errors import PermissionDenied
from shardps.worker import PSClient


def add_job_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """--job (default ``default``) and --keep-job."""
    parser.add_argument("--job", default=default, help=f"the job's name (default: {default}); the run ends it, so "
                        "the next run starts from fresh tables (--keep-job keeps its tables for a later run)")
    parser.add_argument("--keep-job", action="store_true", help="do not end the job at the end of the run")


def finish_job(client: PSClient, keep_job: bool) -> None:
    """Leave the worker group; unless ``keep_job``, end the job, so that its tables go and a
    second run starts fresh, not from these (without the admin token, say that they stay)."""
    client.leave()
    if keep_job:
        return
    try:
        client.end_job()
    except PermissionDenied:
        print("the job's tables stay: ending a job needs the admin token; name a fresh --job "
              "next time", flush=True)
