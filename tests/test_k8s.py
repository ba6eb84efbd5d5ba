"""The Kubernetes manifests: every overlay (and every component) renders with ``kubectl
kustomize`` and validates strictly against pinned Kubernetes versions; plus the properties the
manifests promise (docs/deploy.md): servers roll one at a time and drain first, ranks come
from the completion index, TLS probes use the plaintext health port, GPU workers get GPUs.

No cluster is needed: rendering is offline and ``kubernetes-validate`` carries the schemas.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

# The manifests are rendered with `kubectl kustomize` (processes); validating them takes ~20 s.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "gpu", "tls")
COMPONENTS = ("elastic-workers", "gpu", "servicemonitor", "tls")
# The oldest release the manifests support (native gRPC probes are GA in 1.27) and the one
# they target. kubernetes-validate bundles both schemas; strict mode rejects unknown fields.
KUBERNETES_VERSIONS = ("1.28.0", "1.33.0")
# Secrets the manifests use without creating them: the operator creates them (docs/deploy.md).
OPERATOR_SECRETS = {"shardps-auth", "shardps-tls"}
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is needed to render the overlays: apt-get install kubernetes-client")
    return path


def kubernetes_validate():
    try:
        import kubernetes_validate as kv
    except ImportError:
        pytest.fail("the kubernetes-validate package is missing: it belongs to the dev extra "
                    "(pip install -c constraints.txt -e '.[dev]')")
    return kv


def render(path: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path}:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_with_components(tmp: Path, components: list[str]) -> list[dict]:
    """The base plus components, as a user's own overlay would list them."""
    rel = os.path.relpath(K8S, tmp)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "shardps-test",
        "resources": [f"{rel}/base"],
        "components": [f"{rel}/components/{c}" for c in components],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(tmp)


@functools.cache
def rendered_sets() -> dict[str, list[dict]]:
    """Every overlay, every component on the base, and all components at once (rendered once
    per test session: tests/test_deploy_contract.py reads the same renders)."""
    sets = {f"overlays/{o}": render(K8S / "overlays" / o) for o in OVERLAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for c in COMPONENTS:
            (Path(tmp) / c).mkdir()
            sets[f"base+{c}"] = render_with_components(Path(tmp) / c, [c])
        # elastic-workers first so that tls and gpu patch its Deployment
        (Path(tmp) / "all").mkdir()
        sets["base+all"] = render_with_components(Path(tmp) / "all", list(COMPONENTS))
    return sets


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    return rendered_sets()


def pod_templates(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            yield d, d["spec"]["template"]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


# ---------------------------------------------------------------- rendering and validation
def test_every_overlay_and_component_validates_strictly(renders):
    kv = kubernetes_validate()
    checked = 0
    for name, docs in renders.items():
        assert docs, f"{name} rendered nothing"
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
                continue                    # Prometheus Operator kinds: checked below
            for version in KUBERNETES_VERSIONS:
                try:
                    kv.validate(doc, version, strict=True)
                except kv.ValidationError as exc:
                    pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes "
                                f"{version} at {'/'.join(map(str, exc.path))}: {exc.message}")
                checked += 1
    print(f"validated {checked} resource renders against Kubernetes {', '.join(KUBERNETES_VERSIONS)} (strict)")


def test_the_validator_rejects_an_unknown_field():
    """Guards against a vacuous validation: strict mode must reject a misspelt field."""
    kv = kubernetes_validate()
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 1, "targetport": 1}]}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_references_resolve(renders):
    """ConfigMaps referenced by pods are rendered; Secrets are rendered or operator-made."""
    for name, docs in renders.items():
        configmaps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
        secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"} | OPERATOR_SECRETS
        for owner, tmpl in pod_templates(docs):
            spec = tmpl["spec"]
            for c in spec["containers"]:
                for ref in c.get("envFrom", []):
                    assert ref["configMapRef"]["name"] in configmaps, (name, owner["metadata"]["name"], ref)
                for e in c.get("env", []):
                    key = e.get("valueFrom", {}).get("secretKeyRef")
                    if key:
                        assert key["name"] in secrets, (name, owner["metadata"]["name"], key)
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                volumes = {v["name"] for v in spec.get("volumes", [])}
                volumes |= {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
                assert mounts <= volumes, (name, owner["metadata"]["name"], mounts - volumes)
            for v in spec.get("volumes", []):
                if "secret" in v:
                    assert v["secret"]["secretName"] in secrets, (name, v)
        if name == "overlays/dev":
            assert any(d["kind"] == "Secret" and d["metadata"]["name"].startswith("shardps-auth") for d in docs)


def test_service_and_pod_monitors_select_metrics_ports(renders):
    docs = renders["base+servicemonitor"]
    sm = find(docs, "ServiceMonitor", "shardps")
    pm = find(docs, "PodMonitor", "shardps-workers")
    selected = [d for d in docs if d["kind"] == "Service"
                and sm["spec"]["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]
    assert {d["metadata"]["name"] for d in selected} == {"shardps-manager", "shardps-server"}
    for svc in selected:
        assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]
    workers = [t for _, t in pod_templates(docs)
               if pm["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()]
    assert workers, "the PodMonitor selects no worker pods"
    for t in workers:
        assert "metrics" in {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}


# ---------------------------------------------------------------- what the manifests promise
def test_manager_is_a_statefulset_of_one_with_its_state_on_a_volume(renders):
    for _name, docs in renders.items():
        sts = find(docs, "StatefulSet", "shardps-manager")
        assert sts["spec"]["replicas"] == 1
        claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
        assert {"state", "checkpoints"} <= claims
        mounts = {m["mountPath"]: m["name"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["/var/lib/shardps/state"] == "state" and mounts["/checkpoints"] == "checkpoints"


def test_servers_roll_one_at_a_time_and_drain_before_stopping(renders):
    for _name, docs in renders.items():
        sts = find(docs, "StatefulSet", "shardps-server")
        spec = sts["spec"]
        assert spec["serviceName"] == "shardps-server"
        assert spec["updateStrategy"]["type"] == "RollingUpdate"
        assert spec["updateStrategy"].get("rollingUpdate", {}).get("maxUnavailable", 1) == 1
        assert spec["podManagementPolicy"] == "OrderedReady"
        svc = find(docs, "Service", "shardps-server")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        pdb = find(docs, "PodDisruptionBudget", "shardps-server")
        assert pdb["spec"]["maxUnavailable"] == 1
        server = spec["template"]["spec"]["containers"][0]
        env = env_of(server)
        assert env["SHARDPS_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["SHARDPS_ADVERTISE"]["value"].startswith("$(SHARDPS_NAME).shardps-server:")
        pre_stop = " ".join(server["lifecycle"]["preStop"]["exec"]["command"])
        assert 'shardps drain "$SHARDPS_NAME"' in pre_stop
        assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_workers_rank_hint_is_the_completion_index(renders):
    for name, docs in renders.items():
        jobs = [d for d in docs if d["kind"] == "Job"]
        if "elastic-workers" in name or name == "base+all":
            assert not jobs and find(docs, "Deployment", "shardps-workers")
            continue
        job = find(docs, "Job", "shardps-train")
        assert job["spec"]["completionMode"] == "Indexed"
        env = env_of(job["spec"]["template"]["spec"]["containers"][0])
        assert env["SHARDPS_RANK_HINT"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_probes_are_native_grpc_and_use_the_plaintext_port_under_tls(renders):
    for name, docs in renders.items():
        tls = name in ("overlays/tls", "base+tls", "base+all")
        for sts_name, port, health in (("shardps-manager", 7070, 7080), ("shardps-server", 7071, 7081)):
            c = find(docs, "StatefulSet", sts_name)["spec"]["template"]["spec"]["containers"][0]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == (health if tls else port), (name, sts_name, probe)
            env = env_of(c)
            if tls:
                assert env["SHARDPS_HEALTH_PORT"]["value"] == str(health)
                assert env["SHARDPS_TLS_REQUIRE_CLIENT_CERT"]["value"] == "true"
        if tls:
            for _, tmpl in pod_templates(docs):
                for c in tmpl["spec"]["containers"]:
                    tls_env = {"SHARDPS_TLS_CERT", "SHARDPS_TLS_KEY", "SHARDPS_TLS_CA"}
                    assert tls_env <= env_of(c).keys(), (name, c["name"])


def test_gpu_workers_get_gpus_on_gpu_nodes(renders):
    for name in ("overlays/gpu", "base+gpu", "base+all"):
        workers = 0
        for _, tmpl in pod_templates(renders[name]):
            if tmpl["metadata"]["labels"]["app.kubernetes.io/component"] != "worker":
                assert "nvidia.com/gpu" not in str(tmpl), "only workers take GPUs"
                continue
            workers += 1
            spec = tmpl["spec"]
            c = spec["containers"][0]
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
            assert c["image"].endswith("-cuda")
            assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert workers, f"{name} renders no worker pod"


def test_pods_run_as_non_root_with_requests_limits_and_scrape_annotations(renders):
    for name, docs in renders.items():
        for owner, tmpl in pod_templates(docs):
            spec, who = tmpl["spec"], f"{name}: {owner['kind']}/{owner['metadata']['name']}"
            assert spec["securityContext"]["runAsNonRoot"] is True, who
            assert spec.get("automountServiceAccountToken") is False, who
            ann = tmpl["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", who
            for c in spec["containers"]:
                res = c["resources"]
                assert {"cpu", "memory"} <= res["requests"].keys() and "memory" in res["limits"], who
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, who
