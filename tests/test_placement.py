"""The ring proposes, the rebalancer caps: balance and minimal moves (pure)."""

from shardps.server.placement import Ring, place_blocks, placement_stats, plan_changes, plan_placement


def test_three_servers_ten_thousand_blocks_balanced():
    nodes = ["s0", "s1", "s2"]
    blocks = [f"job/t/{i}" for i in range(10_000)]
    placement = plan_placement(blocks, nodes, 1)
    stats = placement_stats(placement, nodes)
    print(f"3 servers, 10,000 blocks: max/mean blocks per server = {stats.max_over_mean:.4f}")
    assert stats.max_over_mean <= 1.15


def test_replicas_are_distinct_and_ordered():
    nodes = [f"s{i}" for i in range(5)]
    placement = plan_placement([f"j/t/{i}" for i in range(2000)], nodes, 3)
    assert all(len(set(r)) == 3 for r in placement.values())
    primaries = {}
    for reps in placement.values():
        primaries[reps[0]] = primaries.get(reps[0], 0) + 1
    assert max(primaries.values()) / (2000 / 5) <= 1.1


def test_join_moves_about_one_nth_and_leave_moves_only_the_lost():
    nodes = [f"s{i}" for i in range(10)]
    blocks = [f"j/t/{i}" for i in range(10_000)]
    before = plan_placement(blocks, nodes, 1)
    after_join = plan_placement(blocks, nodes + ["s10"], 1, previous=before)
    moved = placement_stats(after_join, nodes + ["s10"], before).moved_fraction
    assert moved <= 1.2 / 11
    after_leave = plan_placement(blocks, nodes[1:], 1, previous=before)
    lost = sum(1 for r in before.values() if r[0] == "s0") / len(blocks)
    moved = placement_stats(after_leave, nodes[1:], before).moved_fraction
    assert moved <= 1.2 * lost
    assert placement_stats(after_leave, nodes[1:]).max_over_mean <= 1.1


def test_placement_is_deterministic_and_sticky():
    nodes = ["a", "b", "c"]
    blocks = [f"j/t/{i}" for i in range(500)]
    p1 = plan_placement(blocks, nodes, 2)
    assert p1 == plan_placement(blocks, nodes, 2)
    assert plan_placement(blocks, nodes, 2, previous=p1) == p1


def test_ring_preference_lists_distinct_nodes():
    ring = Ring(["a", "b", "c"])
    assert sorted(ring.preference("x", 5)) == ["a", "b", "c"]


def _loads(placement, nodes):
    load = {n: 0 for n in nodes}
    prim = {n: 0 for n in nodes}
    for reps in placement.values():
        for n in reps:
            load[n] += 1
        prim[reps[0]] += 1
    return load, prim


def test_a_death_moves_only_the_dead_nodes_replicas_spread_over_every_other_node():
    nodes = [f"s{i:02d}" for i in range(40)]
    blocks = [f"j/t{i // 100}/{i % 100}" for i in range(4000)]
    before = plan_placement(blocks, nodes, 2)
    left = [n for n in nodes if n != "s07"]
    after = plan_placement(blocks, left, 2, previous=before)
    lost = sum(1 for r in before.values() if "s07" in r)
    assert placement_stats(after, left, before).moved_replicas == lost
    gained = {n: 0 for n in left}
    for b, reps in after.items():
        assert len(set(reps)) == 2 and "s07" not in reps
        kept = [n for n in before[b] if n != "s07"]
        assert reps[:len(kept)] == kept         # survivors keep their places: the backup is promoted
        for n in set(reps) - set(before[b]):
            gained[n] += 1
    assert min(gained.values()) >= 1 and max(gained.values()) <= lost // len(left) + 2
    load, prim = _loads(after, left)
    assert max(load.values()) / (2 * len(blocks) / len(left)) <= 1.05
    assert max(prim.values()) / (len(blocks) / len(left)) <= 1.10


def test_blocks_of_one_node_have_their_other_replicas_on_many_nodes():
    """No fixed partner: when a node fails, promotion and re-replication spread over the cluster."""
    nodes = [f"s{i:02d}" for i in range(50)]
    placement = plan_placement([f"j/t/{i}" for i in range(5000)], nodes, 2)
    partners = {r[1] if r[0] == "s00" else r[0] for r in placement.values() if "s00" in r}
    assert len(partners) >= 40


def test_a_join_takes_a_fair_share_from_the_most_loaded_and_balances_primaries():
    nodes = [f"s{i:02d}" for i in range(30)]
    blocks = [f"j/t/{i}" for i in range(6000)]
    before = plan_placement(blocks, nodes, 2)
    after = plan_placement(blocks, nodes + ["new"], 2, previous=before)
    stats = placement_stats(after, nodes + ["new"], before)
    assert stats.moved_fraction <= 1.2 / 31 and stats.max_over_mean <= 1.05
    load, prim = _loads(after, nodes + ["new"])
    assert load["new"] >= 0.95 * 2 * 6000 / 31
    assert max(prim.values()) / (6000 / 31) <= 1.10 and prim["new"] >= 0.9 * 6000 / 31
    for b, reps in after.items():               # a block changes by one replica at most
        assert len(set(reps) - set(before[b])) <= 1


def test_changes_are_only_the_blocks_that_change_and_inputs_stay_untouched():
    nodes = ["a", "b", "c", "d"]
    current = [list(r) for r in place_blocks(400, nodes, 2)]
    copy = [list(r) for r in current]
    assert plan_changes(current, nodes, 2) == {}
    changes = plan_changes(current, ["a", "b", "c"], 2)
    assert current == copy
    assert set(changes) == {i for i, r in enumerate(current) if "d" in r}
    assert plan_changes(current, [], 2) == {}


def test_new_blocks_fill_the_least_loaded_nodes():
    nodes = ["a", "b", "c", "d"]
    existing = [["a", "b"]] * 30 + [["a"]] * 30
    new = place_blocks(60, nodes, 2, existing)
    assert all(len(set(r)) == 2 for r in new)
    load, prim = _loads({i: r for i, r in enumerate(new)}, nodes)
    assert load["a"] == 0 and abs(load["b"] + 30 - load["c"]) <= 1 and abs(load["c"] - load["d"]) <= 1
