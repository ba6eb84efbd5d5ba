"""The fuzzed cluster as the fuzzers see it (``World``): channels, the reference, the maps in
force; the data job's tables; running rounds of examples and checking the stored state."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.tables import Initializer, InitKind, constant, sgd, uniform
from tests.fuzz.reference import DATA_JOB, Reference, RefTable, Verdict, check_pull_response
from tests.fuzz.wire import DEADLINE, OK, PS, Wire


@dataclass
class World:
    cluster: object
    ref: Reference
    servers: dict[str, str]            # name -> address
    channels: dict[str, grpc.Channel]
    manager: grpc.Channel
    wire: Wire
    fresh: int = 0
    skipped: Counter = field(default_factory=Counter)
    ambiguous: Counter = field(default_factory=Counter)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)
    checks: Wire = field(default_factory=Wire)      # the state checks' own pulls (not fuzz)

    def epoch(self) -> int:
        return self.cluster.manager.runtime.published.epoch

    def next_session(self) -> str:
        self.fresh += 1
        return f"fresh-{self.fresh}"

    def maps(self) -> list[pb.ShardMap]:
        """The maps a server may be using now: the published one, and the one being
        installed if a change is in flight."""
        rt = self.cluster.manager.runtime
        published = rt.published
        if rt.state.epoch == published.epoch:
            return [published]
        with rt.lock:
            return [published, rt.state.shard_map()]

    def settle(self, timeout: float = 30.0, quiet_for: float = 0.3) -> None:
        """Wait until no map change has been in flight for ``quiet_for`` seconds. (Block moves
        may still start afterwards: the manager retries failed ones every tick; requests
        are judged under every map in force during the call, see ``judged``.)"""
        rt = self.cluster.manager.runtime
        deadline = time.monotonic() + timeout
        quiet_since = None
        while True:
            now = time.monotonic()
            if rt.state.epoch == rt.published.epoch:
                quiet_since = quiet_since or now
                if now - quiet_since >= quiet_for:
                    self.ref.use(rt.published)
                    return
            else:
                quiet_since = None
            assert now < deadline, "the manager kept changing the map"
            time.sleep(0.02)

    def judged(self, judge, send):
        """``send()`` once; ``judge()`` under every map in force before or after it. Returns
        the outcome, the verdicts and whether the map stayed put."""
        before = self.maps()
        self.ref.use(before[-1])
        out = send(judge())
        after = self.maps()
        maps = {m.epoch: m for m in before + after}
        verdicts = [judge() for m in maps.values() if self.ref.use(m)]
        self.ref.use(after[-1])
        return out, verdicts, len(maps) == 1

    def read_blocks(self, keys) -> dict:
        """Current contents of data blocks ``(table, block)`` (sparse: of the given ids),
        read from their primaries once the placement is quiet."""
        for attempt in range(10):
            self.settle()
            epoch = self.epoch()
            try:
                return self._read_blocks(keys)
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE) \
                        or self.epoch() == epoch and attempt > 3:
                    raise
        raise AssertionError("the placement never stayed put long enough to read the state")

    def _read_blocks(self, keys) -> dict:
        out = {}
        for (name, b), ids in keys.items():
            t = self.ref.tables[name]
            server = self.ref.primary(t, b)
            header = pb.RequestHeader(job=DATA_JOB, epoch=self.epoch())
            if t.dense:
                lo, hi = t.block_range(b)
                req = ps.PullRequest(header=header,
                                     segments=[pb.Segment(table=name, range=pb.Range(start=lo, stop=hi))])
            else:
                req = ps.PullRequest(header=header,
                                     segments=[pb.Segment(table=name, rows=pb.RowSelection(count=len(ids)))],
                                     data=np.array(ids, "<i8").tobytes())
            stream = self.channels[server].unary_stream(f"/{PS}/Pull")(req.SerializeToString(), timeout=DEADLINE)
            msgs = [ps.PullChunk.FromString(c) for c in stream]
            values = np.frombuffer(b"".join(m.data for m in msgs), "<f4")
            out[(name, b)] = values if t.dense else (list(ids), values.reshape(len(ids), t.dim))
        return out

    def resolve(self, v: Verdict, what: str) -> bool:
        """A push was refused where it could also have been accepted (the map moved during
        the call, or a copy destination refused the forwarded update after the primary had
        applied it): find out, block by block, from the stored values whether it was applied
        (the primary applies, then forwards: a refusal may come after some blocks changed).
        Applies what was applied to the reference; returns True if anything was."""
        before = self.ref.block_contents(v)
        after = self.ref.preview(v)
        keys = {k: (c[0] if isinstance(c, tuple) else None) for k, c in before.items()}
        now = self.read_blocks(keys)

        def same(a, b) -> bool:
            a, b = (a[1] if isinstance(a, tuple) else a), (b[1] if isinstance(b, tuple) else b)
            return np.array_equal(a, b, equal_nan=True)

        applied = set()
        for key in before:
            was, will = same(now[key], before[key]), same(now[key], after[key])
            if will and not was:
                applied.add(key)
            elif was and will and v.writer is not None:
                raise AssertionError(f"cannot tell whether block {key} of {what} was applied (the "
                                     f"update changes no value) nor so whether its exactly-once "
                                     f"record holds the push")
            elif not was and not will:
                raise AssertionError(f"block {key} after {what}: stored {now[key]}, reference "
                                     f"before {before[key]}, after {after[key]}")
        if not applied:
            return False
        part = Verdict(plan=[p for p in v.plan if (p[0].name, p[1]) in applied],
                       touched={k for k in v.touched if k in applied}, writer=v.writer)
        self.ref.apply(part)
        self.ambiguous["applied although refused" if len(applied) == len(before)
                       else "partly applied although refused"] += 1
        return True


def data_tables(shard_map: pb.ShardMap) -> dict[str, RefTable]:
    tables = {
        "w": RefTable("w", True, numel=70, block_size=16),
        "a": RefTable("a", True, numel=24, block_size=8, assigned=True),
        "e": RefTable("e", False, dim=3, num_rows=1000, num_blocks=8, init_value=0.25),
        "e0": RefTable("e0", False, dim=2, num_rows=0, num_blocks=4, init_value=-1.0,
                       allow_non_finite=True),
    }
    for tp in shard_map.tables:
        t = tables.get(tp.spec.name) if tp.job == DATA_JOB else None
        if t is not None:
            t.blocks, t.config_version = len(tp.blocks), tp.config.version
            t.lr, t.weight_decay = tp.config.optimizer.lr, tp.config.optimizer.weight_decay
            t.allow_non_finite = tp.config.allow_non_finite
    assert all(t.blocks for t in tables.values()), "data tables not in the shard map"
    return tables


def create_data_job(client, create_job: bool = True) -> None:
    if create_job:
        client.create_job()
    client.create_dense("w", (10, 7), optimizer=sgd(0.5), init=uniform(-1, 1, seed=7), block_size=16)
    client.create_dense("a", (24,), optimizer=sgd(0.25), init=Initializer(InitKind.ASSIGNED), block_size=8)
    client.create_sparse("e", 3, num_rows=1000, optimizer=sgd(0.5), init=constant(0.25), num_blocks=8)
    client.create_sparse("e0", 2, num_rows=0, optimizer=sgd(0.5), init=constant(-1.0), num_blocks=4,
                         allow_non_finite=True)


ROUNDS = 3


def fuzz_rounds(run, w: World, examples: int, seed: int) -> None:
    """``examples`` hypothesis examples of ``run(data, w)``, generated from a fixed seed,
    without shrinking (the servers' state moves on; the failing message is in the error)."""

    @hyp_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(st.data())
    def fuzz(data):
        run(data, w)

    fuzz()


def full_check(w: World, attempts: int = 10) -> None:
    """Every block of every data table, read from its primary, equals the reference; sparse
    tables hold exactly the rows the reference holds. Starts over if a block moves meanwhile."""
    for _attempt in range(attempts):
        w.settle()
        epoch = w.epoch()
        moved = False
        for name, t in w.ref.tables.items():
            for server in sorted(w.servers):
                header = pb.RequestHeader(job=DATA_JOB, epoch=epoch)
                if t.dense:
                    reqs = [ps.PullRequest(header=header, segments=[pb.Segment(
                        table=name, range=pb.Range(start=t.block_range(b)[0], stop=t.block_range(b)[1]))])
                        for b in range(t.blocks) if w.ref.primary(t, b) == server]
                else:
                    reqs = [ps.PullRequest(header=header, segments=[pb.Segment(
                        table=name, rows=pb.RowSelection(all_stored=True))])]
                for req in reqs:
                    verdict = w.ref.judge_pull(server, req)
                    out = w.checks.call(w.channels[server], PS, "Pull", req.SerializeToString(),
                                        kind="unary_stream", may_wait=verdict.may_wait)
                    if w.epoch() != epoch:
                        moved = True
                        break
                    what = f"state of {name} {req.segments[0]} on {server}"
                    if verdict.ok:
                        assert out.code == OK, f"{what}: {out.code} {out.details}"
                        check_pull_response(out.response, verdict.expect, what)
                    else:
                        assert out.code in verdict.codes, f"{what}: {out.code} {out.details}"
                if moved:
                    break
            if moved:
                break
        if not moved:
            return
    raise AssertionError(f"the placement moved during each of {attempts} state checks")
