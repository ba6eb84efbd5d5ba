"""``shardps status``: the cluster status as a readable table, or as a dict for ``--json``."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import manager_pb2 as mg

_MODES = {pb.CONSISTENCY_MODE_UNSPECIFIED: "async", pb.ASYNC: "async", pb.SYNC: "sync", pb.BOUNDED: "ssp"}


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def replication_shortfall(st: mg.ClusterStatus) -> tuple[int, int]:
    """(servers that may hold blocks, under-replicated blocks that cannot get R replicas back
    because there are fewer such servers than R). The manager's rule, from the status alone:
    JOINING and SERVING servers hold blocks; DRAINING and DEAD ones do not."""
    servers = sum(1 for s in st.servers if s.server.state in (pb.JOINING, pb.SERVING))
    return servers, (st.under_replicated_blocks if servers < st.replication else 0)


def format_status(st: mg.ClusterStatus) -> str:
    parts = [f"epoch {st.epoch}   replication {st.replication}   blocks {st.blocks}   "
             f"under-replicated {st.under_replicated_blocks}"]
    servers, unrestorable = replication_shortfall(st)
    if servers < st.replication:
        parts.append(f"replication {st.replication} cannot be restored: {servers} server(s) can hold "
                     f"blocks; {unrestorable} blocks stay under-replicated until "
                     f"{st.replication - servers} more server(s) join")
    parts.append("")
    rows = [[s.server.name, pb.ServerState.Name(s.server.state), str(s.server.incarnation), s.server.address,
             str(s.primary_blocks), str(s.replica_blocks), _bytes(s.bytes), f"{s.heartbeat_age_seconds:.1f}s"]
            for s in st.servers]
    parts.append(_table(["SERVER", "STATE", "INC", "ADDRESS", "PRIMARY", "BACKUP", "BYTES", "HEARTBEAT"], rows))
    for g in st.groups:
        steps = [w.step for w in g.workers]
        slowest = min(steps) if steps else 0
        parts += ["", f"job {g.job}: mode {_MODES.get(g.consistency.mode, '?')}"
                      + (f"(T={g.consistency.staleness})" if g.consistency.mode == pb.BOUNDED else "")
                      + f", {len(g.workers)} workers, {g.tables} tables"]
        wrows = [[str(w.member.rank), w.member.name or w.member.session[:8], str(w.member.incarnation),
                  str(w.step), str(w.step - slowest), f"{w.samples_per_second:.0f}", f"{w.loss:.4f}",
                  f"{w.heartbeat_age_seconds:.1f}s"] for w in g.workers]
        if wrows:
            parts.append(_table(["RANK", "WORKER", "INC", "STEP", "AHEAD", "SAMPLES/S", "LOSS", "HEARTBEAT"],
                                wrows))
    return "\n".join(parts)


def status_to_dict(st: mg.ClusterStatus) -> dict:
    """The message as a dict, plus ``replication_target_reachable`` and
    ``unrestorable_blocks`` (see ``replication_shortfall``)."""
    out = MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    servers, unrestorable = replication_shortfall(st)
    out["replication_target_reachable"] = servers >= st.replication
    out["unrestorable_blocks"] = unrestorable
    return out
