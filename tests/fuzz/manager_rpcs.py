"""ResourceManager requests: structured, mutated and random messages, which of them may go to
the data cluster (``manager_safe``), and what an accepted one changes in the reference."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg
from tests.fuzz.encoder import parses
from tests.fuzz.reference import (
    BAD_NAMES,
    DATA_JOB,
    MEMBER_NAME,
    PUSHED_JOBS,
    SCRATCH_JOBS,
    SCRATCH_TABLES,
    UNKNOWN_JOB,
    UNKNOWN_TABLE,
)
from tests.fuzz.strategies import INT64_EDGE, blob, coin, mutate, one_of, randint, seeded, some
from tests.fuzz.wire import DEADLINE, OK, RM, RM_REQUESTS, Outcome
from tests.fuzz.world import World


def draw_optimizer(w: "World", tame: bool) -> pb.OptimizerConfig:
    if tame:
        return pb.OptimizerConfig(kind=pb.SGD, lr=one_of(w, [0.5, 0.25, 2.0, 1e-3]),
                                  weight_decay=one_of(w, [0.0, 0.0, 0.5]),
                                  exact_zero_hyperparameters=coin(w))
    num = [0.0, 0.1, 0.9, 1.0, 2.0, -1.0, float("nan"), float("inf"), 1e300]
    return pb.OptimizerConfig(
        kind=one_of(w, [0, 1, 2, 3, 9]), lr=one_of(w, num), momentum=one_of(w, num),
        dampening=one_of(w, num), nesterov=coin(w), weight_decay=one_of(w, num),
        beta1=one_of(w, num), beta2=one_of(w, num), eps=one_of(w, num),
        initial_accumulator_value=one_of(w, num), lr_decay=one_of(w, num),
        exact_zero_hyperparameters=coin(w))


def draw_spec(w: "World", name: str) -> pb.TableSpec:
    """A table spec; valid ones never have more than 256 blocks (see the module docstring
    of SECURITY.md: a table with 2**18 blocks stalls the manager)."""
    kind = one_of(w, [pb.DENSE, pb.SPARSE, pb.DENSE, pb.SPARSE, 0, 9])
    dims = [1, 3, 7, 100, 0, -1, 2 ** 31, 2 ** 62]
    shape = some(w, dims, 3)
    if coin(w):
        shape = [randint(w, 1, 300)] if kind != pb.SPARSE else \
            [one_of(w, [0, 10, 1000]), randint(w, 1, 4)]
    block_size = one_of(w, [0, 1, 16, 4096, 2 ** 26, 2 ** 26 + 1, 2 ** 32 - 1])
    num_blocks = one_of(w, [0, 1, 7, 256, 2 ** 20 + 1, 2 ** 32 - 1])
    if kind == pb.DENSE and shape and all(s > 0 for s in shape):
        numel = int(np.prod([float(s) for s in shape]))
        bs = block_size or 65536
        if 1 <= bs <= 2 ** 26 and 256 < -(-numel // bs) <= 2 ** 20:
            block_size = 2 ** 26 if numel > 2 ** 34 else -(-numel // 256)
    init = pb.Initializer(kind=one_of(w, [0, 1, 2, 3, 4, 5, 17]),
                          value=one_of(w, [0.0, 1.5, float("nan")]),
                          low=one_of(w, [0.0, 1.0, float("-inf")]),
                          high=one_of(w, [1.0, -1.0]),
                          std=one_of(w, [1.0, -1.0, float("inf")]),
                          seed=one_of(w, [0, 2 ** 64 - 1]))
    return pb.TableSpec(name=name, kind=kind, shape=shape, dtype=one_of(w, [0, 1, 1, 2, 5, 99]),
                        block_size=block_size, num_blocks=num_blocks, init=init)


def draw_consistency(w: "World") -> pb.Consistency:
    return pb.Consistency(mode=one_of(w, [0, 1, 2, 3, 9]),
                          staleness=one_of(w, [0, 2, 2 ** 32 - 1]))


def manager_request(data, w: World, method: str, tmp: str):
    """A structured request for ``method``: scratch jobs mostly, the data job where safe."""
    job_any = SCRATCH_JOBS + [DATA_JOB, UNKNOWN_JOB] + BAD_NAMES
    job_scratch = SCRATCH_JOBS + [UNKNOWN_JOB] + BAD_NAMES
    table = SCRATCH_TABLES + BAD_NAMES
    session = ["", "deadbeefdeadbeef", "x" * 100, "\u00fc"]
    u64 = [0, 1, 2, 2 ** 63, 2 ** 64 - 1]
    now = w.epoch()
    if method == "CreateJob":
        return mg.CreateJobRequest(job=one_of(w, job_any), consistency=draw_consistency(w),
                                   quota=mg.JobQuota(max_bytes=one_of(w, u64)))
    if method == "EndJob":
        return mg.EndJobRequest(job=one_of(w, job_scratch))
    if method == "RevokeJobTokens":
        return mg.RevokeJobTokensRequest(job=one_of(w, job_scratch),
                                         token_ttl_seconds=one_of(w, [0.0, 1.0, -1.0, float("nan"), 1e12]))
    if method == "CreateTable":
        job = one_of(w, job_any)
        if job == DATA_JOB and coin(w):    # an existing data table: same or other spec
            name = one_of(w, sorted(w.ref.tables))
            tp = next((t for t in w.cluster.manager.runtime.published.tables
                       if t.job == DATA_JOB and t.spec.name == name), None)
            if tp is None:      # deleted (the admin fuzz may do that)
                return mg.CreateTableRequest(job=job, spec=draw_spec(w, name))
            spec = pb.TableSpec()
            spec.CopyFrom(tp.spec)
            if coin(w):
                spec.block_size += 1
            return mg.CreateTableRequest(job=job, spec=spec, config=tp.config)
        return mg.CreateTableRequest(job=job, spec=draw_spec(w, one_of(w, table)),
                                     config=pb.TableConfig(optimizer=draw_optimizer(w, False),
                                                           allow_non_finite=coin(w)))
    if method == "CreateTables":        # tables drawn as CreateTable draws them, of one job
        drawn = [manager_request(data, w, "CreateTable", tmp) for _ in range(randint(w, 0, 3))]
        return mg.CreateTablesRequest(job=drawn[0].job if drawn else one_of(w, job_any),
                                      tables=[mg.TableDefinition(spec=d.spec, config=d.config) for d in drawn])
    if method == "DescribeTable":
        return mg.DescribeTableRequest(job=one_of(w, job_any),
                                       table=one_of(w, SCRATCH_TABLES + ["w", "e"] + BAD_NAMES))
    if method == "ListTables":
        return mg.ListTablesRequest(job=one_of(w, job_any))
    if method == "UpdateTableConfig":
        if coin(w):
            name = one_of(w, sorted(w.ref.tables))
            t = w.ref.tables[name]
            return mg.UpdateTableConfigRequest(
                job=DATA_JOB, table=name,
                config=pb.TableConfig(optimizer=draw_optimizer(w, randint(w, 0, 3) > 0),
                                      allow_non_finite=coin(w)),
                expected_version=one_of(w, [0, t.config_version, t.config_version + 1, 2 ** 64 - 1]))
        return mg.UpdateTableConfigRequest(job=one_of(w, job_scratch), table=one_of(w, table),
                                           config=pb.TableConfig(optimizer=draw_optimizer(w, False)),
                                           expected_version=one_of(w, u64))
    if method == "UpdateTableConfigs":  # changes drawn as UpdateTableConfig draws them, of one job
        drawn = [manager_request(data, w, "UpdateTableConfig", tmp) for _ in range(randint(w, 0, 3))]
        return mg.UpdateTableConfigsRequest(
            job=drawn[0].job if drawn else one_of(w, job_any),
            changes=[mg.TableConfigChange(table=d.table, config=d.config, expected_version=d.expected_version)
                     for d in drawn])
    if method == "DeleteTable":
        return mg.DeleteTableRequest(job=one_of(w, job_any), table=one_of(w, table))
    if method == "GetShardMap":
        return mg.GetShardMapRequest(min_epoch=one_of(w, [0, 1, now, now + 50, 2 ** 64 - 1]),
                                     known_epoch=one_of(w, [0, 1, now - 1, now, now + 50, 2 ** 64 - 1]),
                                     job=one_of(w, job_any))
    if method == "WatchShardMap":
        return mg.WatchShardMapRequest(after_epoch=one_of(w, [0, 1, now - 1, now + 50, 2 ** 64 - 1]),
                                       changes=one_of(w, [False, True]), job=one_of(w, job_any))
    if method == "JoinWorkerGroup":
        return mg.JoinWorkerGroupRequest(job=one_of(w, job_any), name=one_of(w, ["", "w1", "w2", "n" * 300]),
                                         rank_hint=one_of(w, [-1, 0, 3, 2 ** 31 - 1, -(2 ** 31)]),
                                         previous_session=one_of(w, session), consistency=draw_consistency(w),
                                         client=coin(w))
    if method == "LeaveWorkerGroup":
        return mg.LeaveWorkerGroupRequest(job=one_of(w, job_any), session=one_of(w, session))
    if method == "WorkerHeartbeat":
        return mg.WorkerHeartbeatRequest(job=one_of(w, job_any), session=one_of(w, session),
                                         incarnation=one_of(w, u64), step=one_of(w, INT64_EDGE),
                                         samples_per_second=one_of(w, [1.0, float("nan"), -1e308]),
                                         loss=one_of(w, [0.5, float("inf")]))
    if method == "Checkpoint":
        return mg.CheckpointRequest(job=one_of(w, job_scratch),
                                    directory=one_of(w, [tmp, "", tmp + "/sub"]))
    if method == "CheckpointBarrier":
        return mg.CheckpointBarrierRequest(job=one_of(w, job_scratch), session=one_of(w, session),
                                           step=one_of(w, INT64_EDGE), worker_state=blob(w, 0, 32))
    if method == "Restore":
        return mg.RestoreRequest(job=one_of(w, job_scratch), path=one_of(w, [tmp + "/none", tmp, ""]))
    if method == "GetWorkerState":
        return mg.GetWorkerStateRequest(job=one_of(w, job_any), rank=one_of(w, [0, 2 ** 32 - 1]))
    if method == "GetClusterStatus":
        return mg.GetClusterStatusRequest()
    if method == "ResetLostBlocks":         # no block of the fuzz is lost: it resets none
        return mg.ResetLostBlocksRequest(job=one_of(w, job_any), table=one_of(w, table))
    if method == "RegisterServer":    # only refusable ones here: a name or an address is missing
        return mg.RegisterServerRequest(name=one_of(w, ["", "s9"]), address="",
                                        boot_id=one_of(w, session))
    if method == "ServerHeartbeat":
        return mg.ServerHeartbeatRequest(name=one_of(w, ["", "s9", "\u00fc"]),
                                         incarnation=one_of(w, u64), epoch=one_of(w, u64))
    if method == "DrainServer":
        return mg.DrainServerRequest(name=one_of(w, ["", "s9", "x" * 300]))
    raise AssertionError(method)


def manager_safe(w: World, method: str, msg, tmp: str) -> bool:
    """Whether a (possibly mutated) request may go to the data cluster: it must not change the
    data job except in modelled ways, nor reshape the cluster (admin operations)."""
    session, _ = w.ref.member
    real = set(w.servers)
    job = getattr(msg, "job", "")
    if method == "EndJob":
        return job != DATA_JOB
    if method == "RevokeJobTokens":      # the fuzz keeps using the tokens it holds
        return job not in (DATA_JOB, "other")
    if method == "DeleteTable":
        return not (job == DATA_JOB and msg.table in w.ref.tables)
    if method == "CreateTable":
        reserved = set(w.ref.tables) | {UNKNOWN_TABLE}
        return msg.spec.name not in reserved or job == DATA_JOB and msg.spec.name != UNKNOWN_TABLE
    if method == "CreateTables":
        return all(manager_safe(w, "CreateTable", mg.CreateTableRequest(job=job, spec=t.spec), tmp)
                   for t in msg.tables)
    if method == "CreateJob":
        return job != UNKNOWN_JOB
    if method in ("JoinWorkerGroup", "LeaveWorkerGroup"):
        return job != UNKNOWN_JOB and session not in (msg.previous_session if method == "JoinWorkerGroup"
                                                      else msg.session) \
            and getattr(msg, "name", "") != MEMBER_NAME
    if method in ("Checkpoint", "Restore"):     # they hold the job's pushes while they run
        where = msg.directory if method == "Checkpoint" else msg.path
        return job not in PUSHED_JOBS and (where == "" or where.startswith(tmp))
    if method in ("CheckpointBarrier", "GetWorkerState"):
        return job != DATA_JOB
    if method == "RegisterServer":
        return not (msg.name and msg.address)
    if method in ("ServerHeartbeat", "DrainServer"):
        return msg.name not in real
    return True


def after_manager_call(w: World, method: str, msg, out: Outcome) -> None:
    """Model what an accepted request changes in the data job; check the data job stayed."""
    if method == "UpdateTableConfig" and msg.job == DATA_JOB and msg.table in w.ref.tables and out.code == OK:
        t = w.ref.tables[msg.table]
        o = msg.config.optimizer
        assert o.kind == pb.SGD and o.momentum == 0, f"the optimizer state changed: {msg}"
        t.lr, t.weight_decay, t.allow_non_finite = o.lr, o.weight_decay, msg.config.allow_non_finite
        t.config_version = pb.TableConfig.FromString(out.response).version
    if method == "UpdateTableConfigs" and msg.job == DATA_JOB and out.code == OK:
        new = mg.UpdateTableConfigsResponse.FromString(out.response).configs
        for change, config in zip(msg.changes, new):
            if change.table in w.ref.tables:
                t, o = w.ref.tables[change.table], change.config.optimizer
                assert o.kind == pb.SGD and o.momentum == 0, f"the optimizer state changed: {msg}"
                t.lr, t.weight_decay, t.allow_non_finite = o.lr, o.weight_decay, change.config.allow_non_finite
                t.config_version = config.version
    if method == "CreateTable" and msg.job == DATA_JOB and msg.spec.name in w.ref.tables and out.code == OK:
        assert not mg.CreateTableResponse.FromString(out.response).created, f"data table re-created: {msg}"
    if method == "CreateTables" and msg.job == DATA_JOB and out.code == OK:
        reply = mg.CreateTablesResponse.FromString(out.response)
        assert not any(created for t, created in zip(msg.tables, reply.created) if t.spec.name in w.ref.tables), \
            f"data table re-created: {msg}"


MANAGER_FUZZED = [m for m in RM_REQUESTS]


def waits(w: World, method: str, msg) -> bool:
    """Long polls and barriers: they may legitimately wait until the deadline."""
    return msg is not None and ((method == "GetShardMap" and msg.min_epoch > w.epoch())
                                or (method == "WatchShardMap" and msg.after_epoch >= w.epoch() - 1)
                                or method in ("CheckpointBarrier", "Checkpoint"))


def run_manager(data, w: World, tmp: str) -> None:
    seeded(data, w)
    method = data.draw(st.sampled_from(MANAGER_FUZZED), "method")
    cls = RM_REQUESTS[method]
    form = data.draw(st.sampled_from(["structured"] * 6 + ["mutated", "random"]), "form")
    if form == "random":
        raw = blob(w, 0, 48)
    else:
        raw = manager_request(data, w, method, tmp).SerializeToString()
        if form == "mutated" and raw:
            raw = mutate(data, w, raw)
    msg = parses(cls, raw)
    if msg is not None and not manager_safe(w, method, msg, tmp):
        w.skipped[method] += 1
        return
    kind = "unary_stream" if method == "WatchShardMap" else "unary_unary"
    timeout, may_wait = (0.15, True) if waits(w, method, msg) else (DEADLINE, False)
    out = w.wire.call(w.manager, RM, method, raw, kind=kind, timeout=timeout,
                      first_only=method == "WatchShardMap", may_wait=may_wait)
    if msg is None:
        assert out.code != OK, f"{method}: an unparsable request was accepted"
        return
    after_manager_call(w, method, msg, out)
