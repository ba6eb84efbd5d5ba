"""Server-to-server and manager-to-server requests (Replicate, LoadBlocks, InstallShardMap,
CopyBlocks, SnapshotBlocks, HoldJob, DropTables, GetNodeStatus), and which of them may go to
the data cluster (``internal_safe``)."""

from __future__ import annotations

from hypothesis import strategies as st

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from tests.fuzz.encoder import parses
from tests.fuzz.manager_rpcs import draw_consistency, draw_optimizer, draw_spec
from tests.fuzz.reference import DATA_JOB, PUSHED_JOBS, SCRATCH_JOBS, UNKNOWN_JOB, UNKNOWN_TABLE
from tests.fuzz.strategies import INT64_EDGE, blob, coin, mutate, one_of, randint, seeded, some
from tests.fuzz.wire import PS, PS_METHODS
from tests.fuzz.world import World


def internal_request(data, w: World, method: str, tables: dict, real_refs: bool):
    """Requests of the server-to-server and manager-to-server RPCs (raw bytes, or chunks)."""
    now = w.epoch()
    u64 = [0, 1, now, now + 1, 2 ** 64 - 1]
    jobs = [DATA_JOB, UNKNOWN_JOB, ""] + SCRATCH_JOBS
    refs = [ps.BlockRef(job=DATA_JOB, table=n, block=b)
            for n, t in tables.items() for b in range(t.blocks)] if real_refs else []
    def ref():
        if refs and coin(w):
            return one_of(w, refs)
        return ps.BlockRef(job=one_of(w, jobs), table=one_of(w, ["w", "e", UNKNOWN_TABLE]),
                           block=one_of(w, [0, 1, 7, 2 ** 32 - 1]))
    names = sorted(w.servers) + ["", "s9", "manager"]
    if method == "Replicate":
        ops = []
        payload = b""
        for _ in range(randint(w, 0, 3)):
            r = ref()
            op = ps.BlockOp(job=r.job, table=r.table, block=r.block,
                            kind=one_of(w, [0, 1, 2, 3, 4, 9]),
                            version=one_of(w, [0, 1, 2, 2 ** 64 - 1]),
                            config_version=one_of(w, [0, 1, 2]),
                            step=one_of(w, INT64_EDGE), divisor=one_of(w, [0, 1, 3]),
                            id_count=one_of(w, [0, 0, 1, 2, 2 ** 62]),
                            element_count=one_of(w, [0, 1, 3, 16, 2 ** 62]),
                            range=pb.Range(start=one_of(w, [0, -1, 16]),
                                           stop=one_of(w, [16, 32, 2 ** 62])),
                            writer=ps.WriterId(session=one_of(w, ["", "s"]),
                                               sequence=one_of(w, [0, 1])))
            ops.append(op)
            payload += blob(w, 0, 40)
        head = ps.ReplicateHeader(epoch=one_of(w, u64), source=one_of(w, names), ops=ops,
                                  payload_bytes=one_of(w, [len(payload), 0, len(payload) + 1]))
        return [ps.ReplicateChunk(header=head, data=payload).SerializeToString()]
    if method == "LoadBlocks":
        chunks = []
        for _ in range(randint(w, 0, 2)):
            arrays = [ps.ArrayInfo(name=one_of(w, ["values", "ids", "state.sum", "x"]),
                                   dtype=one_of(w, [0, 1, 2, 4, 5, 9]),
                                   shape=some(w, [0, 1, 4, 16, -1, 2 ** 40], 2))
                      for _ in range(randint(w, 0, 2))]
            meta = one_of(w, [b"", b"{}", b"not json", b'{"version": 1, "writers": []}',
                                              b'{"version": 1, "writers": [], "step": 0, "initialized": true}',
                                              b'{"version": 1, "writers": [], "count": 1}'])
            head = ps.BlockStateHeader(ref=ref(), version=one_of(w, u64), initialized=coin(w),
                                       arrays=arrays, metadata=meta)
            chunks.append(ps.BlockChunk(header=head, data=blob(w, 0, 80),
                                        epoch=one_of(w, u64)).SerializeToString())
            if coin(w):
                chunks.append(ps.BlockChunk(data=blob(w, 0, 40)).SerializeToString())
        return chunks
    if method == "InstallShardMap":
        m = pb.ShardMap(epoch=one_of(w, [0, 1, max(0, now - 1), now]) if not real_refs
                        else one_of(w, u64))
        if coin(w):
            m.servers.add(name=one_of(w, names), address="127.0.0.1:1",
                          state=one_of(w, [0, 2, 4, 9]))
            tp = m.tables.add(job=one_of(w, jobs), spec=draw_spec(w, "t1"),
                              config=pb.TableConfig(optimizer=draw_optimizer(w, False)))
            for _ in range(randint(w, 0, 3)):
                tp.blocks.add(replicas=some(w, [0, 1, 5, 2 ** 32 - 1], 2),
                              since_epoch=one_of(w, u64), fresh_epoch=one_of(w, u64))
            g = m.groups.add(job=one_of(w, jobs), consistency=draw_consistency(w))
            g.members.add(rank=0, session="s", incarnation=1)
        return ps.InstallShardMapRequest(map=m).SerializeToString()
    if method == "CopyBlocks":
        return ps.CopyBlocksRequest(epoch=one_of(w, u64), blocks=[ref() for _ in range(randint(w, 0, 3))],
                                    destination=one_of(w, names)).SerializeToString()
    if method == "SnapshotBlocks":
        return ps.SnapshotBlocksRequest(epoch=one_of(w, u64),
                                        blocks=[ref() for _ in range(randint(w, 0, 3))]).SerializeToString()
    if method == "HoldJob":
        return ps.HoldJobRequest(job=one_of(w, jobs), hold=coin(w),
                                 hold_seconds=one_of(w, [0.0, 0.05, -1.0, 0.2])).SerializeToString()
    if method == "DropTables":
        return ps.DropTablesRequest(job=one_of(w, jobs),
                                    tables=some(w, ["w", "t1", ""], 2)).SerializeToString()
    if method == "GetNodeStatus":
        return b""
    if method == "GetBlockDigests":
        return ps.GetBlockDigestsRequest(job=one_of(w, jobs + ["x" * 300])).SerializeToString()
    if method == "ProbeSharedMemory":
        return ps.ProbeSharedMemoryRequest(ref=pb.SharedMemoryRef(name="shardps-none", length=8)).SerializeToString()
    if method == "OpenDataPlane":
        return ps.OpenDataPlaneRequest(job=one_of(w, jobs + ["x" * 300, "../etc"])).SerializeToString()
    raise AssertionError(method)


def internal_safe(w: World, method: str, request) -> bool:
    """Data cluster: internal requests that cannot touch the data job or reshape placement."""
    real = set(w.servers)
    if method in ("Push", "Pull"):
        return True      # only unparsable ones get here (parsable ones are judged by run_push)
    if method in ("Replicate", "SnapshotBlocks", "GetNodeStatus", "GetBlockDigests", "ProbeSharedMemory"):
        return True      # replication 1: no server is anybody's backup, so nothing applies
    if method == "OpenDataPlane":
        return True      # it only tells the data plane's address
    if method == "LoadBlocks":
        parsed = [parses(ps.BlockChunk, raw) for raw in request]
        return not any(c is not None and c.header.ref.job == DATA_JOB for c in parsed)
    msg = parses({"InstallShardMap": ps.InstallShardMapRequest, "CopyBlocks": ps.CopyBlocksRequest,
                   "HoldJob": ps.HoldJobRequest, "DropTables": ps.DropTablesRequest}[method], request)
    if msg is None:
        return True
    if method == "InstallShardMap":
        return msg.map.epoch <= w.epoch()
    if method == "CopyBlocks":
        return msg.destination not in real
    if method == "HoldJob":     # a held job's pushes wait: hold none that run_push sends to
        return msg.job not in PUSHED_JOBS
    return msg.job != DATA_JOB


def run_internal(data, w: World, real_refs: bool, safe_only: bool) -> None:
    seeded(data, w)
    method = data.draw(st.sampled_from(sorted(PS_METHODS)), "method")
    kind = PS_METHODS[method]
    form = data.draw(st.sampled_from(["structured"] * 5 + ["mutated", "random"]), "form")
    if method in ("Push", "Pull"):
        form = "random" if form == "structured" else form
    if form == "random":
        n = randint(w, 0, 3) if kind == "stream_unary" else 1
        chunks = [blob(w, 0, 64) for _ in range(n)]
        request = chunks if kind == "stream_unary" else chunks[0]
    else:
        if method in ("Push", "Pull"):
            h = ps.PushHeader(header=pb.RequestHeader(job=DATA_JOB), segments=[pb.Segment(table="w")])
            raw = ps.PushChunk(header=h).SerializeToString() if method == "Push" else \
                ps.PullRequest(header=h.header, segments=h.segments).SerializeToString()
            request = [mutate(data, w, raw)] if method == "Push" else mutate(data, w, raw)
            if method == "Push" and parses(ps.PushChunk, request[0]) is not None:
                return      # a parsable push belongs to run_push's judged fuzzing
            if method == "Pull" and parses(ps.PullRequest, request) is not None:
                return
        else:
            request = internal_request(data, w, method, w.ref.tables if w.ref else {}, real_refs)
            if form == "mutated":
                request = [mutate(data, w, c) for c in request] if kind == "stream_unary" else mutate(data, w, request)
    server = one_of(w, sorted(w.servers))
    if safe_only and not internal_safe(w, method, request):
        w.skipped[method] += 1
        return
    may_wait = not safe_only     # admin calls (holds, copies to dead peers) may block
    w.wire.call(w.channels[server], PS, method, request, kind=kind, may_wait=may_wait,
                first_only=False)
