"""Prometheus metrics of every shardps process, named by Prometheus conventions.

Each process builds its metric families on its own ``CollectorRegistry`` (no global
singleton), so several servers can live in one test process; by default it is a
``process_registry``, which also holds prometheus_client's process, platform and GC collectors
(``process_*``, ``python_info``, ``python_gc_*``), as its global registry would. Labels are low-cardinality:
method, status code, training job, table, role, phase; never a key, a row or a block. The
training job's label is ``training_job``: Prometheus reserves ``job`` for the scrape job.

gRPC metrics use the names of the go-grpc-prometheus / py-grpc-prometheus convention:
``grpc_server_handled_total{grpc_service, grpc_method, grpc_type, grpc_code}``,
``grpc_server_handling_seconds``, ``grpc_client_handled_total``, ``grpc_client_handling_seconds``.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# The methods (``grpc_method``) that carry a job's data, on gRPC and on the data plane alike:
# the default data plane sends a worker's push and pull to one server as one Step; Push, Pull
# and Exchange are the other forms. Dashboards filter the data path by all of them
# (``grpc_method=~"Push|Pull|Exchange|Step"``); server-to-server Replicate is not among them.
DATA_METHODS = ("Push", "Pull", "Exchange", "Step")
DATA_METHODS_REGEX = "|".join(DATA_METHODS)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = tuple(float(4 ** i) for i in range(2, 16))    # 16 B .. 1 GiB
ROW_BUCKETS = tuple(float(4 ** i) for i in range(0, 12))     # 1 .. 4M rows
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class FlushingRegistry(CollectorRegistry):
    """A registry that runs its ``before_collect`` hooks before every collection (a scrape, a
    ``get_sample_value``): metrics observed in batches (``Batch``) are then up to date."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.before_collect: list = []

    def collect(self):
        for hook in list(self.before_collect):
            hook()
        return super().collect()


def observe_all(child, values) -> None:
    """``child.observe(v)`` for each of ``values`` (a histogram's labelled child), in one
    pass: the same buckets and sum as the calls one by one."""
    values = np.asarray(values, dtype=np.float64)
    if not values.shape[0]:
        return
    bounds = np.asarray(child._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=bounds.shape[0])
    for i in np.flatnonzero(counts[:bounds.shape[0]]).tolist():
        child._buckets[i].inc(int(counts[i]))
    child._sum.inc(float(values.sum()))


class Batch:
    """Events of a hot path (one tuple per request), kept in a deque and handed to their
    metrics by ``record(events)`` in one go: every ``every`` events, and before the registry
    is collected when it is a ``FlushingRegistry``. ``add`` is one deque append (atomic, no
    lock); ``flush`` takes the events there are when it starts (those added meanwhile wait
    for the next). Thread-safe."""

    def __init__(self, registry: CollectorRegistry, record, every: int = 512):
        self.record = record
        self.every = every
        self.events: collections.deque = collections.deque()
        self._lock = threading.Lock()
        if isinstance(registry, FlushingRegistry):
            registry.before_collect.append(self.flush)

    def add(self, event: tuple) -> None:
        self.events.append(event)
        if len(self.events) >= self.every:
            self.flush()

    def flush(self) -> None:
        with self._lock:                 # one flush at a time: each event recorded once
            take = self.events.popleft
            events = [take() for _ in range(len(self.events))]
            if events:
                self.record(events)


def _record_grpc_calls(g, events: list) -> None:
    """Batched data-plane calls ((service, method, code, seconds) each) into the
    ``grpc_server_*`` or ``grpc_client_*`` metrics ``g``, as ``grpc_type="dataplane"``."""
    by_call: dict[tuple, list[float]] = {}
    for service, method, code, seconds in events:
        by_call.setdefault((service, method, code), []).append(seconds)
    for (service, method, code), times in by_call.items():
        labelled(g.started, service, method, "dataplane").inc(len(times))
        labelled(g.handled, service, method, "dataplane", code).inc(len(times))
        observe_all(labelled(g.handling, service, method, "dataplane"), times)


def process_registry() -> CollectorRegistry:
    """A new registry holding the collectors of the process itself: ``process_*`` (CPU
    seconds, resident and virtual memory, open and max file descriptors, start time; where
    /proc exists), ``python_info`` (the interpreter's version and implementation) and
    ``python_gc_*`` (garbage-collector counts). Every Metrics class below starts from one
    unless given a registry."""
    registry = FlushingRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def labelled(metric, *values: str):
    """``metric.labels(*values)``, cached on the metric: for the fixed label sets of the data
    path (a ``labels`` call validates and locks: a few microseconds, several per request).
    Only for metrics whose label sets are never removed."""
    children = metric.__dict__.get("_shardps_children")
    if children is None:
        children = metric.__dict__["_shardps_children"] = {}
    child = children.get(values)
    if child is None:
        child = children[values] = metric.labels(*values)
    return child


class GrpcServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        labels = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.",
                               labels, registry=registry)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code.",
                               labels + ("grpc_code",), registry=registry)
        self.handling = Histogram("grpc_server_handling_seconds",
                                  "Time from an RPC's start to its completion on the server.",
                                  labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.msg_received = Counter("grpc_server_msg_received_total", "Stream messages received.",
                                    labels, registry=registry)
        self.msg_sent = Counter("grpc_server_msg_sent_total", "Stream messages sent.",
                                labels, registry=registry)


class GrpcClientMetrics:
    def __init__(self, registry: CollectorRegistry):
        labels = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("grpc_client_started_total", "RPCs started by the client.",
                               labels, registry=registry)
        self.handled = Counter("grpc_client_handled_total", "RPCs completed by the client, by status code.",
                               labels + ("grpc_code",), registry=registry)
        self.handling = Histogram("grpc_client_handling_seconds",
                                  "Time from an RPC's start to its completion at the client.",
                                  labels, buckets=LATENCY_BUCKETS, registry=registry)


class NodeMetrics:
    """Metrics of a server node's data path."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = process_registry() if registry is None else registry
        r = self.registry
        self.grpc = GrpcServerMetrics(r)
        self.phase_seconds = Counter(
            "shardps_server_phase_seconds",
            "Seconds spent in data requests, by phase: decode (request header, segments, the "
            "split into blocks and its checks), lookup (reading stored values for pulls), "
            "optimizer (applying pushes and forwarding them to backups), encode (the reply). "
            "The rest of a server's time is idle or waiting (SYNC / SSP pulls wait outside "
            "every phase).", ("phase",), registry=r)
        self.request_bytes = Histogram("shardps_server_request_bytes", "Payload bytes per data request.",
                                       ("method",), buckets=SIZE_BUCKETS, registry=r)
        self.request_rows = Histogram("shardps_server_request_rows",
                                      "Sparse rows per data request (dense ranges count as 0).",
                                      ("method",), buckets=ROW_BUCKETS, registry=r)
        self.bytes = Counter("shardps_server_bytes_total", "Payload bytes received and sent.",
                             ("direction",), registry=r)
        self.update_seconds = Histogram("shardps_server_update_seconds",
                                        "Time to apply one push on this server (all its blocks).",
                                        ("optimizer",), buckets=LATENCY_BUCKETS, registry=r)
        self.table_parameters = Gauge("shardps_table_parameters",
                                      "Parameters stored on this server, per table.",
                                      ("training_job", "table"), registry=r)
        self.table_bytes = Gauge("shardps_table_memory_bytes",
                                 "Bytes of values and optimizer state on this server, per table.",
                                 ("training_job", "table"), registry=r)
        self.blocks = Gauge("shardps_server_blocks", "Blocks held by this server, by role.",
                            ("role",), registry=r)
        self.epoch = Gauge("shardps_shard_map_epoch", "Shard-map epoch installed on this process.",
                           registry=r)
        self.staleness = Histogram("shardps_pull_staleness_steps",
                                   "Staleness at a pull: the worker's clock minus the slowest live worker's.",
                                   ("training_job",), buckets=STALENESS_BUCKETS, registry=r)
        self.updates_between = Histogram(
            "shardps_push_intervening_updates",
            "Updates a block received between a worker's pull of it and that worker's push.",
            ("training_job",), buckets=STALENESS_BUCKETS, registry=r)
        self.duplicates = Counter("shardps_push_duplicates_total",
                                  "Block updates skipped because the push was already applied (retries).",
                                  ("training_job",), registry=r)
        self.refusals = Counter("shardps_server_refusals_total",
                                "Data requests refused, by reason: stale_epoch, invalid, unavailable, "
                                "quota, unauthorized.", ("reason",), registry=r)
        for reason in ("stale_epoch", "invalid", "unavailable", "quota", "unauthorized"):
            self.refusals.labels(reason)
        self.replication_seconds = Histogram("shardps_replication_seconds",
                                             "Time to forward one push to a backup.",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.resyncs = Counter("shardps_replica_resyncs_total",
                               "Full block copies sent to bring a backup back in sync.", registry=r)
        tl = ("training_job", "table")
        self.table_rows = Gauge("shardps_table_rows", "Sparse rows stored on this server, per table "
                                "with a lifecycle policy.", tl, registry=r)
        self.table_budget = Gauge("shardps_table_budget_bytes",
                                  "This server's share of a table's memory budget (the blocks it holds).",
                                  tl, registry=r)
        self.table_storage = Gauge("shardps_table_storage_bytes",
                                   "Bytes a sparse table's storage takes here (slots, index, sketches): "
                                   "what the budget bounds.", tl, registry=r)
        self.table_lifecycle_rows = Gauge(
            "shardps_table_lifecycle_rows", "Rows by lifecycle event since this server took the blocks up: "
            "admitted, not_admitted (gradients dropped), evicted_ttl, evicted_budget, evicted_replicated "
            "(a backup replaying its primary's eviction).", tl + ("event",), registry=r)
        self.table_pull_miss = Gauge(
            "shardps_table_pull_miss_ratio", "Share of pulled rows not stored, by reason: evicted "
            "(admitted before), not_admitted.", tl + ("reason",), registry=r)
        self.table_hot_hits = Gauge("shardps_table_hot_hit_ratio", "Share of pulled rows found in RAM (the "
                                    "others: in the cold tier, or not stored).", tl, registry=r)
        self.table_cold_rows = Gauge("shardps_table_cold_rows", "Rows in this server's cold tier of a table "
                                     "(on local disk).", tl, registry=r)
        self.table_cold_bytes = Gauge("shardps_table_cold_bytes", "Bytes the rows of a table's cold tier take "
                                      "on this server's disk.", tl, registry=r)
        self.table_cold_moves = Counter(
            "shardps_table_cold_moves", "Rows through a table's cold tier: written (evicted from RAM to disk), "
            "read (by pulls), warmed (back to RAM by a push), expired (TTL).", tl + ("event",), registry=r)
        self._cold_seen: dict[tuple, int] = {}

        self._parts = Batch(r, self._record_parts)
        self._calls = Batch(r, self._record_calls)

    def observe_part(self, kind: str, rows: int, nbytes: int, phases: tuple = (), optimizer: str = "",
                     update: float | None = None) -> None:
        """One push or pull a node served (``kind`` "push" or "pull"): its sparse rows, its
        payload bytes, its seconds per phase (``(phase, seconds)`` pairs), and a push's
        optimizer and update seconds (None: not observed). Batched."""
        self._parts.add((kind, rows, nbytes, phases, optimizer, update))

    def observe_call(self, service: str, method: str, code: str, seconds: float) -> None:
        """One data-plane call in the ``grpc_server_*`` metrics (``grpc_type="dataplane"``),
        batched."""
        self._calls.add((service, method, code, seconds))

    def _record_parts(self, events: list) -> None:
        for kind, method, direction in (("push", "Push", "in"), ("pull", "Pull", "out")):
            mine = [e for e in events if e[0] == kind]
            if mine:
                observe_all(labelled(self.request_bytes, method), [e[2] for e in mine])
                observe_all(labelled(self.request_rows, method), [e[1] for e in mine])
                labelled(self.bytes, direction).inc(sum(e[2] for e in mine))
        seconds: dict[str, float] = {}
        by_optimizer: dict[str, list[float]] = {}
        for e in events:
            for phase, spent in e[3]:
                seconds[phase] = seconds.get(phase, 0.0) + spent
            if e[5] is not None:
                by_optimizer.setdefault(e[4], []).append(e[5])
        for phase, spent in seconds.items():
            labelled(self.phase_seconds, phase).inc(spent)
        for name, times in by_optimizer.items():
            observe_all(self.update_seconds.labels(name), times)

    def _record_calls(self, events: list) -> None:
        _record_grpc_calls(self.grpc, events)

    def set_lifecycle(self, reports: dict) -> None:
        """Set the lifecycle gauges from ``server.lifecycle.report`` per (job, table)."""
        for g in (self.table_rows, self.table_budget, self.table_storage, self.table_lifecycle_rows,
                  self.table_pull_miss, self.table_hot_hits, self.table_cold_rows, self.table_cold_bytes):
            g.clear()
        for (job, table), r in reports.items():
            self.table_rows.labels(job, table).set(r["rows"])
            self.table_budget.labels(job, table).set(r["budget_bytes"])
            self.table_storage.labels(job, table).set(r["memory_bytes"])
            for event in ("admitted", "not_admitted", "evicted_ttl", "evicted_budget", "evicted_replicated",
                          "cooled"):
                self.table_lifecycle_rows.labels(job, table, event).set(r[f"rows_{event}"])
            for reason in ("evicted", "not_admitted"):
                self.table_pull_miss.labels(job, table, reason).set(r[f"pull_miss_{reason}"])
            self.table_hot_hits.labels(job, table).set(r["hot_hit_ratio"])
            if "cold_rows" in r:
                self.table_cold_rows.labels(job, table).set(r["cold_rows"])
                self.table_cold_bytes.labels(job, table).set(r["cold_bytes"])
                for event in ("written", "read", "warmed", "expired"):
                    seen, now = self._cold_seen.get((job, table, event), 0), r[f"cold_{event}"]
                    if now > seen:         # the report's counts since the tier began; a new tier: from 0
                        self.table_cold_moves.labels(job, table, event).inc(now - seen)
                    self._cold_seen[(job, table, event)] = now


class ManagerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = process_registry() if registry is None else registry
        r = self.registry
        self.grpc = GrpcServerMetrics(r)
        self.epoch = Gauge("shardps_shard_map_epoch", "Current shard-map epoch.", registry=r)
        self.servers = Gauge("shardps_servers", "Registered server nodes, by state.", ("state",), registry=r)
        self.server_up = Gauge("shardps_server_up", "1 if the server's lease is current.", ("server",),
                               registry=r)
        self.heartbeat_age = Gauge("shardps_server_heartbeat_age_seconds",
                                   "Seconds since each server's last heartbeat.", ("server",), registry=r)
        self.server_blocks = Gauge("shardps_server_owned_blocks",
                                   "Blocks each server holds, by role (from the map).",
                                   ("server", "role"), registry=r)
        self.server_bytes = Gauge("shardps_server_stored_bytes",
                                  "Bytes each server reports storing.", ("server",), registry=r)
        self.blocks = Gauge("shardps_blocks", "Blocks in the shard map.", registry=r)
        self.under_replicated = Gauge("shardps_under_replicated_blocks",
                                      "Blocks with fewer than R live replicas (R itself, even when "
                                      "fewer than R servers are left).", registry=r)
        self.unrestorable = Gauge("shardps_replication_unrestorable_blocks",
                                  "Under-replicated blocks that cannot get R replicas back: fewer than "
                                  "R servers may hold blocks (start servers).", registry=r)
        self.lost_blocks = Gauge("shardps_lost_blocks",
                                 "Blocks that lost every replica and are not recovered: requests "
                                 "touching them fail with DATA_LOSS (restore a checkpoint or reset them).",
                                 registry=r)
        self.blocks_lost = Counter("shardps_blocks_lost_total", "Blocks that lost every replica.",
                                   ["training_job"], registry=r)
        self.blocks_recovered = Counter("shardps_blocks_recovered_total",
                                        "Lost blocks served again, by how: restored (from a checkpoint) "
                                        "or reset (initial values).", ["training_job", "how"], registry=r)
        self.moves = Counter("shardps_block_moves_total", "Blocks copied to a new replica.", registry=r)
        self.failovers = Counter("shardps_server_failures_total",
                                 "Servers declared dead (lease expired).", registry=r)
        self.workers = Gauge("shardps_workers", "Live workers per job.", ("training_job",), registry=r)
        self.install_seconds = Histogram("shardps_map_install_seconds",
                                         "Time to install a new epoch on every live server.",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.map_bytes = Counter("shardps_map_sent_bytes",
                                 "Shard-map bytes sent to servers (InstallShardMap) and clients "
                                 "(GetShardMap, WatchShardMap), by form: whole maps or changes.",
                                 ("form",), registry=r)

    def set_replication(self, health) -> None:
        """Set the replication gauges from a ``ReplicationHealth`` (server/manager/records.py)."""
        self.under_replicated.set(health.under_replicated)
        self.unrestorable.set(health.unrestorable)
        self.lost_blocks.set(health.lost)


class EmbeddingCacheCollector:
    """The worker-side embedding caches (``shardps.worker.row_cache.RowCache``), read at
    scrape time: a cache counts its reads in bulk (ages per step, not one observation per
    row), so its histogram is built from those counts here."""

    def __init__(self, registry: CollectorRegistry | None):
        self._lock = threading.Lock()
        self._caches: list[tuple[str, str, object]] = []
        if registry is not None:
            registry.register(self)

    def add(self, job: str, table: str, cache) -> None:
        """Expose ``cache`` (``ages`` counts per age, ``lookups``, ``hits``, ``size``)."""
        with self._lock:
            self._caches.append((job, table, cache))

    def collect(self):
        staleness = HistogramMetricFamily(
            "shardps_worker_cache_staleness_steps",
            "Age in steps of each embedding row a lookup read through the cache: cached rows "
            "up to the staleness bound, pulled rows the steps they were pulled ahead.",
            labels=("training_job", "table"))
        lookups = CounterMetricFamily("shardps_worker_cache_lookups",
                                      "Embedding rows looked up through a cache: hit (read from it) or miss (pulled).",
                                      labels=("training_job", "table", "result"))
        rows = GaugeMetricFamily("shardps_worker_cache_rows", "Rows held in a worker-side embedding cache.",
                                 labels=("training_job", "table"))
        with self._lock:
            caches = list(self._caches)
        for job, table, c in caches:
            ages = np.asarray(c.ages)
            counts = np.cumsum(ages)
            buckets = [(str(float(b)), float(counts[min(b, ages.shape[0] - 1)])) for b in STALENESS_BUCKETS]
            buckets.append(("+Inf", float(counts[-1])))
            staleness.add_metric([job, table], buckets, float((ages * np.arange(ages.shape[0])).sum()))
            hits, looked = int(c.hits), int(c.lookups)
            lookups.add_metric([job, table, "hit"], hits)
            lookups.add_metric([job, table, "miss"], looked - hits)
            rows.add_metric([job, table], int(c.size))
        yield staleness
        yield lookups
        yield rows


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = process_registry() if registry is None else registry
        r = self.registry
        self.grpc = GrpcClientMetrics(r)
        self.caches = EmbeddingCacheCollector(r)
        self.bytes = Counter("shardps_client_bytes_total", "Payload bytes pushed and pulled.",
                             ("direction",), registry=r)
        self.rows = Counter("shardps_client_rows_total", "Sparse rows pushed and pulled.",
                            ("direction",), registry=r)
        self.sparse_bytes = Counter("shardps_client_sparse_bytes_total",
                                    "Bytes of sparse ids and rows pushed and pulled (part of bytes_total).",
                                    ("direction",), registry=r)
        self.retries = Counter("shardps_client_retries_total", "Data calls retried, by reason.",
                               ("reason",), registry=r)
        for reason in ("StaleEpoch", "Unavailable", "DeadlineExceeded"):
            self.retries.labels(reason)
        self.steps = Counter("shardps_worker_steps_total", "Training steps completed.", ("training_job",), registry=r)
        self.samples = Counter("shardps_worker_samples_total", "Training samples processed.", ("training_job",),
                               registry=r)
        self.samples_per_second = Gauge("shardps_worker_samples_per_second",
                                        "Training throughput over the last steps.", ("training_job",), registry=r)
        self.loss = Gauge("shardps_worker_loss", "Training loss of the last step.", ("training_job",), registry=r)
        self.step_seconds = Histogram("shardps_worker_step_phase_seconds",
                                      "Time per step, by phase: compute, local_optimizer, pull_wait, push_wait, "
                                      "barrier_wait.",
                                      ("training_job", "phase"), buckets=LATENCY_BUCKETS, registry=r)
        self.staleness = Histogram("shardps_worker_staleness_steps",
                                   "Staleness the servers reported at this worker's pulls.",
                                   ("training_job",), buckets=STALENESS_BUCKETS, registry=r)
        self.info = Gauge("shardps_worker_info", "Constant 1, labelled with the worker's name and rank.",
                          ("training_job", "name", "rank"), registry=r)
        self._moved = Batch(r, self._record_moved)
        self._calls = Batch(r, self._record_calls)
        self._steps = Batch(r, self._record_steps, every=256)

    STEP_PHASES = ("pull_wait", "barrier_wait", "compute", "local_optimizer", "push_wait")

    def step(self, job: str, samples: int, loss: float, samples_per_second: float, phases: tuple,
             staleness: int) -> None:
        """One training step of ``job``: its samples, loss, throughput, the seconds of each of
        ``STEP_PHASES`` (in that order) and the staleness its pull saw, counted in batches
        (one deque append on the training thread; the registry's scrape sees every step)."""
        self._steps.add((job, samples, loss, samples_per_second, phases, staleness))

    def _record_steps(self, events: list) -> None:
        jobs = dict.fromkeys(list(zip(*events))[0])
        for job in jobs:
            _, samples, losses, speeds, phases, staleness = zip(*(events if len(jobs) == 1 else
                                                                  [e for e in events if e[0] == job]))
            labelled(self.steps, job).inc(len(samples))
            labelled(self.samples, job).inc(sum(samples))
            labelled(self.loss, job).set(losses[-1])
            labelled(self.samples_per_second, job).set(speeds[-1])
            for phase, seconds in zip(self.STEP_PHASES, zip(*phases)):
                observe_all(labelled(self.step_seconds, job, phase), seconds)
            observe_all(labelled(self.staleness, job), staleness)

    def moved(self, pushed_bytes: int, pushed_rows: int, pushed_sparse: int, pulled_bytes: int, pulled_rows: int,
              pulled_sparse: int) -> None:
        """One data call's payload (``bytes``, ``rows`` and ``sparse_bytes`` of each
        direction), counted in batches."""
        self._moved.add((pushed_bytes, pushed_rows, pushed_sparse, pulled_bytes, pulled_rows, pulled_sparse))

    def observe_call(self, service: str, method: str, code: str, seconds: float) -> None:
        """One data-plane call in the ``grpc_client_*`` metrics (``grpc_type="dataplane"``),
        batched."""
        self._calls.add((service, method, code, seconds))

    def totals(self) -> dict[str, float]:
        """The payload counters so far (``bytes_pushed``, ``rows_pulled``, ``sparse_bytes_pushed``,
        ...), batches included."""
        self._moved.flush()
        return {f"{name}_{direction}": labelled(metric, direction)._value.get()
                for name, metric in (("bytes", self.bytes), ("rows", self.rows), ("sparse_bytes", self.sparse_bytes))
                for direction in ("pushed", "pulled")}

    def _record_moved(self, events: list) -> None:
        totals = [sum(column) for column in zip(*events)]
        for direction, (nbytes, rows, sparse) in (("pushed", totals[:3]), ("pulled", totals[3:])):
            labelled(self.bytes, direction).inc(nbytes)
            labelled(self.rows, direction).inc(rows)
            labelled(self.sparse_bytes, direction).inc(sparse)

    def _record_calls(self, events: list) -> None:
        _record_grpc_calls(self.grpc, events)
