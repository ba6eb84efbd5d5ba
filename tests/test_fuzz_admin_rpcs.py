"""Fuzz what only an admin (or another server) may send, with every kind of credential.

``test_fuzz_admin_rpcs``: RegisterServer, ServerHeartbeat, DrainServer, Replicate,
InstallShardMap, CopyBlocks, LoadBlocks, SnapshotBlocks, HoldJob, DropTables, GetNodeStatus,
plus every other RPC, against a sacrificial cluster with replication. No reference: admins
may change anything. Checked: no crash, no hang, documented codes only, and that credentials
are enforced (nothing without a valid token, no admin RPC nor other job with a job token).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from shardps.protos.v1 import manager_pb2 as mg
from shardps.rpc import channels
from shardps.worker.client import ManagerStub
from tests.fuzz.admin import ADMIN, OTHER, VICTIM, run_admin, secure_cluster
from tests.fuzz.reference import Reference
from tests.fuzz.wire import DEADLINE, PS_METHODS, RM_REQUESTS, Wire
from tests.fuzz.world import World, create_data_job, data_tables, fuzz_rounds


@pytest.mark.slow          # 2,400 messages, ~30 s
@pytest.mark.timeout(600, method="thread")
def test_fuzz_admin_rpcs(make_cluster, client_factory, tmp_path):
    """Every RPC, with no token, a forged one, another job's, the job's own or the admin's, to
    a sacrificial cluster (3 servers, replication 2) holding a job with data. Without a valid
    token nothing is served; a job token never reaches an admin RPC nor another job; with the
    admin token anything goes, but the processes survive and answer in documented codes."""
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    cluster = secure_cluster(make_cluster, 3, replication=2)
    admin = client_factory(cluster.address, VICTIM, token=ADMIN, timeout=10.0)
    tokens = {VICTIM: admin.create_job(),
              OTHER: client_factory(cluster.address, OTHER, token=ADMIN).create_job()}
    assert tokens[VICTIM] and tokens[OTHER], "the manager issued no job tokens"
    victim = client_factory(cluster.address, VICTIM, token=tokens[VICTIM], timeout=10.0)
    create_data_job(victim, create_job=False)
    victim.push_dense("w", np.ones(70, np.float32))
    victim.push_rows("e", [1, 2, 3], np.ones((3, 3), np.float32))
    shard_map = admin.cluster_map().msg
    servers = {s.name: s.address for s in shard_map.servers}
    manager = channels.channel(cluster.address)
    w = World(cluster, Reference(data_tables(shard_map), ("", 0), {}), servers, {}, manager, Wire())
    w.ref.use(shard_map)
    checks: Counter = Counter()
    tmp = str(tmp_path)
    try:
        started = time.monotonic()
        for k in range(3):
            fuzz_rounds(lambda d, w_: run_admin(d, w_, tokens, tmp, checks), w, 800, seed=7000 + k)
            for _name, address in {"manager": cluster.address, **servers}.items():
                channels.check_health(address, timeout=DEADLINE)      # answers (status may vary)
        status = ManagerStub(manager).GetClusterStatus(mg.GetClusterStatusRequest(), timeout=DEADLINE,
                                                       metadata=admin_md)
        assert len(status.servers) >= 3
        print("\n" + w.wire.report(f"fuzz (admin RPCs with credentials, {time.monotonic() - started:.0f} s)"))
        print(f"  authorisation checks: {dict(checks)}; requests not sent: {dict(w.skipped)}")
        assert not w.wire.violations, "\n".join(w.wire.violations[:40])
        assert checks["refused without a valid token"] >= 100
        assert checks["admin RPC refused to a job token"] >= 50
        never = [m for m in list(PS_METHODS) + list(RM_REQUESTS)
                 if not any(k.endswith("." + m) for k in w.wire.by_method)]
        assert not never, f"never called: {never}"
    finally:
        for ch in list(w.channels.values()) + [manager]:
            ch.close()
