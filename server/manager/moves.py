"""Where blocks live: placing new blocks, promoting replicas when a server goes, re-creating
lost blocks, and planning and committing block moves (restore R, rebalance, drain).

Functions of (``ManagerState``, arguments, ``now``) over the state's table records; the ring
and the planner are ``shardps.server.placement``. No I/O: moves are planned here
(``plan_moves``), executed by ``ManagerRuntime`` (copies between servers), and committed here
(``commit_moves``) only if nothing changed under them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardps.server.manager.records import Move, ServerState, TableRecord
from shardps.server.placement import Ring, block_name, plan_placement

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState

log = logging.getLogger("shardps.manager")


def remove_from_blocks(st: ManagerState, name: str, now: float) -> None:
    """Take ``name`` out of every replica list (promoting the next replica). Blocks left
    with no replica at all are re-created empty on a live node: their data is lost."""
    epoch = st.epoch + 1       # the epoch the caller's bump will publish
    others = [n for n in st.candidates() if n != name]
    for t in st.tables.values():
        for i, b in enumerate(t.blocks):
            if name not in b.replicas:
                continue
            b.replicas = [n for n in b.replicas if n != name]
            b.since_epoch = epoch
            if not b.replicas and others:
                node = Ring(others).preference(block_name(t.job, t.spec.name, i), 1)[0]
                b.replicas, b.fresh_epoch = [node], epoch
                log.error("block %s/%s/%d lost its last replica with %s: re-created empty "
                          "on %s (restore a checkpoint to recover its values)",
                          t.job, t.spec.name, i, name, node)


def warn_if_short(st: ManagerState, what: str, nodes: list[str]) -> None:
    """Fewer servers than R: the blocks get one replica per server now, and the missing
    ones are added (``plan_moves``) as servers join. Placement is not refused: a cluster
    that lost servers keeps serving, and servers that start after the first client are
    normal in a deployment."""
    r = st.settings.replication
    if len(nodes) < r:
        log.warning("%s placed with %d replica(s) per block, fewer than the replication "
                    "factor %d: %d server(s) can hold blocks; start more servers to restore it",
                    what, len(nodes), r, len(nodes))


def place_new(st: ManagerState, names: list[str], nodes: list[str]) -> dict[str, list[str]]:
    """Replicas for new blocks ``names``, planned together with every block already placed
    (which stay where they are here): the new blocks fill the least-loaded servers, so
    the rebalancer has no reason to move them right after they were created."""
    current = {block_name(t.job, t.spec.name, i): b.replicas
               for t in st.tables.values() for i, b in enumerate(t.blocks) if b.replicas}
    target = plan_placement(list(current) + names, nodes, st.settings.replication,
                            previous=current)
    return {n: target[n] for n in names}


def replace_lost(st: ManagerState) -> int:
    """Blocks left with no replica (every copy died) are re-created empty on live servers:
    their values are lost until a checkpoint is restored. Returns how many."""
    nodes = st.candidates()
    lost = [(t, i) for t in st.tables.values() for i, b in enumerate(t.blocks) if not b.replicas]
    if not lost or not nodes:
        return 0
    epoch = st.bump()
    names = [block_name(t.job, t.spec.name, i) for t, i in lost]
    placement = plan_placement(names, nodes, st.settings.replication)
    for (t, i), name in zip(lost, names):
        b = t.blocks[i]
        b.replicas, b.since_epoch, b.fresh_epoch = placement[name], epoch, epoch
    log.error("%d blocks had lost every replica: re-created empty on %s (restore a "
              "checkpoint to recover their values)", len(lost), nodes)
    return len(lost)


def plan_moves(st: ManagerState, limit: int | None = None) -> list[Move]:
    """Blocks whose replica set should change (restore R, rebalance, drain), at most
    ``limit`` of them. Each move copies from the current primary to the new nodes."""
    nodes = st.candidates()
    if not nodes:
        return []
    current: dict[str, list[str]] = {}
    refs: dict[str, tuple[TableRecord, int]] = {}
    for t in st.tables.values():
        for i, b in enumerate(t.blocks):
            key = block_name(t.job, t.spec.name, i)
            current[key] = b.replicas
            refs[key] = (t, i)
    target = plan_placement(list(current), nodes, st.settings.replication, previous=current)
    moves = []
    for key in sorted(current):
        before, after = current[key], target[key]
        if before == after or not before:
            continue
        t, i = refs[key]
        add = tuple(n for n in after if n not in before)
        moves.append(Move(t.job, t.spec.name, i, before[0], add, tuple(before), tuple(after)))
        if limit and len(moves) >= limit:
            break
    return moves


def commit_moves(st: ManagerState, moves: list[Move], now: float) -> int:
    """Apply the moves whose copies completed, if their block did not change meanwhile."""
    epoch = st.epoch + 1
    done = 0
    for m in moves:
        t = st.tables.get((m.job, m.table))
        if t is None or m.block >= len(t.blocks):
            continue
        b = t.blocks[m.block]
        if tuple(b.replicas) != m.before:
            continue
        if any(not st.servers.get(n) or st.servers[n].state not in
               (ServerState.JOINING, ServerState.SERVING) for n in m.add):
            continue
        b.replicas = list(m.target)
        b.since_epoch = epoch
        done += 1
    if done:
        st.bump()
    return done
