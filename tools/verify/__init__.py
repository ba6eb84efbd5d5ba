"""A seeded fault-schedule verifier (in the spirit of Jepsen and FoundationDB's simulation).

``python -m shardps.tools.verify`` (``make torture``) starts a real cluster of processes (a manager
and servers with ``--replication 2``, ``shardps.tools.local.LocalCluster``), runs client workers
that push counter increments whose every acknowledged push adds an exact integer to known
rows, injects the faults of a schedule drawn from a seed (printed, so any run replays), and
lets a checker decide (``--managers 3``: three manager replicas on a real etcd, whose leader
is killed and cut off from etcd among the faults):

* every acknowledged push applied exactly once per block (0 lost, 0 doubled); a push whose
  outcome is unknown (deadline, refused) at most once;
* reads started after an acknowledgement reflect it, and values never go backwards;
* the longest window without an acknowledged push (per job) stays <= 5 s;
* R is restored (no under-replicated block) after every failure that left >= R servers;
* server RSS growth after warm-up stays <= 10 %;
* at the end (healed, workloads stopped, final read done) every block's replicas are
  bit-identical: same version and same digest (``GetBlockDigests``, ``server/node/digest.py``)
  on every live server that holds it.

Modules: ``cluster`` (processes and faults on them), ``workload`` (workers, readers and the
history), ``schedule`` (the seeded fault episodes), ``checker`` (figures and verdict),
``run`` (one schedule end to end), ``__main__`` (the command line). ``defects`` documents the
test-only switch that re-introduces fixed defects so the tests can show they are caught.
"""

from shardps.tools.verify.checker import Verdict
from shardps.tools.verify.run import RunConfig, run_schedule

__all__ = ["RunConfig", "Verdict", "run_schedule"]
