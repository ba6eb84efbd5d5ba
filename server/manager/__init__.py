"""The resource manager: decides placement and membership purely, acts separately.

Decisions, from (state, arguments, ``now``), no grpc and no I/O:

* ``records.py``    the records (servers, jobs, members, tables, blocks, moves) and settings
* ``state.py``      ``ManagerState``: the records, the epoch, jobs and tables, the shard map;
                    the one object callers use (its methods delegate to the three below)
* ``servers.py``    server registration, incarnations, heartbeats, leases, draining
* ``groups.py``     worker groups: ranks, sessions, incarnations, heartbeats, leases
* ``moves.py``      placing blocks, promoting replicas, planning and committing block moves
* ``checkpoint_plan.py``  what a checkpoint cut or a restore does, from the shard map

Effects:

* ``store.py``      the state's file (``StateFile``), written after every change
* ``runtime.py``    ``ManagerRuntime``: the lock, ``change()`` (decide, persist, install,
                    publish), the reconcile loop (leases, block copies)
* ``checkpoints.py``       ``CheckpointCoordinator``: barrier, HoldJob / SnapshotBlocks /
                           LoadBlocks, checkpoint files
* ``checkpoint_files.py``  the checkpoint directory format (safetensors and a manifest)
* ``service.py``    ``ResourceManagerService``: the thin gRPC layer

This package imports nothing itself: importing ``shardps.server.manager.state`` does not
load grpc.
"""
