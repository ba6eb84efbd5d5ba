"""PSClient against real gRPC servers on loopback (manager and servers in this process)."""

import threading

import numpy as np
import pytest

from shardps.errors import AlreadyExists, DeadlineExceeded, InvalidArgument, NotFound
from shardps.tables import normal, sgd, uniform, zeros
from tests.waiting import wait_for


def test_dense_push_pull_round_trip(cluster, client_factory):
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("w", (300, 70), optimizer=sgd(0.5), init=uniform(-1, 1, seed=3), block_size=4096)
    w0 = c.pull_dense("w")
    assert w0.shape == (300, 70) and w0.std() > 0.3
    ack = c.push_dense("w", np.ones_like(w0))
    np.testing.assert_allclose(c.pull_dense("w"), w0 - 0.5, rtol=1e-6)
    assert len(ack.versions) == c.table("w").spec.block_count
    part = c.pull_dense("w", 1000, 1100)
    np.testing.assert_allclose(part, (w0 - 0.5).reshape(-1)[1000:1100])


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc-chunks"])
def test_sparse_rows_duplicates_summed_and_unpushed_rows_initial(cluster, client_factory, shared_memory):
    c = client_factory(cluster.address, shared_memory=shared_memory)
    c.create_job()
    c.create_sparse("e", 8, optimizer=sgd(1.0), init=normal(0, 0.1, seed=9))
    ids = np.array([3, 99, 3, 2**40, -7], dtype=np.int64)
    before = c.pull_rows("e", ids)
    assert np.array_equal(before[0], before[2])
    c.push_rows("e", ids, np.ones((5, 8), np.float32))
    after = c.pull_rows("e", ids)
    np.testing.assert_allclose(after[0], before[0] - 2.0, rtol=1e-6)     # id 3 pushed twice
    np.testing.assert_allclose(after[1], before[1] - 1.0, rtol=1e-6)
    fresh = c.pull_rows("e", [12345])
    again = client_factory(cluster.address).pull_rows("e", [12345])
    np.testing.assert_array_equal(fresh, again)
    usage = sum(s.node.usage()["tables"].get(("test", "e"), [0, 0, 0])[1] for s in cluster.servers.values())
    assert usage == 4 * 8, "only pushed rows are stored"


@pytest.mark.parametrize("num_blocks", [1, 8], ids=["whole", "split"])
def test_unique_rows_in_any_order_round_trip(cluster, client_factory, num_blocks):
    """Unique ids go as they come (no sort) and their rows come back in the caller's order,
    read straight into the result when a server holds them all."""
    c = client_factory(cluster.address)
    c.create_job()
    c.create_sparse("u", 4, num_rows=10_000, num_blocks=num_blocks, optimizer=sgd(1.0),
                    init=normal(0, 0.1, seed=2))
    rng = np.random.default_rng(num_blocks)
    ids = rng.choice(10_000, 3_000, replace=False)
    before = c.pull_rows("u", ids)
    grads = rng.standard_normal((3_000, 4)).astype(np.float32)
    c.push_rows("u", ids, grads)
    order = rng.permutation(3_000)
    np.testing.assert_array_equal(c.pull_rows("u", ids[order]), (before - grads)[order])
    twice = np.concatenate([ids[order[:5]], ids[order[:5]]])
    np.testing.assert_array_equal(c.pull_rows("u", twice), np.tile((before - grads)[order[:5]], (2, 1)))


@pytest.mark.parametrize("num_blocks", [1, 8], ids=["whole", "split"])
def test_rows_pulled_in_another_wire_dtype_come_back_in_the_callers_order(cluster, client_factory, num_blocks):
    """bfloat16 on the wire (the general path, decoded, then placed): each server's rows
    land on the caller's rows, whole or split over both servers."""
    c = client_factory(cluster.address, wire_dtype="bfloat16")
    c.create_job()
    c.create_sparse("h", 4, num_rows=1_000, num_blocks=num_blocks, optimizer=sgd(1.0), init=zeros())
    rng = np.random.default_rng(num_blocks)
    ids = rng.choice(1_000, 300, replace=False)
    grads = rng.integers(-8, 9, (300, 4)).astype(np.float32)      # exact in bfloat16
    c.push_rows("h", ids, grads)
    order = rng.permutation(300)
    np.testing.assert_array_equal(c.pull_rows("h", ids[order]), -grads[order])


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "socket"])
def test_bulk_rows_on_one_host_go_through_shared_memory(cluster, client_factory, shared_memory, monkeypatch):
    """A push's and a pull's rows (512 KB) travel in a shared-memory region named in the data
    plane's frames where the client allows it, and arrive as they do through the socket."""
    from shardps.rpc import dataplane_transport
    used = []
    region_for = dataplane_transport.DataPlaneTransport._region

    def spy(self, plane, address, nbytes, *threshold):
        region = region_for(self, plane, address, nbytes, *threshold)
        used.append(region is not None)
        return region
    monkeypatch.setattr(dataplane_transport.DataPlaneTransport, "_region", spy)
    c = client_factory(cluster.address, shared_memory=shared_memory)
    c.create_job()
    c.create_sparse("big", 16, num_rows=100_000, num_blocks=1, optimizer=sgd(1.0), init=normal(0, 0.1, seed=4))
    rng = np.random.default_rng(0)
    ids = rng.choice(100_000, 8_000, replace=False)
    before = c.pull_rows("big", ids)
    grads = rng.standard_normal((8_000, 16)).astype(np.float32)
    c.push_rows("big", ids, grads)
    np.testing.assert_array_equal(c.pull_rows("big", ids), before - grads)
    assert used and all(used) == shared_memory


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_a_server_that_forgot_a_clients_regions_gets_the_bytes_another_way(cluster, client_factory, data_plane):
    """A server restarted at the same address knows none of a client's shared-memory regions:
    the client's next calls still succeed (the bytes go through the socket or in chunks) and
    prove the regions again."""
    c = client_factory(cluster.address, data_plane=data_plane)
    c.create_job()
    c.create_sparse("big", 16, num_rows=100_000, num_blocks=1, optimizer=sgd(1.0), init=normal(0, 0.1, seed=5))
    rng = np.random.default_rng(1)
    ids = rng.choice(100_000, 8_000, replace=False)
    grads = rng.standard_normal((8_000, 16)).astype(np.float32)
    before = c.pull_rows("big", ids)                    # through a region (512 KB)
    for server in cluster.servers.values():
        server.service.regions._owner.clear()
    c.push_rows("big", ids, grads)
    np.testing.assert_array_equal(c.pull_rows("big", ids), before - grads)
    assert all(server.service.regions._owner for server in cluster.servers.values()
               if server.node.usage()["tables"])       # proved again


@pytest.mark.slow
def test_a_region_whose_call_timed_out_is_never_written_again(cluster, client_factory):
    """A server stalled past the client's deadline (a pause, a long wait for its gate) may
    still read a request from its shared-memory region: the client must not write that
    region again. Here server A stalls on a push of table "a", the client gives up and pulls
    table "b" from server B through a region; once A resumes, the push it held is applied
    with its own rows and values, not the bytes of the later call (the data plane: its server
    serves a request whose deadline passed; the same rule holds over gRPC)."""
    c = client_factory(cluster.address)
    c.create_job()
    c.create_sparse("a", 16, num_rows=100_000, num_blocks=1, optimizer=sgd(1.0), init=normal(0, 0.1, seed=6))
    owner = {name: s for name, s in cluster.servers.items() if any(k[1] == "a" for k in s.node.blocks)}
    k = 0
    while True:                         # a table "b<k>" on the other server
        c.create_sparse(f"b{k}", 16, num_rows=100_000, num_blocks=1, optimizer=sgd(1.0), init=normal(0, 0.1, seed=7))
        if not any(key[1] == f"b{k}" for s in owner.values() for key in s.node.blocks):
            break
        k += 1
    stalled = next(iter(owner.values())).node.table.gate
    rng = np.random.default_rng(2)
    ids = rng.choice(100_000, 8_000, replace=False)
    other = rng.choice(100_000, 8_000, replace=False)
    grads = rng.standard_normal((8_000, 16)).astype(np.float32)
    before = c.pull_rows("a", ids)
    c.pull_rows(f"b{k}", other)                         # regions proved to both servers
    entered, resume = threading.Event(), threading.Event()

    def stall():
        with stalled.exclusive():
            entered.set()
            resume.wait(30)
    holder = threading.Thread(target=stall)
    holder.start()
    try:
        assert entered.wait(10)
        with pytest.raises(DeadlineExceeded):
            c.push_rows("a", ids, grads, timeout=1.0)
        c.pull_rows(f"b{k}", other)                     # 8,000 ids and 512 KB of rows through a region
    finally:
        resume.set()
        holder.join()
    (got,) = wait_for("the stalled push", lambda: _changed(c, ids, before), timeout=10)
    np.testing.assert_array_equal(got, before - grads)


def _changed(c, ids, before):
    """The rows of table "a" (in a tuple) once the stalled push was applied (None before)."""
    got = c.pull_rows("a", ids)
    return None if np.array_equal(got, before) else (got,)


def test_malformed_request_lists_are_refused_naming_the_request(cluster, client_factory):
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("a", (4,), optimizer=sgd(1.0))
    with pytest.raises(InvalidArgument, match="must be a list of tuples, got str"):
        c.pull_many("a")
    for bad, shown in (([("a",), []], r"\[\]"), ([("a",), (3,)], r"\(3,\)"), ([("a",), "a"], "'a'")):
        with pytest.raises(InvalidArgument, match=f"pull request {shown}: expected a tuple whose first item"):
            c.pull_many(bad)
        with pytest.raises(InvalidArgument, match=f"push request {shown}: expected a tuple"):
            c.push_many([("a", np.ones(4, np.float32)), *bad[1:]])
    np.testing.assert_array_equal(c.pull_dense("a"), c.pull_many([["a"]]).values[0])   # lists do too


def test_several_tables_in_one_request_and_state_dict(cluster, client_factory):
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("a", (10,), optimizer=sgd(1.0))
    c.create_sparse("b", 2, optimizer=sgd(1.0))
    c.push_many([("a", np.ones(10, np.float32)), ("b", [5, 6], np.ones((2, 2), np.float32))])
    res = c.pull_many([("a",), ("b", [6, 5, 6]), ("a", 2, 4)])
    np.testing.assert_allclose(res.values[0], -np.ones(10))
    np.testing.assert_allclose(res.values[1], -np.ones((3, 2)))
    assert res.values[2].shape == (2,)
    sd = c.state_dict()
    assert set(sd) == {"a", "b.ids", "b.rows"} and sd["b.ids"].tolist() == [5, 6]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc-chunks"])
def test_requests_above_4mib_work_and_futures(cluster, client_factory, shared_memory):
    c = client_factory(cluster.address, shared_memory=shared_memory)
    c.create_job()
    n = 5 << 20   # 20 MiB of float32
    c.create_dense("big", (n,), optimizer=sgd(1.0))
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    fut = c.push_dense_async("big", grad)
    fut.result(timeout=60)
    np.testing.assert_allclose(c.pull_dense_async("big").result(timeout=60), -grad)
    ids = np.arange(100_000)
    c.create_sparse("rows", 32, optimizer=sgd(1.0))              # a 12.8 MiB sparse pull too
    c.push_rows("rows", ids, np.ones((100_000, 32), np.float32))
    np.testing.assert_allclose(c.pull_rows("rows", ids), -np.ones((100_000, 32)))


def test_create_table_idempotent_and_conflict(cluster, client_factory):
    c = client_factory(cluster.address)
    c.create_job()
    t1 = c.create_dense("w", (10,), optimizer=sgd(0.1))
    t2 = c.create_dense("w", (10,), optimizer=sgd(0.1))
    assert t1.spec == t2.spec
    with pytest.raises(AlreadyExists, match="another spec"):
        c.create_dense("w", (11,), optimizer=sgd(0.1))


def test_learning_rate_change_takes_effect_on_the_next_push(cluster, client_factory):
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("w", (4,), optimizer=sgd(0.1))
    c.push_dense("w", np.ones(4, np.float32))
    np.testing.assert_allclose(c.pull_dense("w"), -0.1 * np.ones(4), rtol=1e-6)
    cfg = c.update_config("w", lr=0.5)
    assert cfg.optimizer.lr == 0.5 and cfg.version == 2
    c.push_dense("w", np.ones(4, np.float32))
    np.testing.assert_allclose(c.pull_dense("w"), -0.6 * np.ones(4), rtol=1e-6)
    with pytest.raises(InvalidArgument, match="cannot change"):
        c.update_config("w", momentum=0.9)


def test_errors_are_shardps_errors(cluster, client_factory):
    c = client_factory(cluster.address, job="nojob")
    with pytest.raises(NotFound, match="job 'nojob'"):
        c.create_dense("w", (3,))
    with pytest.raises(NotFound):
        c.pull_dense("missing")


def test_unreachable_manager_raises_with_advice(client_factory):
    from shardps.errors import Unavailable
    c = client_factory("127.0.0.1:1", timeout=1.0)
    with pytest.raises(Unavailable, match="reachable"):
        c.refresh_map()


def test_exactly_once_retry_of_the_same_push(cluster, client_factory):
    """A push re-sent with the same (session, incarnation, sequence) is applied once."""
    from shardps.messages import GRADIENT
    from shardps.worker.routing import Piece
    c = client_factory(cluster.address)
    c.create_job()
    c.join(name="w", heartbeat=False)
    c.create_dense("w", (100,), optimizer=sgd(1.0), block_size=10)
    piece = Piece(0, "w", True, 0, 100, values=np.ones(100, np.float32))
    session = c._session
    with session._lock:
        seq = session._next_seq
    first = c._data.push([piece], GRADIENT, None, None, False)
    session._next_seq = seq      # simulate a retry of the same push after a lost ack
    again = c._data.push([piece], GRADIENT, None, None, False)
    assert first.duplicate_blocks == 0 and again.duplicate_blocks == 10
    np.testing.assert_allclose(c.pull_dense("w"), -np.ones(100))


def test_pull_results_carry_their_own_clock_wait_and_staleness(cluster, client_factory):
    """Per-call results come back on the result, not in shared fields: two pulls in flight
    at once each report their own clock and staleness."""
    c = client_factory(cluster.address, job="ssp")
    c.create_job("ssp", staleness=5)
    c.join(name="w", heartbeat=False)
    c.create_dense("w", (8,), optimizer=sgd(1.0))
    one, four = (c.pull_many_async([("w",)], clock=k) for k in (1, 4))
    a, b = one.result(timeout=30), four.result(timeout=30)
    assert (a.clock, a.staleness) == (1, 1) and (b.clock, b.staleness) == (4, 4)
    assert a.waited_seconds >= 0 and a.min_clock == b.min_clock == 0
    c.pull_many([("w",)], clock=2)
    assert (c.clock, c.last_staleness) == (2, 2)
    assert c.push_dense("w", np.ones(8, np.float32), clock=0).clock == 0
    with pytest.raises(AttributeError):
        c.clock = 7            # a worker names its clock per call


class _FlakyTransport:
    """A Transport wrapping another: refuses the first call of each kind to each server
    with StaleEpoch, and records every call."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def _refuse_first(self, kind: str, server: str) -> None:
        from shardps.errors import StaleEpoch
        self.calls.append((kind, server))
        if self.calls.count((kind, server)) == 1:
            raise StaleEpoch(f"{kind} to {server}: injected")

    def push(self, server, address, request, timeout):
        self._refuse_first("push", server)
        return self.inner.push(server, address, request, timeout)

    def pull(self, server, address, request, reply_bytes, timeout, consume):
        self._refuse_first("pull", server)
        return self.inner.pull(server, address, request, reply_bytes, timeout, consume)

    def exchange_start(self, server, address, push, pull, timeout):
        return None

    def exchange_finish(self, started, consume):
        raise AssertionError("no exchange started")

    def step_start(self, server, address, request, reply_bytes, timeout, into=None):
        return None

    def step_finish(self, started, consume):
        raise AssertionError("no step started")

    def abandon(self, address):
        self.inner.abandon(address)

    def close(self):
        self.inner.close()


def test_a_transport_plugs_in_and_refusals_are_rerouted(cluster, client_factory):
    """Every data call goes through the Transport given to PSClient; a server's StaleEpoch
    makes the client re-send just that server's share."""
    from shardps.metrics import WorkerMetrics
    from shardps.rpc.stubs import StubPool
    from shardps.worker.client import GrpcTransport
    flaky = _FlakyTransport(GrpcTransport("test", StubPool(), WorkerMetrics()))
    c = client_factory(cluster.address, transport=flaky)
    c.create_job()
    c.create_dense("w", (4096,), optimizer=sgd(1.0), block_size=256)
    servers = {r[0] for r in c.table("w").replicas}
    assert len(servers) == 2, "the table should span both servers"
    ack = c.push_dense("w", np.ones(4096, np.float32))
    assert ack.duplicate_blocks == 0 and len(ack.versions) == 16
    np.testing.assert_allclose(c.pull_dense("w"), -np.ones(4096))
    for kind in ("push", "pull"):       # each server: refused once, then served
        assert sorted(s for k, s in flaky.calls if k == kind) == sorted(list(servers) * 2), flaky.calls
    assert c.metrics.registry.get_sample_value("shardps_client_retries_total", {"reason": "StaleEpoch"}) == 4


def _sparse_pulled(c) -> float:
    return c.metrics.registry.get_sample_value("shardps_client_sparse_bytes_total", {"direction": "pulled"}) or 0.0


def test_sparse_pulls_count_the_ids_and_rows_their_replies_carry(cluster, client_factory):
    """``shardps_client_sparse_bytes_total{direction="pulled"}``: the bytes of sparse rows (and,
    for an export, of the ids) in pull replies, part of ``bytes_total{pulled}``; the ids a
    pull sends are not counted (nor are they in bytes_total)."""
    c = client_factory(cluster.address)
    c.create_job()
    c.create_dense("w", (64,), optimizer=sgd(1.0))
    c.create_sparse("e", 8, optimizer=sgd(1.0))
    assert _sparse_pulled(c) == 0
    c.pull_rows("e", [3, 99, 3, 2**40])                        # 3 distinct rows of 8 float32
    assert _sparse_pulled(c) == 3 * 8 * 4
    c.pull_dense("w")
    assert _sparse_pulled(c) == 3 * 8 * 4
    c.push_rows("e", [5, 6], np.ones((2, 8), np.float32))
    before = _sparse_pulled(c)
    c.state_dict(["e"])                                         # 2 stored rows and their ids
    assert _sparse_pulled(c) - before == 2 * (8 + 8 * 4)
    before = _sparse_pulled(c)
    c.exchange_async([("w", np.ones(64, np.float32))], [("e", [1, 2, 3, 4, 5])], clock=0).result()
    assert _sparse_pulled(c) - before == 5 * 8 * 4
    pulled = c.metrics.registry.get_sample_value("shardps_client_bytes_total", {"direction": "pulled"})
    assert _sparse_pulled(c) <= pulled


def test_close_completes_when_a_held_push_fails_and_raises_it_after(cluster, client_factory):
    class Model:
        def __init__(self, error):
            self.error, self.calls = error, 0

        def flush(self):
            self.calls += 1
            raise self.error

    c = client_factory(cluster.address)
    c.create_job()
    gone = Model(RuntimeError("collected"))
    c.before_leaving(gone.flush)
    del gone                                                    # its ref is dead: dropped
    broken, unavailable = Model(RuntimeError("flush broke")), Model(NotFound("held push lost"))
    c.before_leaving(broken.flush)
    c.before_leaving(unavailable.flush)
    with pytest.raises(RuntimeError, match="flush broke"):
        c._send_held()                                          # not closing: the first error is raised
    assert len(c._before_leaving) == 2
    with pytest.raises(RuntimeError, match="flush broke"):
        c.close()
    assert broken.calls == 2 and unavailable.calls == 1        # every flush ran while closing
    assert c._closed.is_set() and c._calls._shutdown and c._rpcs._shutdown
    c._before_leaving.clear()                                   # the fixture's close() runs none


def test_a_pull_reply_counts_staleness_only_where_the_group_has_a_clock():
    """Both ways of pulling (Step frames, and the general path) take a server's answer with
    ``take_pull_reply``: staleness counts where a server reported the group's clock or the
    pull came from the group (a session); a sessionless pull of a job without a group clock
    has none, whatever clock it carries. Dense tables' versions are kept for the next push."""
    from shardps.messages import Versions
    from shardps.worker.client.results import BlockVersions, PullResult, take_pull_reply

    def taken(min_clock, in_group, clock=5):
        result, seen = PullResult([], BlockVersions(), clock=clock), {}
        take_pull_reply(result, min_clock, 0.25, [Versions("w", [0, 1], [3, 4]), Versions("e", [2], [9])],
                        in_group, {"w"}, seen)
        return result, seen

    assert taken(0, in_group=False)[0].staleness == 0          # no group clock anywhere
    assert taken(0, in_group=True)[0].staleness == 5           # the group completed no step yet
    assert taken(3, in_group=False)[0].staleness == 2
    assert taken(7, in_group=True)[0].staleness == 0           # ahead of this worker: not stale
    result, seen = taken(3, in_group=True)
    assert (result.min_clock, result.waited_seconds) == (3, 0.25)
    assert seen == {("w", 0): 3, ("w", 1): 4}                  # the dense table's only
    assert len(result.versions) == 3
