"""One round trip per server per step: a Step frame (push, then pull) on the data plane, and
the same results through gRPC where a server has no data plane (real servers on loopback)."""

import threading

import numpy as np
import pytest

from shardps.tables import sgd
from shardps.worker.client import steps

SERVICE = "shardps.v1.ParameterServer"


def _calls(client, method: str) -> float:
    """Data calls the client completed with ``method`` (any transport, any status)."""
    total = 0.0
    for metric in client.metrics.registry.collect():
        if metric.name != "grpc_client_handled":
            continue
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels.get("grpc_method") == method:
                total += s.value
    return total


def _job(client):
    client.create_job()
    client.join(heartbeat=False)
    client.create_dense("w", (400,), optimizer=sgd(1.0), block_size=100)
    client.create_sparse("e", 4, optimizer=sgd(1.0), num_blocks=8)
    return np.arange(0, 300, 3)


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc-only-servers"])
def test_an_exchange_pushes_then_pulls_one_call_per_server(make_cluster, client_factory, data_plane, blocking):
    cluster = make_cluster(2, server_settings={} if data_plane else {"data_plane_port": -1})
    c = client_factory(cluster.address)
    ids = _job(c)
    before = {m: _calls(c, m) for m in ("Step", "Exchange", "Push", "Pull")}
    threads = []
    run = c._data.exchange
    c._data.exchange = lambda *a, **kw: threads.append(threading.get_ident()) or run(*a, **kw)
    pushes = [("w", np.ones(400, np.float32)), ("e", ids, np.ones((ids.shape[0], 4), np.float32))]
    if blocking:            # in the calling thread: no hand-off to the client's executor
        pushed, pulled = c.exchange(pushes, [("w",), ("e", ids)], clock=0)
    else:
        pushed, pulled = c.exchange_async(pushes, [("w",), ("e", ids)], clock=0).result()
    assert (threads == [threading.get_ident()]) is blocking
    np.testing.assert_array_equal(pulled.values[0], -np.ones(400))       # the push, then the pull
    np.testing.assert_array_equal(pulled.values[1], -np.ones((ids.shape[0], 4)))
    assert pushed.versions and pulled.clock == 1 and pushed.clock == 0
    servers = len(cluster.servers)
    got = {m: _calls(c, m) - before[m] for m in before}
    if data_plane:
        assert got == {"Step": servers, "Exchange": 0, "Push": 0, "Pull": 0}, got
    else:
        assert got == {"Step": 0, "Exchange": 0, "Push": servers, "Pull": servers}, got


def test_a_push_reports_the_updates_its_dense_blocks_got_since_this_worker_pulled_them(make_cluster,
                                                                                       client_factory):
    """A worker pulls, another pushes three times, the first pushes: the servers count three
    updates in between for each of its dense blocks (shardps_push_intervening_updates); a
    pull's and a push's versions name every block, sparse ones too."""
    cluster = make_cluster(2)
    a = client_factory(cluster.address, job="between")
    ids = _job(a)
    b = client_factory(cluster.address, job="between")
    b.join(heartbeat=False)
    pulled = a.pull_many([("w",), ("e", ids)])
    assert {t for t, _ in pulled.versions} == {"w", "e"} and len(pulled.versions) == 4 + 8
    for _ in range(3):
        b.push_dense("w", np.ones(400, np.float32))
    pushed = a.push_dense("w", np.ones(400, np.float32))
    assert sorted(pushed.versions.items()) == [(("w", blk), 4) for blk in range(4)]     # 3 pushes, then this

    def between(stat: str) -> float:
        return sum(s.metrics.registry.get_sample_value(f"shardps_push_intervening_updates_{stat}",
                                                       {"training_job": "between"}) or 0.0
                   for s in cluster.servers.values())
    assert between("count") == 4 and between("sum") == 4 * 3


def test_sync_steps_through_exchanges_equal_one_large_batch(make_cluster, client_factory):
    """Two joined SYNC workers, three steps each through exchange: every step is the mean
    of both workers' gradients, as one large batch would make it."""
    cluster = make_cluster(2)
    a = client_factory(cluster.address, job="bsp")
    a.create_job("sync")
    a.create_dense("w", (200,), optimizer=sgd(0.5), block_size=50)
    b = client_factory(cluster.address, job="bsp")
    a.join(heartbeat=False)
    b.join(heartbeat=False)
    a.refresh_map()
    b.refresh_map()
    expected = np.zeros(200, np.float32)
    for step in range(3):
        ga, gb = np.full(200, step + 1.0, np.float32), np.full(200, 2.0 * (step + 1), np.float32)
        fa = a.exchange_async([("w", ga)], [("w",)], clock=step, report_step=True)
        fb = b.exchange_async([("w", gb)], [("w",)], clock=step, report_step=True)
        (_, ra), (_, rb) = fa.result(timeout=30), fb.result(timeout=30)
        expected -= np.float32(0.5) * ((ga + gb) / 2).astype(np.float32)
        np.testing.assert_allclose(ra.values[0], expected, rtol=1e-6)
        np.testing.assert_allclose(rb.values[0], expected, rtol=1e-6)


def test_a_sync_step_reaching_every_server_is_one_step_frame_to_each(make_cluster, client_factory):
    """A SYNC step reports itself to every live server. When its push reaches each of them,
    it travels as one Step frame per server (push, report, then the pull that waits for the
    step); when one gets no data, the general way sends the others theirs and reports to
    that one once the pieces landed."""
    cluster = make_cluster(2)
    c = client_factory(cluster.address, job="bsp")
    c.create_job("sync")
    c.create_dense("w", (800,), optimizer=sgd(0.5), block_size=50)
    c.join(heartbeat=False)
    primaries = set(c.refresh_map().table("bsp", "w").primary.tolist())
    assert len(primaries) == len(cluster.servers), "the 16 blocks of w should span both servers"
    before = {m: _calls(c, m) for m in ("Step", "Exchange", "Push", "Pull")}
    _, pulled = c.exchange([("w", np.ones(800, np.float32))], [("w",)], clock=0, report_step=True)
    np.testing.assert_array_equal(pulled.values[0], np.full(800, -0.5, np.float32))
    got = {m: _calls(c, m) - before[m] for m in before}
    assert got == {"Step": 2, "Exchange": 0, "Push": 0, "Pull": 0}, got
    _, pulled = c.exchange([("w", np.ones(50, np.float32), 0)], [("w",)], clock=1, report_step=True)
    assert pulled.values[0][0] == -1.0 and pulled.values[0][50] == -0.5
    got = {m: _calls(c, m) - before[m] for m in before}
    assert got["Step"] == 2 and got["Push"] >= 1, got      # the report to the server without data


def test_a_newer_map_abandons_the_calls_to_servers_it_declares_dead():
    """``fanout.abandon_dead`` (the client's map listener): only servers alive in the old map
    and dead or gone in the new one are abandoned, at the address the old map gave."""
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.shardmap import ShardMapView
    from shardps.worker.client.fanout import abandon_dead

    def view(epoch, states):
        msg = pb.ShardMap(epoch=epoch, replication=2)
        for name, state in states.items():
            msg.servers.add(name=name, address=f"{name}-{epoch}:7071", incarnation=1, state=state)
        return ShardMapView(msg)

    class Recorder:
        def __init__(self):
            self.abandoned = []

        def abandon(self, address):
            self.abandoned.append(address)

    t = Recorder()
    old = view(4, {"s0": pb.SERVING, "s1": pb.SERVING, "s2": pb.SERVING, "s3": pb.DEAD})
    new = view(5, {"s0": pb.SERVING, "s1": pb.DEAD, "s3": pb.DEAD, "s4": pb.SERVING})
    assert abandon_dead(t, old, new) == ["s1", "s2"]
    assert t.abandoned == ["s1-4:7071", "s2-4:7071"]
    assert abandon_dead(t, new, new) == [] and len(t.abandoned) == 2


def test_split_phase_sends_every_request_before_reading_any_reply_and_keeps_the_order():
    """``fanout.split_phase``: every ``begin`` runs before the first ``end``, on the calling
    thread; outcomes come back in the items' order, a failure in either half is captured
    for its item only, and items ``begin`` declines go to ``otherwise``."""
    import threading
    from concurrent import futures

    from shardps.errors import Unavailable
    from shardps.worker.client.fanout import split_phase

    log, here = [], threading.get_ident()

    def begin(item):
        assert threading.get_ident() == here
        log.append(("begin", item))
        if item == "b-fails":
            raise Unavailable("b-fails is down")
        return None if item == "no-split" else item

    def end(item):
        log.append(("end", item))
        if item == "e-fails":
            raise Unavailable("e-fails broke")
        return item.upper()

    items = ["a", "b-fails", "no-split", "e-fails", "z"]
    with futures.ThreadPoolExecutor(2) as pool:
        out = split_phase(pool, items, begin, end, lambda item: f"{item} separately")
    assert [kind for kind, _ in log[:5]] == ["begin"] * 5 and {k for k, _ in log[5:]} == {"end"}
    assert out[0] == (True, "A") and out[4] == (True, "Z") and out[2] == (True, "no-split separately")
    assert not out[1][0] and "b-fails is down" in str(out[1][1])
    assert not out[3][0] and "e-fails broke" in str(out[3][1])


@pytest.mark.parametrize("servers", [1, 2])
def test_large_pulls_over_tcp_received_in_place_give_the_stored_values(make_cluster, client_factory, servers,
                                                                       monkeypatch):
    """Over TCP (no shared memory) a server's pulled values of 256 KiB or more that fill one
    piece of the output are received straight into it (one server: every pull here); rows
    of a table split over servers land scattered in the output and are copied from the
    reply. Either way the values are the stored ones, pull after pull."""
    cluster = make_cluster(servers)
    c = client_factory(cluster.address, shared_memory=False)
    c.create_job()
    c.join(heartbeat=False)
    n = 300_000                                       # 1.2 MB: in place from 1 server
    c.create_dense("big", (n,), optimizer=sgd(1.0), block_size=n // 4)
    c.create_sparse("rows", 64, num_rows=10_000, optimizer=sgd(1.0), num_blocks=8)
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(n, dtype=np.float32)
    ids = np.arange(4_000, dtype=np.int64)            # 1 MB of rows
    shuffled = rng.permutation(ids)
    rows = rng.standard_normal((ids.shape[0], 64), dtype=np.float32)
    in_place: list[bool] = []
    real = steps.destination
    monkeypatch.setattr(steps, "destination", lambda *a: in_place.append(real(*a) is not None) or real(*a))
    for step in range(1, 3):
        c.push_many([("big", grad), ("rows", ids, rows)])
        np.testing.assert_array_equal(c.pull_dense("big"), -step * grad)
        np.testing.assert_array_equal(c.pull_rows("rows", ids), -step * rows)
        np.testing.assert_array_equal(c.pull_rows("rows", shuffled), -step * rows[shuffled])
    if servers == 1:
        assert in_place == [True] * 6, in_place
    else:                                             # each rows pull, from each server, scattered
        assert in_place.count(False) >= 8, in_place
