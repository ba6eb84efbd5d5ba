"""Where blocks live: placing new blocks, promoting replicas when a server goes, re-creating
lost blocks, and planning and committing block moves (restore R, rebalance, drain).

Functions of (``ManagerState``, arguments, ``now``) over the state's table records; the
planner is ``shardps.server.placement``. No I/O: moves are planned here, executed by
``ManagerRuntime`` (copies between servers), and committed here (``commit_moves``) only if
nothing changed under them.

Planning runs without the state's lock: ``snapshot`` (under the lock, references only) ->
``plan_from`` (pure, no lock) -> ``still_valid`` (under the lock: is the plan still about the
current placement?) -> copies -> ``commit_moves``. ``plan_moves`` does the first two at once.
Contract this relies on: ``BlockRecord.replicas`` is replaced, never mutated in place.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from shardps.server.manager import losses
from shardps.server.manager.records import BlockRecord, Move, ServerState, TableRecord
from shardps.server.placement import place_blocks, plan_changes, ring_hash

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState

log = logging.getLogger("shardps.manager")


def _all_replicas(st: ManagerState) -> list[list[str]]:
    return [b.replicas for t in st.tables.values() for b in t.blocks]


class HolderIndex:
    """Which blocks each node may hold, so that a server's death touches its blocks only.

    A superset, kept current by this module's functions (``commit_moves``,
    ``remove_from_blocks``, ``replace_lost``) and by ``sync`` (tables that appeared or went
    since, found by identity): an entry whose block no longer lists the node, or whose table
    is gone, is skipped when read and dropped as the lists grow. Code elsewhere that assigns
    ``BlockRecord.replicas`` of a table already in the state must call ``index(st).add`` for
    each node it adds (or set ``st.holders = None`` to have it rebuilt).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.by_node: dict[str, list[BlockRecord]] = {}
        self.tables: dict[int, TableRecord] = {}        # covered tables, by id
        self.gone: list[TableRecord] = []               # held, so that their ids stay unique
        self.dropped: set[int] = set()                  # ids of the blocks of gone tables
        self.orphans: list[BlockRecord] = []            # blocks that were left with no replica

    def add(self, node: str, b: BlockRecord) -> None:
        lst = self.by_node.setdefault(node, [])
        lst.append(b)
        n = len(lst)
        if n >= 64 and not n & (n - 1):                 # at powers of two: drop stale entries
            lst[:] = self._valid(node, lst)

    def _valid(self, node: str, lst: list[BlockRecord]) -> list[BlockRecord]:
        seen: set[int] = set()
        out = []
        for b in lst:
            k = id(b)
            if node in b.replicas and k not in self.dropped and k not in seen:
                seen.add(k)
                out.append(b)
        return out

    def take(self, node: str) -> list[BlockRecord]:
        """The blocks that list ``node`` now; its entries are dropped (it is leaving)."""
        return self._valid(node, self.by_node.pop(node, []))

    def sync(self, st: ManagerState) -> None:
        """Cover the state's tables: index the new ones, forget the gone ones."""
        current = {id(t): t for t in st.tables.values()}
        for k in [k for k in self.tables if k not in current]:
            t = self.tables.pop(k)
            self.gone.append(t)
            self.dropped.update(id(b) for b in t.blocks)
        if len(self.dropped) > sum(len(t.blocks) for t in self.tables.values()):
            self.reset()                                # mostly garbage: start over
        by_node = self.by_node
        for k, t in current.items():
            if k in self.tables:
                continue
            self.tables[k] = t
            for b in t.blocks:
                if not b.replicas:
                    self.orphans.append(b)
                for n in b.replicas:
                    lst = by_node.get(n)
                    if lst is None:
                        lst = by_node[n] = []
                    lst.append(b)


def index(st: ManagerState) -> HolderIndex:
    """The state's holder index, in sync with its tables (built on first use)."""
    if st.holders is None:
        st.holders = HolderIndex()
    st.holders.sync(st)
    return st.holders


def _positions(st: ManagerState, blocks: list[BlockRecord]) -> list[tuple[TableRecord, int]]:
    want = {id(b) for b in blocks}
    found = {id(b): (t, i) for t in st.tables.values() for i, b in enumerate(t.blocks) if id(b) in want}
    return [found[id(b)] for b in blocks if id(b) in found]


def remove_from_blocks(st: ManagerState, name: str, now: float) -> None:
    """Take ``name`` out of every replica list (promoting the next replica). Blocks left
    with no replica at all lost their values: they are placed again, empty, on the
    least-loaded live nodes but marked lost (``lost_epoch``), so the servers refuse every
    request touching them (DATA_LOSS) until they are restored from a checkpoint or reset;
    each job gets a ``DataLossRecord`` per table. Touches ``name``'s blocks only
    (``HolderIndex``)."""
    epoch = st.epoch + 1       # the epoch the caller's bump will publish
    idx = index(st)
    lost: list[BlockRecord] = []
    for b in idx.take(name):
        b.replicas = [n for n in b.replicas if n != name]
        b.since_epoch = epoch
        if not b.replicas:
            lost.append(b)
    others = [n for n in st.candidates() if n != name]
    if not lost:
        return
    for b in lost:
        b.lost_epoch = b.lost_epoch or epoch
    losses.record_loss(st, _positions(st, lost), name, epoch)
    if not others:
        idx.orphans.extend(lost)
        return
    load = {n: len(idx.by_node.get(n, ())) for n in others}     # about: stale entries count
    for b, reps in zip(lost, place_blocks(len(lost), others, 1, seed=epoch, load=load)):
        b.replicas, b.fresh_epoch = reps, epoch
        idx.add(reps[0], b)


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
    """Replicas for new blocks ``names``, given every block already placed (which stay where
    they are): the new blocks fill the least-loaded servers (and spread primaries the same
    way), so the rebalancer has no reason to move them right after they were created."""
    seed = ring_hash(names[0]) if names else 0
    placed = place_blocks(len(names), nodes, st.settings.replication, _all_replicas(st), seed)
    return dict(zip(names, placed))


def replace_lost(st: ManagerState) -> int:
    """Blocks left with no replica (every copy died, and no other server was live) are
    placed again on live servers, still marked lost (``remove_from_blocks``). Returns how
    many. Looks at the blocks that were left with none only (``HolderIndex.orphans``)."""
    nodes = st.candidates()
    idx = index(st)
    if not idx.orphans or not nodes:
        return 0
    lost = [b for b in idx.orphans if not b.replicas and id(b) not in idx.dropped]
    idx.orphans = []
    if not lost:
        return 0
    epoch = st.bump()
    placed = place_blocks(len(lost), nodes, st.settings.replication, _all_replicas(st), seed=epoch)
    for b, reps in zip(lost, placed):
        b.replicas, b.since_epoch, b.fresh_epoch = reps, epoch, epoch
        b.lost_epoch = b.lost_epoch or epoch
        for n in reps:
            idx.add(n, b)
    log.error("%d blocks that had lost every replica are placed again on %s, still lost: "
              "requests touching them fail with DATA_LOSS until they are restored or reset",
              len(lost), nodes)
    return len(lost)


@dataclass(frozen=True)
class PlanInput:
    """What planning reads, taken under the state's lock in one pass of references (no
    copies): ``BlockRecord.replicas`` lists are replaced when a placement changes, never
    mutated in place, so planning may read them after the lock is released.

    ``tables`` and ``servers`` identify the placement the plan was made for
    (``still_valid``)."""

    epoch: int
    replication: int
    nodes: tuple[str, ...]
    servers: tuple[tuple[str, int, bool, bool], ...]
    tables: tuple[TableRecord, ...]
    starts: tuple[int, ...]            # index of each table's first block in ``replicas``
    replicas: list[list[str]]


def _servers_key(st: ManagerState) -> tuple[tuple[str, int, bool, bool], ...]:
    """What placement reads of the servers: (name, incarnation, live, may hold blocks); a
    joining server that starts serving changes none of it."""
    hold = (ServerState.JOINING, ServerState.SERVING)
    return tuple((n, s.incarnation, s.live, s.state in hold) for n, s in sorted(st.servers.items()))


def snapshot(st: ManagerState) -> PlanInput:
    """The input of ``plan_from``; call it under the lock (about 40 ms at 1,000,000 blocks)."""
    tables = tuple(st.tables.values())
    starts, n = [], 0
    for t in tables:
        starts.append(n)
        n += len(t.blocks)
    replicas = list(chain.from_iterable([b.replicas for b in t.blocks] for t in tables))
    return PlanInput(st.epoch, st.settings.replication, tuple(st.candidates()), _servers_key(st),
                     tables, tuple(starts), replicas)


def still_valid(st: ManagerState, snap: PlanInput) -> bool:
    """Whether moves planned from ``snap`` still apply to ``st``: nothing changed (same
    epoch), or only what placement does not read changed (worker groups, table configs,
    heartbeats, a joining server that starts serving): the same servers, incarnations,
    live and holding servers, the same table records. ``commit_moves`` still checks each
    block before it changes it."""
    if st.epoch == snap.epoch:
        return True
    tables = tuple(st.tables.values())
    return (_servers_key(st) == snap.servers and len(tables) == len(snap.tables)
            and all(a is b for a, b in zip(tables, snap.tables)))


def plan_from(snap: PlanInput, limit: int | None = None) -> list[Move]:
    """Blocks whose replica set should change (restore R first, then rebalance and drain),
    at most ``limit`` of them. Each move copies from the current primary to the new nodes.
    Pure: reads ``snap`` only, so it runs without the state's lock."""
    if not snap.nodes:
        return []
    changes = plan_changes(snap.replicas, snap.nodes, snap.replication, seed=snap.epoch)
    r = min(snap.replication, len(snap.nodes))
    moves = []
    for i in sorted(changes, key=lambda i: (len(snap.replicas[i]) >= r, i)):
        before, after = snap.replicas[i], changes[i]
        if not before:
            continue
        k = bisect_right(snap.starts, i) - 1
        t = snap.tables[k]
        add = tuple(n for n in after if n not in before)
        moves.append(Move(t.job, t.spec.name, i - snap.starts[k], before[0], add, tuple(before),
                          tuple(after)))
        if limit and len(moves) >= limit:
            break
    return moves


def plan_moves(st: ManagerState, limit: int | None = None) -> list[Move]:
    """``plan_from(snapshot(st), limit)``: plan with the lock held all along (tests, tools)."""
    return plan_from(snapshot(st), limit)


def copy_destinations(st: ManagerState) -> dict[str, int]:
    """The servers a block may be copied to now, with their incarnations: the SERVING ones.

    A JOINING server has registered its new incarnation here, but its process may not have
    dropped the previous incarnation's state yet: a fenced server (paused past its lease)
    re-registers, and only then resets and installs the map. A copy that lands in between
    is loaded into the old state (or refused, if the old map made it a primary) and wiped by
    the reset; committing the move would list a replica whose state never arrives (the
    node marks it ``missing``, for good, and serves it once the other replicas are gone).
    Its first heartbeat under the new incarnation, sent after the reset and the install,
    makes it SERVING."""
    return {n: s.incarnation for n, s in st.servers.items() if s.state is ServerState.SERVING}


def commit_moves(st: ManagerState, moves: list[Move], now: float,
                 copied_to: dict[str, int] | None = None) -> int:
    """Apply the moves whose copies completed, if their block did not change meanwhile.

    ``copied_to``: the incarnation of each destination the copies were sent to
    (``copy_destinations`` when they started); a move is not applied if one of its new
    nodes is another incarnation now (it restarted during the copy and holds nothing)."""
    epoch = st.epoch + 1
    done = 0
    idx = index(st)
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
        if copied_to is not None and any(copied_to.get(n) != st.servers[n].incarnation for n in m.add):
            continue
        b.replicas = list(m.target)
        b.since_epoch = epoch
        for n in m.add:
            idx.add(n, b)
        done += 1
    if done:
        st.bump()
    return done
