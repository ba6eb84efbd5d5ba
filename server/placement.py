"""Block placement: sticky replicas, water-filled gaps, and a bounded rebalance.

The planner is a pure function of (current replica lists, live nodes, replication, slack,
seed) whose cost is a few C-speed passes over the lists plus work proportional to what
changes: at 1,000 nodes x 1,000,000 blocks a plan takes well under a second, however many
blocks it moves. ``plan_changes`` works on lists indexed by block (the manager's form);
``plan_placement`` is the same planner over block names (the simulation's form).

1. **Sticky.** A replica on a live node stays where it is. Replicas on nodes that are not
   live (dead, draining) or beyond R are dropped; only those blocks are looked at further.
2. **Fill.** The missing replicas go to the least-loaded nodes: the loads are water-filled
   (each node's share of the missing replicas levels the loads), and the shares are dealt
   in shuffled rounds, so a failed node's blocks spread over every other node and blocks
   share no fixed partner. A block's replicas are distinct; a block that had none gets as
   primary its replica with the fewest primaries.
3. **Rebalance.** Only if a node is above ``ceil(mean * (1 + slack))`` or below
   ``floor(mean * (1 - slack))``: it sheds down to ``ceil(mean)`` or is filled up to
   ``floor(mean)``, the other side of each move being the most (least) loaded nodes, and
   the blocks found by one pass over the blocks in a seeded random order that stops when
   every move is matched. A joining node takes its fair share and nothing else moves.
   A move replaces the replica in place (a moved primary's successor is primary).
4. **Primaries.** With R > 1, nodes that lead more than ``ceil(pmean * (1 + slack))`` blocks
   (or fewer than ``floor(pmean * (1 - slack))``) swap roles with another replica of the
   block (no data moves); otherwise the previous primary stays primary.

Deterministic: equal inputs (seed included) give equal plans, in any process. A plan with
nothing to repair and loads within the slack changes nothing.

``Ring`` (consistent hashing over uhashring, pinned hash and virtual nodes) is kept for
callers that need a stable preference list of nodes per key; the planner does not use it.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Iterator, Sequence

from uhashring import HashRing

VIRTUAL_NODES = 160
DEFAULT_SLACK = 0.05
LOOKAHEAD = 64           # dealt nodes examined for one a block may take


def ring_hash(key: str) -> int:
    """The pinned hash: the first 8 bytes of blake2b, big-endian."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def block_name(job: str, table: str, block: int) -> str:
    return f"{job}/{table}/{block}"


class Ring:
    """A consistent-hash ring over node names (uhashring, pinned hash and virtual nodes).

    Not thread-safe (uhashring is not); build one per use.
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


# ---------------------------------------------------------------- shares and decks
def water_fill(load: dict[str, int], nodes: Sequence[str], total: int,
               rng: random.Random) -> dict[str, int]:
    """How many of ``total`` new replicas each node of ``nodes`` takes so that the loads end
    as level as possible (the last units go to a seeded sample of the lowest nodes)."""
    if total <= 0 or not nodes:
        return {}
    levels = sorted(load[n] for n in nodes)

    def need(h: int) -> int:
        return sum(h - x for x in levels if x < h)

    lo, hi = levels[0], levels[0] + total
    while lo < hi:                      # the highest level that `total` fills completely
        mid = (lo + hi + 1) // 2
        if need(mid) <= total:
            lo = mid
        else:
            hi = mid - 1
    quota = {n: lo - load[n] for n in nodes if load[n] < lo}
    rest = total - sum(quota.values())
    if rest:
        for n in rng.sample(sorted(n for n in nodes if load[n] <= lo), rest):
            quota[n] = quota.get(n, 0) + 1
    return quota


def deal(quota: dict[str, int], rng: random.Random) -> list[str]:
    """Every node ``quota[n]`` times, in rounds (round k: the nodes with more than k left),
    each round in a seeded shuffled order."""
    order = sorted((n for n in quota if quota[n] > 0), key=lambda n: (-quota[n], n))
    deck: list[str] = []
    k = len(order)
    for rnd in range(quota[order[0]] if order else 0):
        while k and quota[order[k - 1]] <= rnd:
            k -= 1
        chunk = order[:k]
        rng.shuffle(chunk)
        deck.extend(chunk)
    return deck


class _Deck:
    """Dealt nodes, drawn in order; a draw skips (and keeps) nodes the block already holds."""

    def __init__(self, nodes: list[str]):
        self.nodes = nodes
        self.pos = 0

    def draw(self, reps: list[str]) -> str | None:
        deck, pos = self.nodes, self.pos
        for q in range(pos, min(len(deck), pos + LOOKAHEAD)):
            if deck[q] not in reps:
                deck[pos], deck[q] = deck[q], deck[pos]
                self.pos = pos + 1
                return deck[pos]
        return None


def _stride(count: int, rng: random.Random) -> Iterator[int]:
    """Every index below ``count`` once, in a seeded scattered order."""
    if count <= 0:
        return
    step = 2654435761 % count or 1
    while math.gcd(step, count) != 1:
        step += 1
    i = rng.randrange(count)
    for _ in range(count):
        yield i
        i = (i + step) % count


# ---------------------------------------------------------------- the planner
class _Plan:
    """One planning call's working state: effective lists (copied on first write), loads."""

    def __init__(self, current: Sequence[list[str]], nodes: list[str], r: int, slack: float,
                 seed: int, load: dict[str, int] | None = None):
        self.lists = list(current)
        self.changed: set[int] = set()
        self.nodes = nodes
        self.r = r
        self.slack = slack
        self.rng = random.Random(seed)
        counts = Counter(chain.from_iterable(self.lists)) if load is None else Counter(load)
        self.load = {n: counts.get(n, 0) for n in nodes}
        self.dead = {n for n in counts if n not in self.load}
        self._primaries: Counter[str] | None = None

    def writable(self, i: int) -> list[str]:
        reps = self.lists[i]
        if i not in self.changed:
            reps = self.lists[i] = list(reps)
            self.changed.add(i)
        return reps

    def primaries(self) -> Counter[str]:
        if self._primaries is None:
            self._primaries = Counter(reps[0] for reps in self.lists if reps)
        return self._primaries

    # 1. sticky
    def repair(self) -> list[tuple[int, int]]:
        """Drop replicas on nodes that are not live, duplicates and those beyond R; returns
        (block, replicas missing) for the blocks short of R."""
        r, dead, live = self.r, self.dead, self.load
        if dead:
            fix = [i for i, reps in enumerate(self.lists) if len(reps) != r or not dead.isdisjoint(reps)]
        else:
            fix = [i for i, reps in enumerate(self.lists) if len(reps) != r]
        needs = []
        for i in fix:
            old = self.lists[i]
            kept: list[str] = []
            for n in old:
                if n in live:
                    if n not in kept and len(kept) < r:
                        kept.append(n)
                    else:
                        live[n] -= 1
            if kept != old:
                self.lists[i] = kept
                self.changed.add(i)
            if len(kept) < r:
                needs.append((i, r - len(kept)))
        self._primaries = None
        return needs

    # 2. fill
    def fill(self, needs: list[tuple[int, int]]) -> None:
        """Add the missing replicas on the least-loaded nodes (see the module doc)."""
        total = sum(c for _, c in needs)
        if not total:
            return
        deck = _Deck(deal(water_fill(self.load, self.nodes, total, self.rng), self.rng))
        prim = self.primaries() if any(not self.lists[i] for i, _ in needs) else None
        for i, count in needs:
            reps = self.writable(i)
            fresh = not reps
            for _ in range(count):
                node = deck.draw(reps) or min((n for n in self.nodes if n not in reps),
                                              key=lambda n: (self.load[n], n))
                reps.append(node)
                self.load[node] += 1
            if fresh and prim is not None:
                if len(reps) > 1:
                    lead = min(range(len(reps)), key=lambda k: (prim[reps[k]], k))
                    reps.insert(0, reps.pop(lead))
                prim[reps[0]] += 1

    # 3. rebalance
    def rebalance(self) -> None:
        load, nodes = self.load, self.nodes
        mean = sum(load.values()) / len(nodes)
        cap, floor = max(1, math.ceil(mean * (1 + self.slack))), math.floor(mean * (1 - self.slack))
        give = {n: load[n] - math.ceil(mean) for n in nodes if load[n] > cap}
        take = {n: math.floor(mean) - load[n] for n in nodes if load[n] < floor}
        if not give and not take:
            return
        short = sum(take.values()) - sum(give.values())
        if short > 0:        # the most loaded of the others give the rest
            pool = [n for n in nodes if n not in take]
            level = {n: -(load[n] - give.get(n, 0)) for n in pool}
            for n, k in water_fill(level, pool, short, self.rng).items():
                give[n] = give.get(n, 0) + k
        elif short < 0:      # the least loaded of the others take the rest
            pool = [n for n in nodes if n not in give]
            level = {n: load[n] + take.get(n, 0) for n in pool}
            for n, k in water_fill(level, pool, -short, self.rng).items():
                take[n] = take.get(n, 0) + k
        remaining = sum(give.values())
        deck = _Deck(deal(take, self.rng))
        for k, i in enumerate(_stride(len(self.lists), self.rng)):
            reps = self.lists[i]
            for src in (reps if k & 1 else reversed(reps)):
                if give.get(src, 0) > 0:
                    dst = deck.draw(reps)
                    if dst is not None:
                        reps = self.writable(i)
                        reps[reps.index(src)] = dst
                        load[src] -= 1
                        load[dst] += 1
                        give[src] -= 1
                        remaining -= 1
                    break
            if not remaining:
                break
        self._primaries = None

    # 4. primaries
    def balance_primaries(self) -> None:
        if self.r < 2:
            return
        prim = self.primaries()
        pmean = sum(1 for reps in self.lists if reps) / len(self.nodes)
        pcap, pfloor = math.ceil(pmean * (1 + self.slack)), math.floor(pmean * (1 - self.slack))
        hot = {n: prim[n] - math.ceil(pmean) for n in self.nodes if prim[n] > pcap}
        cold = {n: math.floor(pmean) - prim[n] for n in self.nodes if prim[n] < pfloor}
        todo = sum(hot.values()) + sum(cold.values())
        if not todo:
            return
        for i in _stride(len(self.lists), self.rng):
            reps = self.lists[i]
            if len(reps) < 2:
                continue
            lead = reps[0]
            if hot.get(lead, 0) > 0:
                other = min(range(1, len(reps)), key=lambda k: (prim[reps[k]], k))
                if prim[reps[other]] >= pcap:
                    continue
            elif cold and prim[lead] > pmean:
                other = next((k for k in range(1, len(reps)) if cold.get(reps[k], 0) > 0), 0)
                if not other:
                    continue
            else:
                continue
            reps = self.writable(i)
            new = reps.pop(other)
            reps.insert(0, new)
            prim[lead] -= 1
            prim[new] += 1
            for side, n in ((hot, lead), (cold, new)):
                if side.get(n, 0) > 0:
                    side[n] -= 1
                    todo -= 1
            if todo <= 0:
                break


def plan_changes(current: Sequence[list[str]], nodes: Sequence[str], replication: int,
                 slack: float = DEFAULT_SLACK, seed: int = 0) -> dict[int, list[str]]:
    """The blocks whose replica list should change, by index into ``current``, with their new
    ordered lists (primary first). See the module doc for the rules.

    ``current[i]`` is block i's replica list (empty: not placed yet); it is read, never
    mutated. ``nodes`` are the nodes that may hold blocks (live, not draining); replicas on
    any other node are replaced. Blocks get ``min(replication, len(nodes))`` distinct
    replicas; with no node at all nothing changes."""
    live = sorted(set(nodes))
    if not live:
        return {}
    plan = _Plan(current, live, min(replication, len(live)), slack, seed)
    plan.fill(plan.repair())
    plan.rebalance()
    plan.balance_primaries()
    return {i: plan.lists[i] for i in sorted(plan.changed) if plan.lists[i] != current[i]}


def place_blocks(count: int, nodes: Sequence[str], replication: int,
                 existing: Sequence[list[str]] = (), seed: int = 0,
                 load: dict[str, int] | None = None) -> list[list[str]]:
    """Replica lists for ``count`` new blocks on ``nodes``, filling the nodes that the
    ``existing`` blocks load least (their replicas stay): new blocks are placed where the
    rebalancer would not move them. Primaries are spread the same way. ``load`` (replicas
    per node) replaces ``existing`` where the caller knows it; primaries are then not
    balanced against the existing blocks."""
    live = sorted(set(nodes))
    if not live:
        return [[] for _ in range(count)]
    plan = _Plan(list(existing) + [[] for _ in range(count)], live,
                 min(replication, len(live)), DEFAULT_SLACK, seed, load)
    base = len(existing)
    plan.fill([(base + k, plan.r) for k in range(count)])
    return plan.lists[base:]


def plan_placement(blocks: list[str], nodes: list[str], replication: int,
                   previous: dict[str, list[str]] | None = None,
                   slack: float = DEFAULT_SLACK) -> dict[str, list[str]]:
    """Return an ordered replica list (primary first) for every block name in ``blocks``:
    ``plan_changes`` over ``previous`` (missing blocks are new). Blocks with no live node at
    all get an empty list. Pure and deterministic."""
    previous = previous or {}
    current = [previous.get(b) or [] for b in blocks]
    nodes = sorted(set(nodes))
    seed = ring_hash(f"{len(blocks)}/{blocks[0] if blocks else ''}/{'/'.join(nodes[:2])}/{len(nodes)}")
    changes = plan_changes(current, nodes, replication, slack, seed)
    return {b: list(changes.get(i, current[i])) for i, b in enumerate(blocks)}


def placement_stats(placement: dict[str, list[str]], nodes: list[str],
                    previous: dict[str, list[str]] | None = None) -> PlacementStats:
    """Max/mean replicas per node, and how many replicas are on a node they were not on before."""
    load = {n: 0 for n in nodes}
    moved = total = 0
    for b, reps in placement.items():
        before = (previous or {}).get(b, [])
        for n in reps:
            load[n] = load.get(n, 0) + 1
            total += 1
            if previous is not None and n not in before:
                moved += 1
    mean = total / max(1, len(load))
    return PlacementStats(max(load.values()) / mean if mean else 0.0, moved, total)
