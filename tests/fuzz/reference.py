"""The reference model: the data job as the wire contract says it must be.

For every Push or Pull, ``Reference`` computes the rules the request breaks and the status
codes they map to (a ``Verdict``); a request breaking none is applied to the reference
(plain SGD in numpy, exactly-once per block for replayed sequence numbers), and a pull's
answer is checked against it (``check_pull_response``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from tests.fuzz.encoder import ITEMSIZE, narrow_expected, splitmix64, widen
from tests.fuzz.wire import EXHAUSTED, FAILED, INVALID, NOT_FOUND, SHM_REFUSED, UNAVAILABLE

DATA_JOB = "fuzz"
MEMBER_NAME = "fuzz-member-5b1e"          # never produced by the generators
UNKNOWN_TABLE = "zz"                      # never created anywhere
UNKNOWN_JOB = "nojob"                     # never created anywhere
SCRATCH_JOBS = ["scr-1", "scr-2", "scr_3"]
SCRATCH_TABLES = ["t1", "t2", "t/3"]
BAD_NAMES = ["", "x" * 200, "sp ace", "\u00fc", "../etc", "a\x00b"]
PUSHED_JOBS = [DATA_JOB, "", UNKNOWN_JOB, SCRATCH_JOBS[0]]     # the jobs data requests name


@dataclass
class RefTable:
    name: str
    dense: bool
    numel: int = 0            # dense
    block_size: int = 0
    dim: int = 1              # sparse
    num_rows: int = 0
    num_blocks: int = 0
    init_value: float = 0.0   # sparse: CONSTANT initializer
    assigned: bool = False
    lr: float = 0.5
    weight_decay: float = 0.0
    allow_non_finite: bool = False
    values: np.ndarray | None = None                       # dense
    rows: dict[int, np.ndarray] = field(default_factory=dict)   # sparse: stored rows
    initialized: set[int] = field(default_factory=set)     # dense ASSIGNED: written blocks
    blocks: int = 0
    config_version: int = 1

    def block_of_id(self, i: int) -> int:
        return splitmix64(i & ((1 << 64) - 1)) % self.num_blocks

    def blocks_of_range(self, lo: int, hi: int) -> range:
        return range(lo // self.block_size, (hi - 1) // self.block_size + 1)

    def block_range(self, b: int) -> tuple[int, int]:
        return b * self.block_size, min((b + 1) * self.block_size, self.numel)

    def sgd(self, params: np.ndarray, grad: np.ndarray) -> np.ndarray:
        lr = np.float32(self.lr)
        with np.errstate(all="ignore"):
            if self.weight_decay:
                grad = grad + np.float32(self.weight_decay) * params
            return params - lr * grad

    def row(self, i: int) -> np.ndarray:
        stored = self.rows.get(i)
        return stored if stored is not None else np.full(self.dim, self.init_value, np.float32)


MAX_CLOCK = 1 << 40        # RequestHeader.clock bound (a worker's completed steps)


@dataclass
class Verdict:
    """The rules a request breaks (their codes) and, if none, what applying it does."""

    codes: set = field(default_factory=set)
    reasons: list = field(default_factory=list)
    plan: list = field(default_factory=list)      # push: (table, block, kind, payload)
    touched: set = field(default_factory=set)     # push: blocks whose writer record changes
    writer: tuple | None = None
    expect: list = field(default_factory=list)    # pull: per segment what must come back
    may_wait: bool = False

    @property
    def ok(self) -> bool:
        return not self.codes

    def bad(self, code, reason: str) -> None:
        for c in ([code] if isinstance(code, str) else code):
            self.codes.add(c)
        self.reasons.append(reason)


class WriterRecord:
    """Exactly-once record of one writer on one block (the contract of RequestHeader)."""

    def __init__(self):
        self.floor = 0
        self.applied: set[int] = set()

    def seen(self, seq: int) -> bool:
        return seq < self.floor or seq in self.applied

    def add(self, seq: int, acked_below: int) -> None:
        self.floor = max(self.floor, acked_below)
        self.applied.add(seq)


class Reference:
    """The data job as the wire contract says it must be, plus the server-side limits."""

    def __init__(self, tables: dict[str, RefTable], member: tuple[str, int], limits: dict):
        self.tables = tables
        self.member = member                  # (session, incarnation)
        self.limits = limits
        self.map_epoch = 0
        self.records: dict[tuple[str, int], WriterRecord] = defaultdict(WriterRecord)
        self.applied_pushes = 0
        self.placement: dict[str, tuple[list[str], list[int]]] = {}   # table -> (primaries, since)
        self._placements: dict[int, dict] = {}

    def use(self, shard_map: pb.ShardMap) -> "Reference":
        """Judge the next requests under ``shard_map`` (the one the servers have installed)."""
        cached = self._placements.get(shard_map.epoch)
        if cached is None:
            names = [srv.name for srv in shard_map.servers]
            cached = {tp.spec.name: ([names[bp.replicas[0]] if bp.replicas else "" for bp in tp.blocks],
                                     [bp.since_epoch for bp in tp.blocks])
                      for tp in shard_map.tables if tp.job == DATA_JOB and tp.spec.name in self.tables}
            self._placements = {shard_map.epoch: cached}
        self.placement = cached
        self.map_epoch = shard_map.epoch
        return self

    def preview(self, v: Verdict) -> dict:
        """The touched blocks' contents after applying ``v`` (the reference is not changed)."""
        saved = {t.name: (None if t.values is None else t.values.copy(), dict(t.rows), set(t.initialized))
                 for (t, *_rest) in v.plan}
        records, pushes = self.records, self.applied_pushes
        self.records = defaultdict(WriterRecord)
        try:
            self.apply(v)
            return self.block_contents(v)
        finally:
            for t, *_rest in v.plan:
                t.values, t.rows, t.initialized = saved[t.name]
            self.records, self.applied_pushes = records, pushes

    def block_contents(self, v: Verdict) -> dict:
        out = {}
        for (t, b, _kind, _lo, _hi, seg) in v.plan:
            if t.dense:
                a, z = t.block_range(b)
                out[(t.name, b)] = t.values[a:z].copy()
            else:
                ids = sorted(i for i in seg["summed"] if t.block_of_id(i) == b)
                out[(t.name, b)] = (ids, np.array([t.row(i) for i in ids], np.float32))
        return out

    def primary(self, t: RefTable, b: int) -> str:
        return self.placement[t.name][0][b]

    # ---------------------------------------------------------------- push
    def judge_push(self, server: str, h: ps.PushHeader, payload: bytes) -> Verdict:
        v = Verdict()
        hdr = h.header
        if not 0 <= hdr.clock < MAX_CLOCK:
            v.bad(INVALID, f"clock {hdr.clock} outside [0, 2**40)")
            return v
        if h.kind not in (ps.PUSH_KIND_UNSPECIFIED, ps.GRADIENT, ps.INITIALIZE, ps.ASSIGN):
            v.bad(INVALID, f"unknown push kind {h.kind}")
        kind = h.kind or ps.GRADIENT
        if h.shared_memory.name:
            v.bad(SHM_REFUSED, "shared-memory payload that does not exist")
        if hdr.epoch > self.map_epoch:
            v.bad(UNAVAILABLE, "epoch ahead of the server")
        session, incarnation = self.member
        if hdr.job == DATA_JOB and hdr.session == session and hdr.incarnation != incarnation:
            v.bad(FAILED, "fenced incarnation")
        segments = self._parse(v, hdr, h.segments, payload, with_values=True)
        if segments is None:
            return v
        if kind == ps.GRADIENT and not (hdr.session and hdr.sequence):
            v.bad(INVALID, "a GRADIENT push without a session and a sequence (cannot be deduplicated)")
            return v
        if kind == ps.ASSIGN:
            for i, seg in enumerate(segments):
                if "summed" in seg and len(seg["summed"]) < len(seg["ids"]):
                    v.bad(INVALID, f"segment {i}: ASSIGN repeats an id (each row is written once)")
        parts = self._parts(v, server, hdr, segments, pull=False)
        if parts is None or not v.ok:
            return v
        tracked = bool(hdr.session) and hdr.sequence > 0
        mine = tracked and (hdr.session, hdr.incarnation) == self.member
        for (t, b, lo, hi, _seg) in parts:
            if mine and self.records[(t.name, b)].seen(hdr.sequence):
                continue
            if kind == ps.INITIALIZE:
                if not t.dense:
                    v.bad(INVALID, "INITIALIZE of a sparse table")
                elif (lo, hi) != t.block_range(b):
                    v.bad(INVALID, "INITIALIZE of part of a block")
            elif kind == ps.ASSIGN:
                if t.dense and t.assigned and b not in t.initialized and (lo, hi) != t.block_range(b):
                    v.bad(INVALID, "ASSIGN of part of a block without initial values")
            elif t.dense and t.assigned and b not in t.initialized:
                v.bad(FAILED, "gradient before INITIALIZE")
        if not v.ok:
            return v
        for (t, b, lo, hi, seg) in parts:
            if mine and self.records[(t.name, b)].seen(hdr.sequence):
                continue
            v.plan.append((t, b, kind, lo, hi, seg))
        if mine:
            v.touched = {(t.name, b) for (t, b, *_rest) in parts}
            v.writer = (hdr.sequence, hdr.acked_below)
        return v

    def apply(self, v: Verdict) -> None:
        for (t, b, kind, lo, hi, seg) in v.plan:
            if t.dense:
                grad = seg["values"][lo - seg["lo"]:hi - seg["lo"]]
                if kind == ps.INITIALIZE:
                    if t.assigned and b not in t.initialized:
                        t.values[lo:hi] = grad
                        t.initialized.add(b)
                elif kind == ps.ASSIGN:              # overwrite (SGD keeps no state)
                    t.values[lo:hi] = grad
                    t.initialized.add(b)
                else:
                    t.values[lo:hi] = t.sgd(t.values[lo:hi], grad)
            else:
                for i, g in seg["summed"].items():   # ASSIGN: ids unique (judge_push)
                    if t.block_of_id(i) == b:
                        t.rows[i] = np.asarray(g, np.float32) if kind == ps.ASSIGN else t.sgd(t.row(i), g)
        if v.writer is not None:
            seq, acked = v.writer
            for key in v.touched:
                self.records[key].add(seq, acked)
        self.applied_pushes += 1

    # ---------------------------------------------------------------- pull
    def judge_pull(self, server: str, req: ps.PullRequest) -> Verdict:
        v = Verdict()
        hdr = req.header
        if not 0 <= hdr.clock < MAX_CLOCK:
            v.bad(INVALID, f"clock {hdr.clock} outside [0, 2**40)")
            return v
        if req.reply_shared_memory.name:
            v.bad(SHM_REFUSED, "shared-memory reply region that does not exist")
        if hdr.job != DATA_JOB and hdr.session:
            # a scratch job may be SYNC or SSP: the pull first waits for the slowest
            # worker, up to the deadline, and only then looks at the request (see
            # test_a_pull_is_validated_before_it_waits_for_the_clock)
            v.may_wait = True
        if hdr.epoch > self.map_epoch:
            v.bad(UNAVAILABLE, "epoch ahead of the server")
        segments = self._parse(v, hdr, req.segments, req.data, with_values=False)
        if segments is None:
            return v
        parts = self._parts(v, server, hdr, segments, pull=True)
        if parts is None:
            return v
        for (t, b, _lo, _hi, _seg) in parts:
            if t.dense and t.assigned and b not in t.initialized:
                # the proto says such pulls wait (until the deadline); the code refuses them
                v.bad({FAILED, "DEADLINE_EXCEEDED"}, "pull of a block not initialized yet")
                v.may_wait = True
        wire = hdr.wire_dtype or pb.FLOAT32
        for seg in segments:
            t = seg["table"]
            if seg.get("all_stored"):
                mine = sorted(i for i in t.rows if self.primary(t, t.block_of_id(i)) == server)
                v.expect.append(("stored", wire, mine, [t.row(i) for i in mine]))
            elif t.dense:
                v.expect.append(("values", wire, t.values[seg["lo"]:seg["hi"]].copy()))
            else:
                ids = seg["ids"]
                rows = np.array([t.row(int(i)) for i in ids], np.float32).reshape(len(ids), t.dim)
                v.expect.append(("values", wire, rows.reshape(-1)))
        return v

    # ---------------------------------------------------------------- shared rules
    def _parse(self, v: Verdict, hdr, segments, payload: bytes, with_values: bool):
        """Segment rules, in the order of the payload. None once the layout is lost."""
        if not hdr.job:
            v.bad(INVALID, "no job")
        if len(segments) > self.limits["max_segments"]:
            v.bad(EXHAUSTED, "too many segments")
        wire = hdr.wire_dtype
        if wire not in ITEMSIZE:
            v.bad(INVALID, f"wire dtype {wire} cannot carry values")
            return None
        itemsize = ITEMSIZE[wire]
        offset, rows, out = 0, 0, []
        for i, seg in enumerate(segments):
            t = self.tables.get(seg.table) if hdr.job == DATA_JOB else None
            if t is None:
                v.bad(NOT_FOUND, f"segment {i}: unknown table {seg.table!r} of job {hdr.job!r}")
                return None
            which = seg.WhichOneof("selector")
            s = {"table": t}
            if t.dense:
                if which != "range":
                    v.bad(INVALID, f"segment {i}: dense table without a range")
                    return None
                lo, hi = seg.range.start, seg.range.stop
                if not 0 <= lo < hi <= t.numel:
                    v.bad(INVALID, f"segment {i}: range [{lo}, {hi})")
                    return None
                s.update(lo=lo, hi=hi)
                if with_values:
                    n = (hi - lo) * itemsize
                    if offset + n > len(payload):
                        v.bad(INVALID, f"segment {i}: short payload")
                        return None
                    s["values"] = widen(payload[offset:offset + n], wire, hi - lo)
                    offset += n
            else:
                if which != "rows":
                    v.bad(INVALID, f"segment {i}: sparse table without rows")
                    return None
                if seg.rows.all_stored:
                    if with_values or seg.rows.count:
                        v.bad(INVALID, f"segment {i}: all_stored with count or in a push")
                        return None
                    s["all_stored"] = True
                    out.append(s)
                    continue
                count = seg.rows.count
                rows += count
                if rows > self.limits["max_rows"]:
                    v.bad(EXHAUSTED, "over max_rows")
                    return None
                n = count * 8
                if offset + n > len(payload):
                    v.bad(INVALID, f"segment {i}: fewer ids than declared")
                    return None
                ids = np.frombuffer(payload[offset:offset + n], "<i8").astype(np.int64)
                offset += n
                if t.num_rows and ids.size and (ids.min() < 0 or ids.max() >= t.num_rows):
                    v.bad(INVALID, f"segment {i}: id out of bounds")
                    return None
                s["ids"] = ids
                if with_values:
                    n = count * t.dim * itemsize
                    if offset + n > len(payload):
                        v.bad(INVALID, f"segment {i}: short values")
                        return None
                    s["values"] = widen(payload[offset:offset + n], wire, count * t.dim).reshape(count, t.dim)
                    offset += n
                    # duplicates are summed (their rows in arrival order, reduced the way
                    # numpy reduces a stack of rows: the contract leaves the order open, and a
                    # bit-exact reference needs the same one)
                    summed: dict[int, np.ndarray] = {}
                    with np.errstate(all="ignore"):
                        for i_ in dict.fromkeys(ids.tolist()):
                            rows_of = s["values"][ids == i_]
                            summed[i_] = rows_of[0].copy() if len(rows_of) == 1 else \
                                np.add.reduceat(rows_of, [0], axis=0)[0]
                    s["summed"] = summed
            if with_values and not t.allow_non_finite and not np.isfinite(s["values"]).all():
                v.bad(INVALID, f"segment {i}: NaN/Inf")
                return None
            out.append(s)
        if offset != len(payload):
            v.bad(INVALID, f"payload has {len(payload)} bytes, segments describe {offset}")
            return None
        return out

    def _parts(self, v: Verdict, server: str, hdr, segments, pull: bool):
        """(table, block, lo, hi, segment) per block touched; ownership rules."""
        parts = []
        for s in segments:
            t = s["table"]
            if s.get("all_stored"):     # the blocks this server is primary of; none can be stale
                if any(self.primary(t, b) == server and self.placement[t.name][1][b] > hdr.epoch
                       for b in range(t.blocks)):
                    v.bad(FAILED, f"a block of {t.name} moved after epoch {hdr.epoch}")
                    return None
                continue
            if t.dense:
                blocks = [(b, max(s["lo"], t.block_range(b)[0]), min(s["hi"], t.block_range(b)[1]))
                          for b in t.blocks_of_range(s["lo"], s["hi"])]
            else:
                ids = s["ids"] if pull else np.array(sorted(s["summed"]), np.int64)
                blocks = sorted({(t.block_of_id(int(i)), 0, 0) for i in ids.tolist()})
            for b, lo, hi in blocks:
                if self.primary(t, b) != server:
                    v.bad(FAILED, f"block {t.name}/{b} is served by {self.primary(t, b)}")
                    return None
                if self.placement[t.name][1][b] > hdr.epoch:
                    v.bad(FAILED, f"block {t.name}/{b} moved after epoch {hdr.epoch}")
                    return None
                parts.append((t, b, lo, hi, s))
        return parts


def check_pull_response(chunks: list[bytes], expect: list, described: str) -> None:
    msgs = [ps.PullChunk.FromString(c) for c in chunks]
    assert msgs and msgs[0].HasField("header"), f"first chunk has no header: {described}"
    assert not any(m.HasField("header") for m in msgs[1:]), f"header repeated: {described}"
    head = msgs[0].header
    payload = b"".join(m.data for m in msgs)
    assert head.payload_bytes == len(payload), f"payload_bytes {head.payload_bytes} != {len(payload)}"
    assert len(head.segments) == len(expect), f"{len(head.segments)} layouts for {len(expect)} segments"
    pos = 0
    for layout, exp in zip(head.segments, expect):
        wire = exp[1]
        assert layout.dtype == (wire or pb.FLOAT32), f"layout dtype {layout.dtype}, asked {wire}"
        size = ITEMSIZE[wire]
        if exp[0] == "stored":
            ids = np.frombuffer(payload[pos:pos + 8 * layout.ids], "<i8")
            pos += 8 * layout.ids
            got = widen(payload[pos:pos + size * layout.elements], wire, layout.elements)
            pos += size * layout.elements
            order = np.argsort(ids, kind="stable")
            assert ids[order].tolist() == exp[2], f"stored ids {sorted(ids.tolist())} != {exp[2]}: {described}"
            want = (narrow_expected(np.concatenate(exp[3]), wire) if exp[3]
                    else np.empty(0, np.float32))
            got = got.reshape(len(ids), -1)[order].reshape(-1) if len(ids) else got
            np.testing.assert_array_equal(got, want, err_msg=described)
        else:
            assert layout.elements == exp[2].size, f"{layout.elements} values, expected {exp[2].size}"
            got = widen(payload[pos:pos + size * layout.elements], wire, layout.elements)
            pos += size * layout.elements
            np.testing.assert_array_equal(got, narrow_expected(exp[2], wire), err_msg=described)
    assert pos == len(payload), f"payload has {len(payload)} bytes; layouts describe {pos}"
