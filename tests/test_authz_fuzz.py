"""Cross-job fuzz of every RPC in the authorization table (``tests/fuzz/cross_job.py``): the
attacker job's valid token against the victim job, on gRPC and on the data plane, with a
minimum number of attempts per method, judged by the reference model of the victim's data
and by snapshots of everything else of the victim."""

from __future__ import annotations

import time

import numpy as np
import pytest

from shardps import authz
from shardps.rpc import channels
from tests.fuzz.admin import ADMIN, secure_cluster
from tests.fuzz.cross_job import (
    ATTACKER,
    Tally,
    connections,
    diff,
    run_data_plane,
    run_grpc,
    targets,
    victim_snapshot,
)
from tests.fuzz.reference import DATA_JOB, MEMBER_NAME, Reference
from tests.fuzz.wire import Wire, check_health
from tests.fuzz.world import World, create_data_job, data_tables, full_check, fuzz_rounds

MIN_ATTEMPTS = 300          # per method and transport
ROUNDS = 3


def test_the_fuzzer_attacks_every_entry():
    """What the cross-job fuzz attacks is the table: every entry of both services on every
    transport it is served on (a new entry is attacked without touching the fuzzer)."""
    attacked = {(s, m) for s, m, _ in targets()}
    for service in (authz.PS_SERVICE, authz.RM_SERVICE):
        assert {m for m in authz.TABLE[service] if m != "HELLO"} == {m for s, m in attacked if s == service}
    assert ("shardps.v1.ParameterServer", "Exchange", "dataplane") in targets()


@pytest.mark.slow          # over 10,000 messages, ~60-120 s
@pytest.mark.timeout(900, method="thread")
def test_fuzz_cross_job(make_cluster, client_factory, tmp_path):
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    cluster = secure_cluster(make_cluster, 2)
    tokens = {job: client_factory(cluster.address, job, token=ADMIN).create_job() for job in (DATA_JOB, ATTACKER)}
    victim = client_factory(cluster.address, DATA_JOB, token=tokens[DATA_JOB], timeout=10.0)
    create_data_job(victim, create_job=False)
    member = victim.join(name=MEMBER_NAME)
    attacker = client_factory(cluster.address, ATTACKER, token=tokens[ATTACKER], timeout=10.0)
    attacker.create_dense("w", (8,))
    attacker.join(name="attacker-w0")
    shard_map = victim.refresh_map().msg
    tables = data_tables(shard_map)
    servers = {s.name: s.address for s in shard_map.servers}
    chans = {n: channels.channel(a) for n, a in servers.items()}
    manager = channels.channel(cluster.address)
    limits = {"max_request_bytes": 1 << 30, "max_rows": 4_000_000, "max_segments": 65_535}   # the defaults
    w = World(cluster, Reference(tables, (member.session, member.incarnation), limits), servers, chans, manager,
              Wire())
    for t in tables.values():
        if t.dense:
            t.values = np.zeros(t.numel, np.float32) if t.assigned else victim.pull_dense(t.name).reshape(-1).copy()
    # the reference's own state checks read with the admin token
    w.checks.call = _with_metadata(w.checks.call, admin_md)
    w.settle()
    conns = connections(w, tokens[ATTACKER])
    tally = Tally()
    tmp = str(tmp_path)
    try:
        before = victim_snapshot(w, admin_md)
        started = time.monotonic()
        for round_ in range(ROUNDS):
            for k, (service, method, transport) in enumerate(targets()):
                if transport == "dataplane":
                    run = lambda d, w_, m=method: run_data_plane(d, w_, tally, m, conns)    # noqa: E731
                else:
                    run = lambda d, w_, s=service, m=method: run_grpc(d, w_, tally, s, m, tokens[ATTACKER], tmp)  # noqa: E731
                fuzz_rounds(run, w, MIN_ATTEMPTS // ROUNDS + 2, seed=9000 + 100 * round_ + k)
                tally.effects += diff(before, victim_snapshot(w, admin_md), f"{transport} {method}")
                broken = tally.wrong + tally.revealed + tally.effects     # stop at the first method that leaks
                assert not broken, f"{transport} {method}:\n" + "\n".join(broken[:40])
            check_health({"manager": cluster.address, **servers})
            full_check(w)                 # the victim's stored values equal the reference
        elapsed = time.monotonic() - started
        print("\n" + w.wire.report(f"fuzz (cross-job, {elapsed:.0f} s)"))
        print(f"  cross-job attempts per method: {dict(sorted(tally.attempts.items()))}")
        print(f"  effects on the victim: {len(tally.effects)}; answers revealing another job: "
              f"{len(tally.revealed)}; wrong codes: {len(tally.wrong)}; INTERNAL: {tally.internal}; "
              f"data-plane messages: {tally.dp_sent}")
        assert not w.wire.violations + w.checks.violations, "\n".join(w.wire.violations[:40])
        assert not tally.wrong, "\n".join(tally.wrong[:40])
        assert not tally.revealed, "\n".join(tally.revealed[:40])
        assert not tally.effects, "\n".join(tally.effects[:40])
        assert tally.internal == 0
        assert w.wire.sent >= 10_000, f"only {w.wire.sent} messages sent"
        keys = {f"{'dataplane' if tr == 'dataplane' else s.rsplit('.', 1)[-1]}.{m}" for s, m, tr in targets()}
        short = {k: tally.attempts[k] for k in keys if tally.attempts[k] < MIN_ATTEMPTS}
        assert not short, f"fewer than {MIN_ATTEMPTS} cross-job attempts: {short}"
    finally:
        for conn in conns.values():
            conn.close()
        for ch in set(chans.values()) | set(w.channels.values()) | {manager}:
            ch.close()


def _with_metadata(call, metadata):
    def wrapped(*args, **kw):
        kw.setdefault("metadata", metadata)
        return call(*args, **kw)
    return wrapped
