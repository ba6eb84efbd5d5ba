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


_RECOVERY = {pb.DataLoss.LOST: "LOST", pb.DataLoss.RESTORED: "RESTORED", pb.DataLoss.RESET: "RESET",
             pb.DataLoss.PENDING: "RESTORING"}


def restored_text(d, table_blocks: int = 0) -> str:
    """What a restore of lost blocks (``DataLoss`` ``d``, RESTORED) left: the blocks at the
    checkpoint's step, the table's others at their current values, the updates lost (steps
    ``checkpoint_step + 1`` to ``lost_at_step`` where the job's step was known), the way to one
    consistent state. ``table_blocks``: the table's block count, where known."""
    n = len(d.blocks)
    of = f" of {table_blocks}" if table_blocks else ""
    lost = (f"steps {d.checkpoint_step + 1}-{d.lost_at_step}" if d.lost_at_step > d.checkpoint_step
            else f"the steps after {d.checkpoint_step}")
    others = (f"the table's other {table_blocks - n} block(s) keep their current values" if table_blocks > n
              else "the table's other blocks, if any, keep their current values")
    return (f"{n}{of} block(s) restored from checkpoint {d.checkpoint} at step {d.checkpoint_step}; {others}, "
            f"so the table mixes the two; the restored blocks' updates of {lost} are lost. "
            f"`shardps restore JOB` rolls the whole job back to one checkpoint instead")


def data_loss_lines(job: str, losses) -> list[str]:
    """One line per ``DataLoss`` of ``job``: what was lost, when, and what became of it."""
    out = []
    for d in losses:
        blocks = f"{list(d.blocks[:8])}{' ...' if len(d.blocks) > 8 else ''}"
        head = (f"  {_RECOVERY.get(d.recovery, '?'):<9} table {d.table}: {len(d.blocks)} block(s) {blocks} lost "
                f"with server {d.server} at epoch {d.epoch} (step {d.lost_at_step})")
        if d.recovery == pb.DataLoss.RESTORED:
            head += "; " + restored_text(d).replace("JOB", job)
        elif d.recovery == pb.DataLoss.RESET:
            head += "; reset to their initial values"
        elif d.recovery == pb.DataLoss.LOST:
            head += (f": requests touching them fail with DATA_LOSS ({d.detail or 'no checkpoint'}): "
                     f"shardps restore {job}, or shardps reset-lost {job} {d.table}")
        out.append(head)
    return out


def format_status(st: mg.ClusterStatus) -> str:
    parts = [f"epoch {st.epoch}   replication {st.replication}   blocks {st.blocks}   "
             f"under-replicated {st.under_replicated_blocks}   lost {st.lost_blocks}"]
    if st.replication < 2:
        parts.append(f"warning: replication {st.replication}: a server's death loses the values of the "
                     f"blocks it holds (restored from the job's latest checkpoint, if any); run the "
                     f"manager with --replication 2 to survive it")
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
        if g.data_loss:
            parts += ["data lost with servers:"] + data_loss_lines(g.job, g.data_loss)
    return "\n".join(parts)


def status_to_dict(st: mg.ClusterStatus) -> dict:
    """The message as a dict, plus ``replication_target_reachable`` and
    ``unrestorable_blocks`` (see ``replication_shortfall``)."""
    out = MessageToDict(st, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    servers, unrestorable = replication_shortfall(st)
    out["replication_target_reachable"] = servers >= st.replication
    out["unrestorable_blocks"] = unrestorable
    return out


def fetch_node_statuses(st: mg.ClusterStatus, tls=None, token: str = "", timeout: float = 5.0) -> list:
    """Each SERVING or DRAINING server's ``GetNodeStatus`` (its per-table usage and lifecycle
    figures); a server that does not answer is left out."""
    from shardps.errors import ShardpsError
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc.status import translated
    from shardps.rpc.stubs import StubPool
    pool = StubPool(tls, (("authorization", f"Bearer {token}"),) if token else ())
    out = []
    try:
        for s in st.servers:
            if s.server.state not in (pb.SERVING, pb.DRAINING):
                continue
            try:
                with translated(f"GetNodeStatus of {s.server.name}"):
                    out.append(pool.get(s.server.address).GetNodeStatus(
                        ps.GetNodeStatusRequest(), timeout=timeout, metadata=pool.metadata))
            except ShardpsError:
                continue
    finally:
        pool.close()
    return out


def budget_rows(nodes: list) -> list[dict]:
    """Per table with a lifecycle policy, summed over servers (primaries and backups): bytes
    stored, the budget those servers' blocks are allowed, rows in RAM and in the cold tier
    (on disk), and row counters."""
    tables: dict[tuple[str, str], dict] = {}
    for n in nodes:
        for t in n.tables:
            if not t.budget_bytes and not (t.rows_admitted or t.rows_not_admitted):
                continue
            e = tables.setdefault((t.job, t.table), dict(job=t.job, table=t.table, bytes=0, budget_bytes=0,
                                                         rows=0, rows_admitted=0, rows_not_admitted=0,
                                                         rows_evicted_ttl=0, rows_evicted_budget=0,
                                                         rows_cooled=0, cold_rows=0, cold_bytes=0))
            for k in ("bytes", "budget_bytes", "rows", "rows_admitted", "rows_not_admitted",
                      "rows_evicted_ttl", "rows_evicted_budget", "rows_cooled", "cold_rows", "cold_bytes"):
                e[k] += int(getattr(t, k))
    return [tables[k] for k in sorted(tables)]


def format_budgets(nodes: list) -> str:
    """The ``TABLE BUDGET`` section of ``shardps status`` (empty when no table has a policy)."""
    rows = budget_rows(nodes)
    if not rows:
        return ""
    body = [[f"{r['job']}/{r['table']}", _bytes(r["bytes"]),
             _bytes(r["budget_bytes"]) if r["budget_bytes"] else "unbounded",
             f"{100 * r['bytes'] / r['budget_bytes']:.0f}%" if r["budget_bytes"] else "-",
             str(r["rows"]), str(r["cold_rows"]) if r["cold_rows"] or r["rows_cooled"] else "-",
             _bytes(r["cold_bytes"]) if r["cold_rows"] or r["rows_cooled"] else "-",
             str(r["rows_admitted"]), str(r["rows_not_admitted"]),
             str(r["rows_evicted_ttl"]), str(r["rows_evicted_budget"])] for r in rows]
    return _table(["TABLE", "STORED", "BUDGET", "USE", "HOT ROWS", "COLD ROWS", "ON DISK", "ADMITTED",
                   "NOT ADMITTED", "EVICTED TTL", "EVICTED BUDGET"], body)
