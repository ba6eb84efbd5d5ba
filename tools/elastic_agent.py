"""``python -m shardps.tools.elastic_agent ARGS``: torch's elastic agent (``python -m
torch.distributed.run ARGS``, torchrun) as ``shardps run --elastic`` starts it: it dies with
the ``shardps run`` that started it (SHARDPS_PARENT_PID, ``children.die_with_parent``), even
when that one is killed by SIGKILL, and on its SIGTERM torchrun stops its workers. Its
workers name it as their parent, so a worker that is a ``shardps`` command dies with it."""

from __future__ import annotations

import os
import runpy

from shardps.tools.children import PARENT_ENV, die_with_parent

if __name__ == "__main__":
    parent = os.environ.get(PARENT_ENV, "")
    die_with_parent(int(parent) if parent.isdigit() else None)
    os.environ[PARENT_ENV] = str(os.getpid())
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
