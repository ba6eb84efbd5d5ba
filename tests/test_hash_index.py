"""``HashIndex`` (server/node/hash_index.py): id -> slot under random batches of inserts and
removals, checked against a dict, across growth and backward-shift deletions."""

import numpy as np
import pytest

from shardps.server.node.hash_index import HashIndex


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_a_dict_under_random_batches(seed):
    rng = np.random.default_rng(seed)
    index, model = HashIndex(), {}
    universe = np.concatenate([rng.integers(-(1 << 62), 1 << 62, 3000), np.arange(3000)])   # any int64
    for _ in range(300):
        batch = np.unique(rng.choice(universe, rng.integers(1, 200)))
        if rng.random() < 0.55:
            new = batch[[int(x) not in model for x in batch]]
            slots = rng.integers(0, 1 << 31, new.shape[0])
            index.add(new, slots)
            model.update(zip(new.tolist(), slots.tolist()))
        else:
            index.remove(batch)             # present or not
            for x in batch.tolist():
                model.pop(x, None)
        probe = rng.choice(universe, 300)
        np.testing.assert_array_equal(index.lookup(probe), [model.get(int(x), -1) for x in probe])
        assert index.count == len(model)
    ids, slots = index.stored()
    assert ids.tolist() == sorted(model) and slots.tolist() == [model[x] for x in sorted(model)]
    assert index.keys.shape[0] >= 2 * index.count


def test_colliding_ids_survive_removals_between_them():
    index = HashIndex(bits=10)
    ids = np.arange(0, 1 << 20, 1 << 10, dtype=np.int64)[:200]     # share low bits; the hash spreads them
    index.add(ids, ids * 2)
    index.remove(ids[::3])
    kept = np.setdiff1d(ids, ids[::3])
    np.testing.assert_array_equal(index.lookup(kept), kept * 2)
    assert (index.lookup(ids[::3]) == -1).all()
