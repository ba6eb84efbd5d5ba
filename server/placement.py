"""Block placement: a consistent-hash ring proposes, a move-minimising rebalancer caps loads.

``plan_placement`` is a pure function of (blocks, live nodes, replication, previous
placement). The ring (uhashring, hash function and virtual nodes pinned here) gives every
block an ordered preference list of distinct nodes; placement then

1. keeps every previous replica that is still on a live, non-draining node (sticky: nothing
   moves without a reason);
2. fills missing replicas from the block's preference list, skipping nodes at the load cap;
3. moves blocks the ring now prefers on a less-loaded node there (a joining node attracts
   about 1/N of the blocks, as plain consistent hashing would move), then enforces the cap
   ``ceil(mean * (1 + slack))`` and the floor ``floor(mean * (1 - slack))`` by moving the
   fewest blocks;
4. orders each replica list: the previous primary stays primary when it is still a replica,
   and primaries are then balanced across nodes by swapping roles (no data moves).

Only the manager builds the ring; servers and workers use the published shard map.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass

from uhashring import HashRing

VIRTUAL_NODES = 160          # per node: ring load spread about +-10% before rebalancing
DEFAULT_SLACK = 0.05


def ring_hash(key: str) -> int:
    """The pinned ring hash: the first 8 bytes of blake2b, big-endian."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def block_name(job: str, table: str, block: int) -> str:
    return f"{job}/{table}/{block}"


class Ring:
    """A consistent-hash ring over node names (uhashring, pinned hash and virtual nodes).

    Not thread-safe (uhashring is not); build one per planning call.
    """

    def __init__(self, nodes: list[str], vnodes: int = VIRTUAL_NODES):
        self.nodes = sorted(nodes)
        ring = HashRing(self.nodes, vnodes=vnodes, hash_fn=ring_hash) if self.nodes else None
        points = ring.get_points() if ring else []
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]

    def preference(self, key: str, count: int) -> list[str]:
        """Up to ``count`` distinct nodes in ring order, starting at ``key``'s position."""
        if not self._points:
            return []
        count = min(count, len(self.nodes))
        found: list[str] = []
        n = len(self._points)
        pos = bisect_right(self._points, ring_hash(key))
        for i in range(n):
            node = self._owners[(pos + i) % n]
            if node not in found:
                found.append(node)
                if len(found) == count:
                    break
        return found


@dataclass
class PlacementStats:
    max_over_mean: float
    moved_replicas: int
    total_replicas: int

    @property
    def moved_fraction(self) -> float:
        return self.moved_replicas / self.total_replicas if self.total_replicas else 0.0


def plan_placement(blocks: list[str], nodes: list[str], replication: int,
                   previous: dict[str, list[str]] | None = None,
                   slack: float = DEFAULT_SLACK, ring: Ring | None = None) -> dict[str, list[str]]:
    """Return an ordered replica list (primary first) for every block name in ``blocks``.

    ``nodes`` are the live nodes that may hold blocks (draining nodes excluded);
    ``replication`` copies go on distinct nodes (fewer if there are fewer nodes). Blocks with
    no live node at all get an empty list. Pure and deterministic.
    """
    previous = previous or {}
    nodes = sorted(set(nodes))
    if not nodes:
        return {b: [] for b in blocks}
    ring = ring or Ring(nodes)
    r = min(replication, len(nodes))
    live = set(nodes)
    total = len(blocks) * r
    mean = total / len(nodes)
    cap = max(1, math.ceil(mean * (1 + slack)))
    floor = math.floor(mean * (1 - slack))
    depth = min(len(nodes), r + 2)
    pref_cache: dict[str, list[str]] = {}

    def prefs(b: str) -> list[str]:
        p = pref_cache.get(b)
        if p is None:
            p = pref_cache[b] = ring.preference(b, depth)
        return p

    def least_loaded_outside(b: str) -> str:
        return min((n for n in nodes if n not in placed[b]), key=lambda n: (load[n], n))

    load: dict[str, int] = defaultdict(int)
    placed: dict[str, list[str]] = {}
    # node -> its blocks, in insertion order (a dict: set order would vary between processes)
    holders: dict[str, dict[str, None]] = defaultdict(dict)
    # 1. sticky: keep previous replicas on live nodes
    for b in blocks:
        kept = [n for n in previous.get(b, []) if n in live][:r]
        placed[b] = kept
        for n in kept:
            load[n] += 1
            holders[n][b] = None

    def assign(b: str, node: str) -> None:
        placed[b].append(node)
        load[node] += 1
        holders[node][b] = None

    def move(b: str, src: str, dst: str) -> None:
        reps = placed[b]
        reps[reps.index(src)] = dst
        load[src] -= 1
        load[dst] += 1
        holders[src].pop(b, None)
        holders[dst][b] = None

    # 2. fill missing replicas from the preference list, under the cap
    for b in blocks:
        while len(placed[b]) < r:
            choice = next((n for n in prefs(b) if n not in placed[b] and load[n] < cap), None)
            assign(b, choice or least_loaded_outside(b))

    # 3a. attraction: blocks the ring now places on an under-loaded node move there
    target = math.ceil(mean)
    for b in blocks:
        ideal = prefs(b)[:r]
        for n in ideal:
            if n in placed[b] or load[n] >= target:
                continue
            # replace the replica the ring ranks lowest, if it is not ideal and carries more
            outsiders = [x for x in placed[b] if x not in ideal]
            if not outsiders:
                break
            src = max(outsiders, key=lambda x: (load[x], x))
            if load[src] > load[n] + 1:
                move(b, src, n)

    # 3b. cap: move blocks off over-loaded nodes, to their most preferred node with room
    for node in sorted(nodes, key=lambda n: (-load[n], n)):
        if load[node] <= cap:
            continue
        for b in list(holders[node]):
            if load[node] <= cap:
                break
            dst = next((n for n in prefs(b) if n not in placed[b] and load[n] < cap), None)
            dst = dst or least_loaded_outside(b)
            if load[dst] < cap:
                move(b, node, dst)

    # 3c. floor: under-loaded nodes take blocks from the most loaded ones (a lazy max-heap)
    heap = [(-load[n], n) for n in nodes]
    heapq.heapify(heap)
    for node in sorted(nodes):
        skipped: list[tuple[int, str]] = []           # donors with nothing `node` may take
        while load[node] < floor and heap:
            neg, donor = heap[0]
            if -neg != load[donor]:                   # stale entry: refresh it
                heapq.heapreplace(heap, (-load[donor], donor))
                continue
            if load[donor] <= load[node] + 1:
                break
            # prefer a block whose ring preference includes `node`, else any it may take
            block = next((b for b in holders[donor] if node not in placed[b] and node in prefs(b)), None)
            block = block or next((b for b in holders[donor] if node not in placed[b]), None)
            if block is None:
                skipped.append(heapq.heappop(heap))
                continue
            move(block, donor, node)
            heapq.heapreplace(heap, (-load[donor], donor))
        for item in skipped:                          # they may still give to the next nodes
            heapq.heappush(heap, item)

    # 4. order replicas: previous primary first, then ring order; then balance primaries
    primaries: dict[str, int] = defaultdict(int)
    for b in blocks:
        reps = placed[b]
        if len(reps) > 1:
            order = prefs(b)
            reps.sort(key=lambda n: _rank(order, n))
        old = previous.get(b)
        if old and old[0] in reps:
            reps.remove(old[0])
            reps.insert(0, old[0])
        if reps:
            primaries[reps[0]] += 1
    if r > 1:
        pcap = math.ceil(len(blocks) / len(nodes) * (1 + slack))
        for node in sorted(nodes, key=lambda n: (-primaries[n], n)):
            for b in list(holders[node]):
                if primaries[node] <= pcap:
                    break
                reps = placed[b]
                if reps[0] != node:
                    continue
                other = min(reps[1:], key=lambda n: (primaries[n], n))
                if primaries[other] < pcap:
                    reps.remove(other)
                    reps.insert(0, other)
                    primaries[node] -= 1
                    primaries[other] += 1
    return placed


def _rank(order: list[str], node: str) -> int:
    try:
        return order.index(node)
    except ValueError:
        return len(order)


def placement_stats(placement: dict[str, list[str]], nodes: list[str],
                    previous: dict[str, list[str]] | None = None) -> PlacementStats:
    """Max/mean replicas per node, and how many replicas are on a node they were not on before."""
    load = {n: 0 for n in nodes}
    moved = total = 0
    for b, reps in placement.items():
        before = set((previous or {}).get(b, []))
        for n in reps:
            load[n] = load.get(n, 0) + 1
            total += 1
            if previous is not None and n not in before:
                moved += 1
    mean = total / max(1, len(load))
    return PlacementStats(max(load.values()) / mean if mean else 0.0, moved, total)
