"""Fuzz what a worker of some job can send, judged by a reference model of the wire contract.

``test_fuzz_worker_reachable_rpcs``: the data path (Push, Pull, ProbeSharedMemory) is judged
by an independent reference model of the wire contract (``tests.fuzz.reference``): for every
request it computes the set of rules the request breaks and the status codes they map to. A
request breaking none must be accepted, and is then applied to the reference (plain SGD in
numpy: ``value -= lr * (grad [+ wd * value])``, exactly-once per block for replayed sequence
numbers); a request breaking some must be refused with one of their codes. Accepted pulls
must return the reference's values. Manager RPCs get random, mutated and structured
messages; those that would legitimately change the data job (EndJob, DeleteTable of its
tables) are not sent, UpdateTableConfig is modelled. At the end every stored table equals the
reference.

It asserts: the processes keep answering health; no call outlives its deadline; only the
status codes the .proto files document (INTERNAL counts as a bug). A failure found and not
yet fixed is listed in ``tests.fuzz.wire.KNOWN_BUGS`` (none is open) with an
``xfail(strict=True)`` reproduction in ``tests/test_fuzz_regressions.py``; once fixed, the
entry and the marker go and the reproduction stays as a regression test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from shardps.protos.v1 import manager_pb2 as mg
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc import channels
from tests.fuzz.data_path import run_probe, run_pull, run_push
from tests.fuzz.internal_rpcs import run_internal
from tests.fuzz.manager_rpcs import run_manager
from tests.fuzz.reference import DATA_JOB, MEMBER_NAME, Reference
from tests.fuzz.wire import PS_METHODS, RM_REQUESTS, Wire, check_health
from tests.fuzz.world import ROUNDS, World, create_data_job, data_tables, full_check, fuzz_rounds


def test_the_fuzzer_knows_every_rpc():
    """A new RPC in the .proto must be added to the fuzzer (it cannot go unfuzzed)."""
    assert set(ps.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name) == set(PS_METHODS)
    assert set(mg.DESCRIPTOR.services_by_name["ResourceManager"].methods_by_name) == set(RM_REQUESTS)


@pytest.mark.slow          # over 10,000 messages, ~100 s
@pytest.mark.timeout(900, method="thread")      # a stack dump instead of a silent hang
def test_fuzz_worker_reachable_rpcs(make_cluster, client_factory, tmp_path):
    limits = {"max_request_bytes": 2048, "max_rows": 16, "max_segments": 65_535}
    cluster = make_cluster(2, server_settings={"max_request_bytes": limits["max_request_bytes"],
                                               "max_rows": limits["max_rows"]})
    client = client_factory(cluster.address, DATA_JOB, timeout=10.0)
    create_data_job(client)
    member = client.join(name=MEMBER_NAME)
    shard_map = client.refresh_map().msg
    tables = data_tables(shard_map)
    servers = {s.name: s.address for s in shard_map.servers}
    chans = {n: channels.channel(a) for n, a in servers.items()}
    manager = channels.channel(cluster.address)
    try:
        w = World(cluster, None, servers, chans, manager, Wire())
        w.ref = Reference(tables, (member.session, member.incarnation), limits)
        for t in tables.values():    # initial values of the dense tables (UNIFORM, or unwritten)
            if t.dense:
                t.values = np.zeros(t.numel, np.float32) if t.assigned else client.pull_dense(t.name).reshape(-1).copy()
        w.settle()
        health = {"manager": cluster.address, **servers}
        tmp = str(tmp_path)

        runs = [(run_push, 4500), (lambda d, w: run_manager(d, w, tmp), 2400), (run_pull, 2500),
                (lambda d, w: run_internal(d, w, real_refs=False, safe_only=True), 900),
                (run_probe, 150)]
        started = time.monotonic()
        phases, counts = [0.0] * len(runs), [0] * len(runs)
        for round_ in range(ROUNDS):      # interleaved, so that the data job sees manager churn
            for k, (run, total) in enumerate(runs):
                t0, n0 = time.monotonic(), w.wire.sent
                fuzz_rounds(run, w, total // ROUNDS, seed=1000 * round_ + k)
                phases[k] += time.monotonic() - t0
                counts[k] += w.wire.sent - n0
                check_health(health)
                full_check(w)
        check_health(health)
        full_check(w)
        elapsed = time.monotonic() - started
        print("\n" + w.wire.report(f"fuzz (worker-reachable RPCs, {elapsed:.0f} s)"))
        print("  phases: " + ", ".join(f"{name} {n} messages in {t:.1f}s" for name, n, t in zip(
            ["push", "manager", "pull", "internal", "probe"], counts, phases)))
        print(f"  pushes applied to the reference: {w.ref.applied_pushes}; state checks: "
              f"{w.checks.sent} pulls; requests not sent (they would change the data job "
              f"legitimately): {dict(w.skipped)}; outcomes resolved by reading the state: "
              f"{dict(w.ambiguous)}")
        assert not w.wire.violations + w.checks.violations, "\n".join(w.wire.violations[:40])
        assert w.wire.sent >= 10_000, f"only {w.wire.sent} messages sent"
        assert w.ref.applied_pushes >= 1000, "too few valid pushes: the generator drifted"
        untouched = [m for m in ["Push", "Pull", "ProbeSharedMemory"] + list(RM_REQUESTS)
                     if not any(k.endswith("." + m) for k in w.wire.by_method)]
        assert not untouched, f"never called: {untouched}"
    finally:
        for ch in list(chans.values()) + [manager]:
            ch.close()
