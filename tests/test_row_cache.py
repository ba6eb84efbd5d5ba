"""The worker-side embedding cache: ``RowCache`` on its own (staleness bound, admission and
eviction, budget), and through ``PSModel`` on a real in-process cluster: no read older than
the bound, every touched row's gradient still pushed, SYNC jobs never reading from it, the
metrics it exports."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from shardps.errors import InvalidArgument
from shardps.tables import sgd
from shardps.tools.bench.cache import hit_rate_ceiling
from shardps.worker.row_cache import ROW_OVERHEAD_BYTES, RowCache
from shardps.worker.torch_ps import PSEmbedding, PSModel

ROW = 4 * 4 + ROW_OVERHEAD_BYTES          # bytes one cached row of dim 4 takes


def _rows(ids, value: float = 0.0) -> np.ndarray:
    return (np.asarray(ids, np.float32)[:, None] + value) * np.ones((1, 4), np.float32)


@pytest.mark.parametrize("num_rows", [1000, 0])            # direct index, and a dict for unbounded ids
def test_a_cached_row_is_read_only_while_it_is_at_most_tau_steps_old(num_rows):
    c = RowCache(4, 100 * ROW, num_rows)
    ids = np.array([3, 5, 9])
    plan = c.plan(ids, use_step=10, tau=2)
    assert plan.misses.tolist() == [3, 5, 9]                 # empty cache
    np.testing.assert_array_equal(c.complete(plan, _rows(ids), refreshed=10), _rows(ids))
    for step, expect_hits in ((11, [3, 5, 9]), (12, [3, 5, 9]), (13, [])):
        plan = c.plan(ids, use_step=step, tau=2)
        assert ids[plan.hit].tolist() == expect_hits, step
    # a pull refreshes the rows it fetched: fresh again, with the new values
    plan = c.plan(np.array([5, 7]), use_step=13, tau=2)
    rows = c.complete(plan, _rows([5, 7], 0.5), refreshed=13)
    np.testing.assert_array_equal(rows, _rows([5, 7], 0.5))
    plan = c.plan(np.array([3, 5, 7]), use_step=14, tau=2)
    assert plan.misses.tolist() == [3]
    np.testing.assert_array_equal(c.complete(plan, _rows([3], 1.0), refreshed=14),
                                  np.concatenate([_rows([3], 1.0), _rows([5, 7], 0.5)]))
    assert c.max_age <= 2
    assert c.hits == 3 + 3 + 2 and c.summary()["hit_rate"] == 8 / c.lookups


def test_the_hit_rate_ceiling_counts_a_row_fresh_for_tau_steps_after_each_read():
    lookups = [np.array([1, 2]), np.array([1, 3]), np.array([1, 2])]
    assert hit_rate_ceiling(lookups, 10, 1) == 1 / 6      # 1 at step 1; at step 2 both are 2 steps old
    assert hit_rate_ceiling(lookups, 10, 2) == 3 / 6


@pytest.mark.parametrize("tau", [1, 3, 8])
def test_a_cache_with_room_for_every_row_reaches_the_ceiling_and_no_more(tau):
    """The ceiling the cache bench reports (``hit_rate_ceiling``) is RowCache's own rule: with
    room for every row, a cache fed the same lookups (rows read at the step of their use)
    hits exactly as often; a smaller budget hits less."""
    rng = np.random.default_rng(0)
    lookups = [np.unique(rng.zipf(1.3, 64) % 500) for _ in range(60)]
    for budget, exact in ((500 * ROW, True), (40 * ROW, False)):
        cache = RowCache(4, budget, num_rows=500)
        for step, ids in enumerate(lookups):
            plan = cache.plan(ids, step, tau)
            cache.complete(plan, _rows(plan.misses, step), step)
        ceiling = hit_rate_ceiling(lookups, 500, tau)
        assert (cache.hits / cache.lookups == ceiling) if exact else (cache.hits / cache.lookups < ceiling)


def test_the_workers_default_bound_is_the_same_number_of_samples_at_every_batch_size():
    """``shardps worker --cache-staleness 0`` (its default): 4,096 samples' worth of steps, at
    least the lookahead (a lower bound never reads a cached row). On ctr with 2 workers at
    batch 4,096 a bound of 8 steps cost 0.04 AUC against no cache (docs/performance.md, "The
    worker-side embedding cache")."""
    from shardps.worker.runtime import cache_staleness_for
    assert [cache_staleness_for(b) for b in (64, 512, 4096, 100_000)] == [64, 8, 1, 1]
    assert [cache_staleness_for(b, lookahead=2) for b in (64, 512, 4096, 100_000)] == [64, 8, 2, 2]


def test_older_values_never_replace_newer_ones():
    c = RowCache(4, 10 * ROW, 100)
    c.store(np.array([1]), _rows([1], 5.0), refreshed=7)
    c.store(np.array([1]), _rows([1], 1.0), refreshed=4)      # a pull that left earlier
    plan = c.plan(np.array([1]), use_step=8, tau=3)
    np.testing.assert_array_equal(plan.hit_rows, _rows([1], 5.0))


def test_the_budget_bounds_the_rows_and_frequent_rows_displace_rare_ones():
    c = RowCache(4, 10 * ROW, 10_000, admit_after=2)
    assert c.capacity == 10 and c.nbytes() <= 10 * ROW
    hot = np.arange(5)
    for step in range(20):                               # 5 hot rows looked up every step
        batch = np.concatenate([hot, np.array([100 + step])])     # and a new rare one each time
        plan = c.plan(batch, step, tau=0)
        c.complete(plan, _rows(plan.misses), refreshed=step)
    assert c.size == 10
    held = set(c.ids[c.ids >= 0].tolist())
    assert set(hot.tolist()) <= held, held
    # a rare row does not push out one seen more often
    plan = c.plan(np.array([5000]), 30, tau=0)
    c.complete(plan, _rows([5000]), refreshed=30)
    assert 5000 not in set(c.ids.tolist()) and set(hot.tolist()) <= set(c.ids.tolist())
    c.clear()
    assert c.size == 0 and c.plan(hot, 31, tau=100).misses.tolist() == hot.tolist()


def test_a_nearly_full_cache_admits_only_frequent_rows_into_its_last_free_slots():
    c = RowCache(4, 10 * ROW, 10_000, admit_after=2)
    c.store(np.arange(7), _rows(np.arange(7)), refreshed=0)         # room for 3 more
    c.plan(np.array([100, 101]), 1, tau=5)                          # seen once before: twice with the next
    candidates = np.arange(100, 110)
    c.plan(candidates, 2, tau=5)
    c.store(candidates, _rows(candidates), refreshed=2)
    assert c.size == 9 and sorted(c.ids[7:9].tolist()) == [100, 101]
    assert c.plan(np.array([100, 102]), 3, tau=5).misses.tolist() == [102]


def test_a_zero_budget_caches_nothing_and_ids_out_of_range_are_misses():
    assert RowCache(4, ROW - 1, 10).capacity == 0
    c = RowCache(4, 0, 10)
    plan = c.plan(np.array([1, 2]), 0, tau=5)
    assert plan.misses.tolist() == [1, 2]
    c.complete(plan, _rows([1, 2]), 0)
    assert c.size == 0
    bounded = RowCache(4, 10 * ROW, 10)
    assert bounded.plan(np.array([-1, 3, 10]), 0, tau=5).misses.tolist() == [-1, 3, 10]


class Skewed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = PSEmbedding(200, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(dim=1)).squeeze(1)


def _train(client, steps: int, tau: int, overlap: bool, lookahead: int = 1, mode: str = "async"):
    client.create_job(mode)
    if mode != "async":
        client.join(name="w0", heartbeat=False)
    torch.manual_seed(0)
    model = Skewed()
    ps_model = PSModel(model, client, optimizer=sgd(0.1), cache_bytes=100 * ROW, cache_staleness=tau,
                       overlap=overlap, lookahead=lookahead)
    ps_model.create_tables()
    touched = 0
    for _ in range(steps):
        ids = torch.minimum(torch.distributions.Geometric(0.3).sample((16, 3)).long(), torch.tensor(199))
        ps_model.pull()
        model(ids).square().mean().backward()
        touched += int(torch.unique(ids).numel())
        ps_model.push()
    ps_model.flush()
    return ps_model, model, touched


@pytest.mark.parametrize("overlap, lookahead", [(False, 1), (True, 2)])
def test_through_psmodel_no_read_exceeds_the_bound_and_every_touched_row_is_pushed(
        make_cluster, client_factory, overlap, lookahead):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job=f"cache-{int(overlap)}")
    ps_model, model, touched = _train(c, 40, tau=3, overlap=overlap, lookahead=lookahead)
    cache = model.emb.cache
    assert cache is not None and model.emb.cache_tau == 3
    assert cache.hits > 0 and cache.max_age <= 3, "a row read older than the bound"
    # the cache changes what is read, never what is sent: each step's touched rows are pushed
    assert c.metrics.registry.get_sample_value("shardps_client_rows_total", {"direction": "pushed"}) == touched
    registry = c.metrics.registry
    labels = {"training_job": c.job, "table": "emb"}
    assert registry.get_sample_value("shardps_worker_cache_lookups_total", {**labels, "result": "hit"}) == cache.hits
    assert registry.get_sample_value("shardps_worker_cache_staleness_steps_bucket", {**labels, "le": "3.0"}) == \
        registry.get_sample_value("shardps_worker_cache_staleness_steps_count", labels) > 0
    assert registry.get_sample_value("shardps_worker_cache_rows", labels) == cache.size > 0
    # evaluation reads the servers' values, not cached ones, and leaves the cache as it was
    ps_model.settle()
    ps_model.eval()
    looked, ids = cache.lookups, torch.arange(6).reshape(2, 3)
    with torch.no_grad():
        rows = model.emb(ids)
    assert cache.lookups == looked
    np.testing.assert_array_equal(rows.reshape(-1, 4).numpy(), c.pull_rows("emb", ids.reshape(-1)))


def test_with_lookahead_2_rows_are_cached_as_their_exchange_returns(make_cluster, client_factory):
    """``shardps worker``'s loop: step t announces the batch of step t + 2, whose rows ride
    with step t's push. The next push waits for that exchange, and its rows enter the cache
    before that push plans step t + 3's lookup: a cached row is 2 steps old when planned, so a
    bound of 2 reads from the cache (filled only when step t + 2 read them, a cached row would
    be 3 steps old: at a bound of 2, 3 % of the lookups hit instead of 42 %)."""
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="cache-ahead")
    c.create_job()
    torch.manual_seed(0)
    model = Skewed()
    ps_model = PSModel(model, c, optimizer=sgd(0.1), cache_bytes=100 * ROW, cache_staleness=2,
                       overlap=True, lookahead=2)
    ps_model.create_tables()
    batches = [torch.minimum(torch.distributions.Geometric(0.3).sample((16, 3)).long(), torch.tensor(199))
               for _ in range(40)]
    for i, ids in enumerate(batches):
        ps_model.pull()
        model(ids).square().mean().backward()
        if i + 2 < len(batches):
            model.emb.request_prefetch(batches[i + 2])
        ps_model.push()
    ps_model.flush()
    cache = model.emb.cache
    assert cache is not None and cache.max_age <= 2
    assert cache.hits > 0.25 * cache.lookups, cache.summary()


def test_sync_and_ssp_jobs_never_read_from_a_cache(make_cluster, client_factory):
    """SYNC: any step may change any row. SSP: a cached row's age would add to the staleness
    the job's bound already allows."""
    cluster = make_cluster(2)
    sync = client_factory(cluster.address, job="cache-sync")
    _, model, _ = _train(sync, 3, tau=3, overlap=False, mode="sync")
    assert model.emb.cache is None
    ssp = client_factory(cluster.address, job="cache-ssp")
    ssp.create_job("ssp", staleness=1)
    ssp.join(name="w0", heartbeat=False)
    m = Skewed()
    ps_model = PSModel(m, ssp, optimizer=sgd(0.1), cache_bytes=100 * ROW, cache_staleness=9)
    ps_model.create_tables()
    assert m.emb.cache is None


def test_a_bound_below_the_lookahead_is_refused(make_cluster, client_factory):
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="cache-bad")
    c.create_job()
    for staleness in (0, 1):            # 1: every cached row is 2 steps old when a plan reads it
        ps_model = PSModel(Skewed(), c, optimizer=sgd(0.1), cache_bytes=100 * ROW, cache_staleness=staleness,
                           overlap=True, lookahead=2)
        with pytest.raises(InvalidArgument, match=f"cache_staleness={staleness}: must be an integer >= 2"):
            ps_model.create_tables()
