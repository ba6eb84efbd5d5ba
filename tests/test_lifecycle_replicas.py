"""Replicas stay bit-identical after eviction (issue 18): the block digest
(``server/node/digest.py``), the ``GetBlockDigests`` RPC, the verifier's replica check
(``shardps.tools.verify``, ``lifecycle`` job) and proof that it catches divergence: with the
test-only switch ``SHARDPS_TEST_REINTRODUCE_DEFECT=3`` backups skip their primary's eviction
and admission decisions, and the same run fails on the replica check."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.server.node.blocks import DenseBlock, SparseBlock
from shardps.server.node.digest import block_digest, held_digests
from shardps.server.node.lifecycle import SKETCH_BYTES
from shardps.tables import LifecyclePolicy, TableConfig, adagrad, dense_table, normal, sgd, sparse_table
from shardps.tools.verify.__main__ import print_table
from shardps.tools.verify.checker import Replica, compare_replicas
from shardps.tools.verify.run import RunConfig, run_schedule

SPEC = sparse_table("e", 4, num_blocks=1, init=normal(0.0, 0.1, seed=3))
CONFIG = TableConfig(adagrad(0.1), lifecycle=LifecyclePolicy(admit_after=2, ttl_steps=5,
                                                             budget_bytes=SKETCH_BYTES + 30 * 40))


def _sparse(pushes) -> SparseBlock:
    blk = SparseBlock(("j", "e", 0), SPEC)
    for tick, ids in pushes:
        ids = np.asarray(ids, dtype=np.int64)
        grad = np.linspace(-1, 1, ids.shape[0] * 4, dtype=np.float32).reshape(-1, 4)
        blk.apply_gradient(CONFIG, ids, grad, tick)
    return blk


PUSHES = [(1, range(0, 40)), (2, range(20, 60)), (3, range(0, 10)), (9, range(50, 70))]


def _digest(blk) -> bytes:
    with blk.lock:
        return block_digest(blk)


def test_equal_states_have_equal_digests_whatever_their_slots_or_versions():
    a, b = _sparse(PUSHES), _sparse(PUSHES)
    rows = a.table_rows
    assert rows.life is not None and rows.life.counters["not_admitted"] > 0       # admission at work
    assert rows.life.counters["evicted_ttl"] + rows.life.counters["evicted_budget"] > 0
    assert _digest(a) == _digest(b)
    # the same rows stored in other slots (a copy loaded elsewhere) hash the same
    c = SparseBlock(("j", "e", 0), SPEC)
    with a.lock:
        meta, arrays = a.snapshot()
    c.load(meta, arrays)
    assert _digest(c) == _digest(a)
    b.version += 5                       # reported beside the digest, not part of it
    b.writers.clear()                    # exactly-once records: pruned per server
    assert _digest(b) == _digest(a)


def test_a_changed_row_value_state_tick_or_sketch_changes_the_digest():
    base = _digest(_sparse(PUSHES))
    ids = np.arange(0, 10, dtype=np.int64)

    def changed(edit) -> bytes:
        blk = _sparse(PUSHES)
        rows = blk.table_rows
        stored, slots = rows.index.stored()
        assert stored.shape[0] > 0
        edit(rows, slots[:1])
        return _digest(blk)

    assert changed(lambda r, s: r.rows.put(s, np.nextafter(r.rows.take(s), 1).astype(np.float32))) != base
    assert changed(lambda r, s: r.state["sum"].put(s, r.state["sum"].take(s) + 1)) != base
    assert changed(lambda r, s: r.ensure_ticks().put(s, 99)) != base
    assert changed(lambda r, s: r.life.sketch.__setitem__((0, 7), r.life.sketch[0, 7] ^ 1)) != base
    assert changed(lambda r, s: r.life.now.__setitem__(0, 123)) != base
    assert changed(lambda r, s: r.life.counted.__setitem__(0, r.life.counted[0] + 1)) != base
    assert changed(lambda r, s: r.remove(r.index.stored()[0][:1])) != base       # a row evicted
    assert _digest(_sparse(PUSHES[:-1])) != base                                  # one push fewer
    pending = _sparse(PUSHES)
    pending.accumulate(4, (ids, np.ones((10, 4), np.float32)))                    # SYNC data
    assert _digest(pending) != base


def test_dense_digest_covers_values_state_and_step():
    spec = dense_table("w", (64,), block_size=64)
    a, b = DenseBlock(("j", "w", 0), spec), DenseBlock(("j", "w", 0), spec)
    for blk in (a, b):
        blk.apply_gradient(TableConfig(sgd(0.1)), 0, 64, np.ones(64, np.float32))
    assert _digest(a) == _digest(b)
    b.step += 1
    assert _digest(a) != _digest(b)


def test_compare_replicas_names_the_block_and_servers():
    d1, d2 = b"\x01" * 16, b"\x02" * 16
    held = {("j", "t", 0): [Replica("s1", 4, True, d1), Replica("s2", 4, False, d1)],
            ("j", "t", 1): [Replica("s1", 4, False, d1), Replica("s3", 4, True, d2)],
            ("j", "t", 2): [Replica("s2", 3, True, d1), Replica("s3", 2, False, d1)],
            ("j", "t", 3): [Replica("s2", 3, True, d1)]}
    compared, problems = compare_replicas(held, replication=2)
    assert compared == 3
    assert any("block j/t/1: replicas differ at version 4" in p and "s1" in p and "s3" in p for p in problems)
    assert any("block j/t/2: replicas at different versions" in p for p in problems)
    assert any("block j/t/3: 1 of 2 replicas" in p for p in problems)
    assert not any("j/t/0" in p for p in problems)


def test_get_block_digests_rpc_shows_identical_replicas_after_eviction(make_cluster, client_factory):
    cluster = make_cluster(3, replication=2)
    c = client_factory(cluster.address, job="lc", timeout=30)
    c.create_job()
    c.create_sparse("e", 4, optimizer=adagrad(0.1), num_blocks=6, lifecycle=LifecyclePolicy(
        admit_after=2, ttl_steps=6, budget_bytes=6 * (SKETCH_BYTES + 40 * 40)))
    rng = np.random.default_rng(1)
    for step in range(1, 20):
        ids = np.unique(rng.zipf(1.3, 600) % 5000)
        c.push_rows("e", ids, rng.standard_normal((ids.shape[0], 4)).astype(np.float32), clock=step)
    held: dict = {}
    for name, server in cluster.servers.items():
        with grpc.insecure_channel(server.address) as ch:
            answer = ch.unary_unary("/shardps.v1.ParameterServer/GetBlockDigests",
                                    request_serializer=ps.GetBlockDigestsRequest.SerializeToString,
                                    response_deserializer=ps.GetBlockDigestsResponse.FromString)(
                ps.GetBlockDigestsRequest(job="lc"), timeout=10)
        assert answer.name == name
        assert answer.blocks and all(len(b.digest) == 16 and b.loaded for b in answer.blocks)
        assert [b.role for b in answer.blocks] == [
            ps.BLOCK_PRIMARY if cluster.servers[name].node.table.is_primary(("lc", "e", b.block))
            else ps.BLOCK_BACKUP for b in answer.blocks]
        for b in answer.blocks:
            held.setdefault(("lc", "e", b.block), []).append(
                Replica(name, b.version, b.role == ps.BLOCK_PRIMARY, b.digest, b.loaded))
    assert compare_replicas(held, replication=2) == (6, [])
    evicted = sum(r.life.counters["evicted_ttl"] + r.life.counters["evicted_budget"]
                  for s in cluster.servers.values() for r in [s.node.table.sparse_rows[("lc", "e")]])
    assert evicted > 0
    # the plain function agrees with the RPC
    node = cluster.servers["s0"].node
    assert {d.key for d in held_digests(node.table, "lc")} == {k for k in node.blocks if k[0] == "lc"}


# ---------------------------------------------------------------- the verifier (processes)

def _lifecycle_run(tmp_path, defect: str = "", faults: tuple[str, ...] = ()):
    started = time.monotonic()
    v = run_schedule(RunConfig(seed=2, seconds=12, jobs=("lifecycle",), faults=faults, defect=defect,
                               rss_warmup=5.0, rss_min_span=300.0, work_dir=str(tmp_path)), print)
    print_table([v])
    return v, time.monotonic() - started


@pytest.mark.chaos
def test_verifier_lifecycle_job_passes_with_replicas_compared(tmp_path):
    v, elapsed = _lifecycle_run(tmp_path, faults=("kill",))
    assert v.passed, "\n".join(v.violations)
    assert v.replica_blocks >= 8 and v.replica_copies >= 16
    assert v.lifecycle["rows_evicted_ttl"] + v.lifecycle["rows_evicted_budget"] > 0
    assert v.lifecycle["rows_not_admitted"] > 0
    print(f"lifecycle run: {elapsed:.0f}s")


@pytest.mark.chaos
def test_verifier_catches_defect_3_backups_skip_lifecycle_decisions(tmp_path):
    v, elapsed = _lifecycle_run(tmp_path, defect="3")
    assert not v.passed, "defect 3 went unnoticed"
    assert any(x.startswith("replicas: block lifecycle/counters/") and "differ at version" in x
               for x in v.violations), v.violations
    print(f"lifecycle run with defect 3: {elapsed:.0f}s")
