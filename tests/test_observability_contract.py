"""docs/observability.md against what shardps processes expose on /metrics.

The tables under "## Metrics" are the contract: each role (manager, server, worker) exposes
exactly the families its sections list, with the documented type and label names, and every
process exposes the process and platform collectors (``process_*``, ``python_info``). Checked
three ways: the label names every metric is declared with (so a labelled metric with no
children yet is checked too), a scrape over HTTP of a manager, a server and a client's
registry in this process, and a scrape of a manager and a server started as processes.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import start_http_server
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from shardps.metrics import ManagerMetrics, NodeMetrics, WorkerMetrics
from shardps.server.processes import ManagerProcess, ServerProcess
from shardps.settings import ManagerProcessSettings, ServerProcessSettings, Serving
from shardps.tables import adagrad, sgd

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
PROCESS_SECTION = "Every process"
ROLE_SECTIONS = {"manager": "Resource manager", "server": "Server nodes", "worker": "Workers"}
GRPC_PREFIX = {"manager": "grpc_server_", "server": "grpc_server_", "worker": "grpc_client_"}
PROCESS_FAMILIES = {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"}

Documented = dict[str, tuple[str, frozenset[str]]]      # family -> (type, label names)


def family_name(name: str, kind: str) -> str:
    """The family a documented sample name belongs to (a counter's ``x_total`` is ``x``)."""
    return name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name


def documented_sections() -> dict[str, Documented]:
    """Per "###" section under "## Metrics": its table rows as families."""
    text = DOC.read_text()
    body = text[text.index("\n## Metrics\n"):]
    body = body[:body.index("\n## ", 1)]
    sections: dict[str, Documented] = {}
    current: Documented = {}
    for line in body.splitlines():
        if line.startswith("### "):
            current = sections.setdefault(line[4:].split(" (")[0].strip(), {})
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            names = re.findall(r"`([a-z_]+)`", cells[0])
            assert len(names) == 1, f"docs/observability.md: one metric per row: {line}"
            labels = re.sub(r"\([^)]*\)", "", cells[2])
            current[family_name(names[0], cells[1])] = (
                cells[1], frozenset(x.strip() for x in labels.split(",") if x.strip()))
    return sections


def documented_for(role: str) -> Documented:
    sections = documented_sections()
    grpc = {k: v for k, v in sections["gRPC"].items() if k.startswith(GRPC_PREFIX[role])}
    return {**sections[PROCESS_SECTION], **grpc, **sections[ROLE_SECTIONS[role]]}


def emitted(address: str) -> dict[str, tuple[str, set[frozenset[str]]]]:
    """family -> (type, the label-name sets of its samples, ``le`` aside) from /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        label_sets = {frozenset(s.labels) - {"le"} for s in family.samples}
        out[family.name] = (family.type, label_sets)
    # the text format has each counter's and histogram's ``_created`` as a gauge of its own
    return {name: v for name, v in out.items()
            if not (name.endswith("_created") and name[:-len("_created")] in out)}


def assert_matches_doc(role: str, scraped: dict) -> None:
    doc = documented_for(role)
    assert PROCESS_FAMILIES <= set(scraped), f"{role}: no process collectors in {sorted(scraped)}"
    assert set(scraped) - set(doc) == set(), f"{role}: emitted, not in docs/observability.md"
    assert set(doc) - set(scraped) == set(), f"{role}: in docs/observability.md, not emitted"
    for name, (kind, label_sets) in scraped.items():
        assert kind == doc[name][0], f"{role}: {name} is a {kind}, the doc says {doc[name][0]}"
        for labels in label_sets:
            assert labels == doc[name][1], \
                f"{role}: {name} is labelled {sorted(labels)}, the doc says {sorted(doc[name][1])}"


# ---------------------------------------------------------------- units
def test_every_metrics_registry_has_the_process_and_platform_collectors():
    for metrics in (NodeMetrics(), ManagerMetrics(), WorkerMetrics()):
        r = metrics.registry
        assert r.get_sample_value("process_cpu_seconds_total") is not None, type(metrics).__name__
        assert r.get_sample_value("process_resident_memory_bytes") > 0
        assert r.get_sample_value("process_start_time_seconds") > 0
        info = next(f for f in r.collect() if f.name == "python_info")
        assert info.samples[0].labels["implementation"]


def test_a_workers_steps_reach_its_metrics_at_the_next_scrape():
    """``WorkerMetrics.step`` batches the training loop's per-step metrics; a collection of
    the registry (a scrape) sees every step recorded so far."""
    m = WorkerMetrics()
    for k in range(3):
        m.step("j", 512, 0.5 - k / 10, 1000.0 + k, (0.001, 0.0, 0.002, 0.0, 0.0005 * k), k)
    r = m.registry
    assert r.get_sample_value("shardps_worker_steps_total", {"training_job": "j"}) == 3
    assert r.get_sample_value("shardps_worker_samples_total", {"training_job": "j"}) == 3 * 512
    assert r.get_sample_value("shardps_worker_loss", {"training_job": "j"}) == pytest.approx(0.3)
    assert r.get_sample_value("shardps_worker_samples_per_second", {"training_job": "j"}) == 1002.0
    for phase, total in (("compute", 0.006), ("push_wait", 0.0015), ("barrier_wait", 0.0)):
        labels = {"training_job": "j", "phase": phase}
        assert r.get_sample_value("shardps_worker_step_phase_seconds_count", labels) == 3
        assert r.get_sample_value("shardps_worker_step_phase_seconds_sum", labels) == pytest.approx(total)
    assert r.get_sample_value("shardps_worker_staleness_steps_sum", {"training_job": "j"}) == 3
    m.step("k", 64, 0.9, 5.0, (0.0, 0.0, 0.25, 0.0, 0.0), 0)          # two jobs in one batch
    m.step("j", 512, 0.1, 7.0, (0.0, 0.0, 0.125, 0.0, 0.0), 0)
    assert r.get_sample_value("shardps_worker_steps_total", {"training_job": "j"}) == 4
    assert r.get_sample_value("shardps_worker_samples_total", {"training_job": "k"}) == 64
    assert r.get_sample_value("shardps_worker_step_phase_seconds_sum",
                              {"training_job": "k", "phase": "compute"}) == 0.25
    assert r.get_sample_value("shardps_worker_loss", {"training_job": "j"}) == pytest.approx(0.1)


def _declared(metrics) -> dict[str, tuple[str, frozenset[str]]]:
    """The metric objects of a Metrics instance (and its ``grpc`` part): name, type, labels
    (prometheus_client keeps the label names of a metric in ``_labelnames``)."""
    out = {}
    for part in (metrics, getattr(metrics, "grpc", None)):
        for value in vars(part).values() if part is not None else ():
            if isinstance(value, MetricWrapperBase):
                out[value._name] = (value._type, frozenset(value._labelnames))
    return out


@pytest.mark.parametrize("role, cls", [("manager", ManagerMetrics), ("server", NodeMetrics),
                                       ("worker", WorkerMetrics)])
def test_every_declared_metric_is_documented_with_its_labels(role, cls):
    doc = documented_for(role)
    declared = _declared(cls())
    undocumented = sorted(set(declared) - set(doc))
    assert not undocumented, f"{role}: metrics missing from docs/observability.md: {undocumented}"
    for name, (kind, labels) in declared.items():
        assert doc[name] == (kind, labels), f"{role}: {name} is a {kind} labelled {sorted(labels)}; " \
                                            f"docs/observability.md says {doc[name]}"


def test_the_doc_names_the_training_job_label_as_emitted():
    named = set()
    for section in documented_sections().values():
        for name, (_, labels) in section.items():
            assert "job" not in labels, f"docs/observability.md: {name} labelled `job`: shardps emits training_job"
            named |= labels
    assert "training_job" in named


# ---------------------------------------------------------------- a cluster in this process
def test_a_manager_a_server_and_a_client_expose_what_the_doc_lists(client_factory):
    serving = Serving(listen="127.0.0.1:0", metrics_port=0, metrics_host="127.0.0.1")
    manager = ManagerProcess(ManagerProcessSettings(serving=serving, replication=1)).start()
    server = client_server = None
    try:
        server = ServerProcess(ServerProcessSettings(serving=serving, name="s0", manager=manager.address)).start()
        client = client_factory(manager.address, "contract")
        client.create_job()
        client.create_dense("w", shape=(8, 4), optimizer=sgd(lr=0.1))
        client.create_sparse("emb", dim=4, optimizer=adagrad(lr=0.1))
        client.push_dense("w", np.ones((8, 4), np.float32))
        ids = np.array([3, 7])
        client.push_rows("emb", ids, np.ones((2, 4), np.float32))
        client.pull_rows("emb", ids)
        client.pull_dense("w")
        client_server, _ = start_http_server(0, addr="127.0.0.1", registry=client.metrics.registry)
        assert_matches_doc("manager", emitted(manager.net.metrics_address))
        assert_matches_doc("server", emitted(server.net.metrics_address))
        assert_matches_doc("worker", emitted(f"127.0.0.1:{client_server.server_address[1]}"))
    finally:
        if client_server is not None:
            client_server.shutdown()
            client_server.server_close()
        if server is not None:
            server.stop()
        manager.stop()


# ---------------------------------------------------------------- processes
@pytest.mark.slow          # processes (a manager and a server)
def test_processes_expose_the_process_collectors_and_the_documented_metrics(tmp_path):
    from shardps.tools.local import LocalCluster
    with LocalCluster(servers=1, work_dir=str(tmp_path / "cluster")) as cluster:
        for proc in [cluster.manager, *cluster.servers.values()]:
            assert_matches_doc(proc.role, emitted(proc.info["metrics"]))
