"""The Grafana dashboards against a real Prometheus.

A ``LocalCluster`` (manager, two servers, then a third) trains digits-cnn with two workers.
Debian's ``prometheus`` binary (installed when missing) scrapes every process twice over, in
two Prometheus servers on loopback: one configured from ``deploy/prometheus/prometheus.yml``
(Compose), one from ``deploy/prometheus/kubernetes.yml`` (pod annotations), each with its
service discovery swapped for a file of the local targets, so both configs' relabelling is what
is tested. During training the test provokes a stale-epoch refusal (a raw Push under the epoch
before a server joined), a rejected bad request (a NaN gradient) and refusals of the workers'
own requests (their dense table in blocks of 4,096, some of which move to the new server), so
the error panels have data, and fills a sparse table's cold tier (rows written to disk, read
by pulls, warmed by pushes), so the cold-tier panels have data. Then every PromQL expression
of every panel of every dashboard runs through each Prometheus's HTTP API and must parse and
return a non-empty result.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from tests.debian import debian_binary
from tests.sessions import ClientSession
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
COMPOSE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
KUBERNETES_CONFIG = ROOT / "deploy" / "prometheus" / "kubernetes.yml"
DATASOURCE_UID = "shardps-prometheus"
SCRAPE_SECONDS = 1
# What Grafana would put in place of the dashboards' variables (the rate interval is at least
# four scrape intervals; "demo" is the job the workers train).
SUBSTITUTIONS = {"$__rate_interval": "10s", "$training_job": "demo"}
PANEL_TO_PRINT = "Errors since process start by method and code"


# ====================================================================== dashboards as data
def _panels(items):
    for p in items:
        if p.get("type") == "row":
            yield from _panels(p.get("panels", []))
        else:
            yield p


def dashboard_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard title, panel title, refId, expr) of every panel target."""
    out = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        for p in _panels(d["panels"]):
            for t in p.get("targets", []):
                out.append((d["title"], p["title"], t["refId"], t["expr"]))
    return out


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a dashboard variable the test does not know: {expr}"
    return expr


def test_dashboards_refer_to_the_provisioned_datasource():
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == [DATASOURCE_UID]
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/shardps.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    assert [p.stem for p in DASHBOARDS] == ["cluster-overview", "shard-load", "training"]
    uids = set()
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        assert d["uid"] not in uids, f"{path.name}: duplicate uid {d['uid']}"
        uids.add(d["uid"])
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in _panels(d["panels"]):
            where = f"{path.name}: panel {p['title']!r}"
            assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, where
            assert p["targets"], f"{where} has no query"
            for t in p["targets"]:
                assert t["datasource"]["uid"] == DATASOURCE_UID, where
                assert t["expr"].strip(), where
        for v in d.get("templating", {}).get("list", []):
            assert v["datasource"]["uid"] == DATASOURCE_UID, f"{path.name}: variable {v['name']}"


_METHOD_FILTER = re.compile(r'grpc_method\s*=~?\s*"([^"]*)"')


def data_path_queries() -> list[tuple[str, str, str, str]]:
    """The panel queries that filter the ParameterServer's data path by method."""
    return [q for q in dashboard_queries() if "shardps.v1.ParameterServer" in q[3] and _METHOD_FILTER.search(q[3])]


def test_the_data_path_panels_count_every_data_method():
    # the default data plane serves a worker's step as Step: a panel counting the data path
    # by Push|Pull alone would show almost nothing in a default deployment
    from shardps.metrics import DATA_METHODS, DATA_METHODS_REGEX
    assert "Step" in DATA_METHODS
    queries = data_path_queries()
    assert len(queries) >= 9
    for d, t, r, expr in queries:
        for methods in _METHOD_FILTER.findall(expr):
            assert methods == DATA_METHODS_REGEX, f"{d} / {t} [{r}] filters the data path by {methods!r}"


# ====================================================================== a real Prometheus
def prometheus_binary() -> str:
    """The prometheus binary (Debian's prometheus, installed when missing), else skips."""
    return debian_binary("prometheus", "prometheus")


_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback, never a proxy


def http_json(url: str, timeout: float = 10.0) -> dict:
    try:
        with _HTTP.open(url, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:      # bad_data (a parse error) comes back as 400
        return json.loads(err.read())


_LISTENING = re.compile(r'msg="Listening on" address=(127\.0\.0\.1:\d+)')


class Prometheus:
    """One Prometheus server on loopback with its own config and storage."""

    def __init__(self, binary: str, name: str, config: dict, work: Path):
        self.name = name
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.config_path = self.dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = ""                   # known once it listens (wait_ready): it binds port 0
        self.log_path = self.dir / "prometheus.log"
        cmd = [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.dir / 'data'}",
               "--web.listen-address=127.0.0.1:0"]
        if shutil.which("setpriv"):       # dies with the test process even if that is killed
            cmd = ["setpriv", "--pdeathsig", "TERM", "--"] + cmd
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus {self.name} exited with {self.popen.returncode}:\n{self.log()}")
            if not self.url:                # the port it bound, from its log line
                found = _LISTENING.search(self.log_path.read_text(errors="replace"))
                if found is None:
                    time.sleep(0.1)
                    continue
                self.url = f"http://{found.group(1)}"
            try:
                with _HTTP.open(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus {self.name} not ready after {timeout}s:\n{self.log()}")

    def query(self, expr: str) -> list:
        """The instant query's result; raises with Prometheus's message if it does not parse."""
        body = http_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {self.name} refused {expr!r}: "
                                 f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def targets(self) -> dict:
        return http_json(f"{self.url}/api/v1/targets")["data"]

    def label_values(self, label: str, match: str) -> list:
        q = urllib.parse.urlencode({"match[]": match})
        return http_json(f"{self.url}/api/v1/label/{label}/values?{q}")["data"]

    def log(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _write_targets(path: Path, groups: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")                  # file_sd must never read a half-written file
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


class ComposeTargets:
    """deploy/prometheus/prometheus.yml with its static and DNS discovery replaced by files."""

    def __init__(self, work: Path):
        self.files = {c: work / f"compose-{c}.json" for c in ("manager", "server", "worker")}

    def config(self) -> dict:
        cfg = yaml.safe_load(COMPOSE_CONFIG.read_text())
        cfg["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", scrape_timeout=f"{SCRAPE_SECONDS}s",
                             evaluation_interval=f"{SCRAPE_SECONDS}s")
        jobs = []
        for sc in cfg["scrape_configs"]:
            component = sc["job_name"].removeprefix("shardps-")
            if component not in self.files:
                continue                                 # Prometheus's own job
            for key in [k for k in sc if k.endswith("_sd_configs") or k == "static_configs"]:
                del sc[key]
            sc["file_sd_configs"] = [{"files": [str(self.files[component])], "refresh_interval": "1s"}]
            jobs.append(sc)
        cfg["scrape_configs"] = jobs
        return cfg

    def write(self, manager: str, servers: dict[str, str], workers: list[str]) -> None:
        _write_targets(self.files["manager"], [{"targets": [manager], "labels": {}}])
        _write_targets(self.files["server"], [{"targets": [a], "labels": {"server": n}} for n, a in servers.items()])
        _write_targets(self.files["worker"], [{"targets": workers, "labels": {}}])


class KubernetesTargets:
    """deploy/prometheus/kubernetes.yml with pod discovery replaced by a file of the pods'
    meta labels (annotations, component label, name), as kubernetes_sd would give them."""

    def __init__(self, work: Path):
        self.file = work / "kubernetes-pods.json"

    def config(self) -> dict:
        cfg = yaml.safe_load(KUBERNETES_CONFIG.read_text())
        cfg["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s", scrape_timeout=f"{SCRAPE_SECONDS}s",
                             evaluation_interval=f"{SCRAPE_SECONDS}s")
        for sc in cfg["scrape_configs"]:
            del sc["kubernetes_sd_configs"]
            sc["file_sd_configs"] = [{"files": [str(self.file)], "refresh_interval": "1s"}]
        return cfg

    @staticmethod
    def pod(name: str, component: str, metrics: str, scrape: str = "true") -> dict:
        host, port = metrics.rsplit(":", 1)
        return {"targets": [f"{host}:1"],            # a container port: the annotation's port wins
                "labels": {"__meta_kubernetes_namespace": "shardps",
                           "__meta_kubernetes_pod_name": name,
                           "__meta_kubernetes_pod_phase": "Running",
                           "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
                           "__meta_kubernetes_pod_annotation_prometheus_io_scrape": scrape,
                           "__meta_kubernetes_pod_annotation_prometheus_io_port": port}}

    def write(self, manager: str, servers: dict[str, str], workers: list[str]) -> None:
        pods = [self.pod("manager-0", "manager", manager)]
        pods += [self.pod(n, "server", a) for n, a in servers.items()]
        pods += [self.pod(f"worker-{i}", "worker", a) for i, a in enumerate(workers)]
        pods.append(self.pod("not-annotated", "other", "127.0.0.1:9", scrape="false"))     # never scraped
        _write_targets(self.file, pods)


def all_targets_up(prom: Prometheus, expected: int) -> bool:
    active = prom.targets()["activeTargets"]
    return len(active) == expected and all(t["health"] == "up" for t in active)


# ====================================================================== provoking errors
def provoke_stale_epoch_and_bad_request(cluster, on_new_server) -> dict:
    """Start server s2 so blocks move; then a raw Push under the old epoch (refused:
    FAILED_PRECONDITION, reason stale_epoch) and a raw Push of a NaN gradient
    (INVALID_ARGUMENT; the client refuses it before sending)."""
    from shardps.errors import InvalidArgument
    from shardps.protos.v1 import common_pb2 as pb
    from shardps.protos.v1 import parameter_server_pb2 as ps
    from shardps.rpc import channels
    from shardps.rpc.codec import encode_chunk
    from shardps.rpc.stubs import ParameterServerStub
    from shardps.tables import sgd
    from shardps.worker.client import PSClient

    with PSClient(cluster.manager_address, "probe", timeout=30.0) as c:
        c.create_job()
        c.create_dense("w", (64 * 100,), optimizer=sgd(0.1), block_size=64)
        c.push_dense("w", np.ones(64 * 100, np.float32))
        old_epoch = c.shard_map.epoch
    # No client is open while LocalCluster forks: gRPC's fork handlers can deadlock a fork
    # made while this process has channels in use.
    cluster.start_server("s2")
    on_new_server()
    seen = {}
    with PSClient(cluster.manager_address, "probe", timeout=30.0) as c:
        def moved_block():
            t = c.refresh_map().table("probe", "w")
            return next((b + 1 for b, r in enumerate(t.replicas)
                         if r and r[0] == "s2" and int(t.since_epoch[b]) > old_epoch), None)
        b = wait_for("a block of probe/w moved to s2", moved_block, timeout=30) - 1
        header = ps.PushHeader(header=ClientSession(cluster.manager_address, "probe").header(old_epoch),
                               segments=[pb.Segment(table="w", range=pb.Range(start=b * 64, stop=b * 64 + 64))],
                               payload_bytes=256)
        with channels.channel(cluster.servers["s2"].address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(),
                                                                np.ones(64, np.float32).tobytes())]), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
            seen["stale_epoch"] = err.value.details()
            bad = np.ones(64, np.float32)
            bad[3] = np.nan
            # the client refuses it before sending; a raw Push gets as far as the server
            with pytest.raises(InvalidArgument) as refused:
                c.push_dense("w", bad, start=b * 64)
            header.header.epoch = c.shard_map.epoch
            with pytest.raises(grpc.RpcError) as err:
                ParameterServerStub(ch).Push(iter([encode_chunk(header.SerializeToString(), bad.tobytes())]),
                                             timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        seen["bad_request"] = f"{refused.value} (client); {err.value.details()} (server)"
    return seen


def fill_a_cold_tier(cluster) -> None:
    """A sparse table of job "probe" whose memory budget (15 rows a block) moves most of its
    rows to the servers' cold tiers: pushes write them there, a pull reads some, a push brings
    some back to RAM (shardps_table_cold_*, shardps_table_rows, shardps_table_hot_hit_ratio)."""
    from shardps.budget import set_lifecycle
    from shardps.tables import LifecyclePolicy, adagrad
    from shardps.worker.client import PSClient

    row_bytes = 4 * 4 * 2 + 4 + 12          # values, Adagrad's sum, tick, sorted index entry
    rng = np.random.default_rng(7)
    with PSClient(cluster.manager_address, "probe", timeout=30.0) as c:
        c.create_sparse("cold", 4, optimizer=adagrad(0.1), num_blocks=8)
        set_lifecycle(c, "cold", LifecyclePolicy(budget_bytes=8 * 15 * row_bytes, cold=True))
        for tick in range(1, 11):
            ids = np.unique(rng.integers(0, 3000, 300)).astype(np.int64)
            c.push_rows("cold", ids, np.ones((ids.shape[0], 4), np.float32), clock=tick)
        first = np.arange(0, 400, dtype=np.int64)
        c.pull_rows("cold", first)                                          # read there
        c.push_rows("cold", first[:50], np.ones((50, 4), np.float32), clock=11)     # warmed


# ====================================================================== the test
@pytest.mark.prometheus
@pytest.mark.timeout(300, method="thread")     # a hang in C code would never see a signal
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    from shardps.tools.local import LocalCluster, tail

    binary = prometheus_binary()
    started = time.monotonic()
    queries = dashboard_queries()
    assert len(queries) >= 40, f"only {len(queries)} panel queries"
    cluster = LocalCluster(servers=2, replication=2, work_dir=str(tmp_path / "cluster"))
    proms: list[Prometheus] = []
    try:
        cluster.start()
        ready_files = [tmp_path / f"worker-{i}.ready" for i in range(2)]
        for i, ready in enumerate(ready_files):      # each binds a free port and names it there
            cluster.start_worker(f"worker-{i}", [
                "--job", "demo", "--model", "digits-cnn", "--mode", "ssp", "--staleness", "2", "--block-size", "4096",
                "--epochs", "1000", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                "--ready-file", str(ready)])
        wait_for("both workers to join", lambda: all(r.exists() for r in ready_files), 120, 0.1)
        worker_metrics = [json.loads(r.read_text())["metrics"] for r in ready_files]
        sources = [ComposeTargets(tmp_path), KubernetesTargets(tmp_path)]

        def write_targets() -> None:
            servers = {n: p.info["metrics"] for n, p in cluster.servers.items()}
            for s in sources:
                s.write(cluster.manager.info["metrics"], servers, worker_metrics)
        write_targets()
        proms = [Prometheus(binary, "compose", sources[0].config(), tmp_path),
                 Prometheus(binary, "kubernetes", sources[1].config(), tmp_path)]
        for p in proms:
            p.wait_ready()
        print(f"prometheus ready after {time.monotonic() - started:.1f}s: "
              + ", ".join(f"{p.name} {p.url}" for p in proms))

        def training(prom):
            for w in cluster.workers:
                if not w.alive:
                    raise RuntimeError(f"{w.name} exited with {w.popen.returncode}:\n{tail(w.log_path)}")
            rows = prom.query('shardps_worker_steps_total{training_job="demo"} > 5')
            return len(rows) == 2
        for p in proms:
            wait_for(f"prometheus {p.name} sees both workers training", lambda p=p: training(p), timeout=90)

        seen = provoke_stale_epoch_and_bad_request(cluster, write_targets)
        print(f"stale-epoch refusal: {seen['stale_epoch']}\nrejected bad request: {seen['bad_request']}")
        fill_a_cold_tier(cluster)
        for p in proms:                  # the k8s file also lists one pod without the annotation
            wait_for(f"prometheus {p.name} scrapes all 6 processes", lambda p=p: all_targets_up(p, 6), timeout=30)
            dropped = p.targets()["droppedTargets"]
            if p.name == "kubernetes":
                assert [t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in dropped] == ["not-annotated"]
            wait_for(f"prometheus {p.name} has the refusals",
                     lambda p=p: p.query('sum(shardps_server_refusals_total{reason="stale_epoch"}) >= 1')
                     and p.query('sum(grpc_server_handled_total{grpc_code="INVALID_ARGUMENT"}) >= 1')
                     and p.query('sum(grpc_server_handled_total{grpc_code="FAILED_PRECONDITION"}) >= 1'),
                     timeout=30)
            assert p.label_values("training_job", "shardps_worker_steps_total") == ["demo"]
            wait_for(f"prometheus {p.name} has the cold tier's rows and moves",
                     lambda p=p: p.query('sum(shardps_table_cold_rows{training_job="probe", table="cold"}) > 0')
                     and {r["metric"]["event"] for r in p.query(
                         'sum by (event) (shardps_table_cold_moves_total{training_job="probe", table="cold"}) > 0')}
                     >= {"written", "read", "warmed"}, timeout=30)
            assert p.query('count(shardps_server_blocks{component="server", server="s2"})'), \
                f"{p.name}: the server and component labels are missing"

        # every panel's every query, until each returns data (rates need two scrapes)
        for p in proms:
            pending = {(d, t, r): substitute(e) for d, t, r, e in queries}
            results = {}
            deadline = time.monotonic() + 45
            while pending:
                for key, expr in list(pending.items()):
                    result = p.query(expr)           # raises when Prometheus cannot parse it
                    if result:
                        results[key] = result
                        del pending[key]
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert not pending, f"prometheus {p.name}: {len(pending)} panel queries returned nothing:\n" + \
                "\n".join(f"  {d} / {t} [{r}]: {e}" for (d, t, r), e in pending.items())
            for d, t, r, e in data_path_queries():      # what the default data plane serves
                if re.search(r"by \([^)]*grpc_method", e):       # panels that show each method
                    methods = {row["metric"].get("grpc_method") for row in results[(d, t, r)]}
                    assert "Step" in methods, f"prometheus {p.name}: {d} / {t} [{r}] shows {methods}, no Step"
            nan = sum(1 for rows in results.values() if all(v["value"][1] == "NaN" for v in rows))
            print(f"prometheus {p.name}: {len(results)} panel queries, every one non-empty "
                  f"({nan} evaluate to NaN for now: quantiles of histograms without recent observations)")
        d, t, r, e = next(q for q in queries if q[1] == PANEL_TO_PRINT)
        print(f"panel {d} / {t!r}:\n  {e}")
        for row in proms[0].query(substitute(e)):
            print(f"  {row['metric']} => {row['value'][1]}")
        print(f"test took {time.monotonic() - started:.1f}s")
    finally:
        for p in proms:
            p.stop()
        cluster.stop()
        cluster.cleanup()
