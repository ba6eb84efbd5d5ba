"""The ring proposes, the rebalancer caps: balance and minimal moves (pure)."""

from shardps.server.placement import Ring, placement_stats, plan_placement


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
