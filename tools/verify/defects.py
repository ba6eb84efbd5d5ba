"""TEST-ONLY: re-introduce fixed defects of issue 13 (and one of issue 18), to show the
verifier catches them.

``shardps server`` reads the environment variable ``SHARDPS_TEST_REINTRODUCE_DEFECT`` once,
at its start, and hands it to its node (``ServerProcessSettings.test_defect``,
``ServerNode(defect=...)``); the node's layers read no environment:

* ``1``: a map install does not prune copy destinations from a primary's forwarding set
  (``server/node/table.py``, ``BlockTable.install``): after a block copy, the destination's
  death makes the primary forward to it forever (pushes end DEADLINE_EXCEEDED).
* ``2``: a SYNC push for a step already applied is acknowledged and dropped
  (``server/node/steps.py``, ``SyncSteps.check_step_open``) instead of refused.
* ``3``: backups skip the lifecycle decisions their primary forwards with an APPLY op (ids
  not admitted, ids evicted; ``server/node/backup.py``, ``BackupApplier``): replicas
  of a block with a lifecycle policy diverge at the same version (the run's replica check,
  ``lifecycle`` job; ``tests/test_lifecycle_replicas.py``).

Never set it outside tests: it makes the servers lose acknowledged updates on purpose.
``tests/test_torture.py`` and ``tests/test_lifecycle_replicas.py`` pass it to the verifier's
servers only (``RunConfig.defect``).
"""

ENV = "SHARDPS_TEST_REINTRODUCE_DEFECT"
DEFECTS = {
    "1": "copy destinations are not pruned on map install (a second failure after re-replication)",
    "2": "a SYNC push for an applied step is acknowledged and dropped",
    "3": "backups skip forwarded eviction and admission decisions (replicas diverge)",
}
