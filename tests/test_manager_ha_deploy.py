"""The manager-replica deployments: docker-compose.ha.yml on top of docker-compose.yml, and
the Kubernetes component ``manager-ha`` on the base (tests/test_deploy_contract.py and
tests/test_k8s.py check the files they list; these files are checked here, the same way).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.test_deploy_contract import compose_processes, compose_services, parse, port_of
from tests.test_k8s import KUBERNETES_VERSIONS, env_of, find, kubernetes_validate, render_with_components

ROOT = Path(__file__).resolve().parents[1]
HA_FILES = ("docker-compose.yml", "docker-compose.ha.yml")
MANAGER_SERVICE = "shardps.v1.ResourceManager"


# ---------------------------------------------------------------- compose
@pytest.mark.slow             # over a second: make test-fast stays under a minute
def test_ha_compose_processes_speak_the_cli_and_follow_the_three_managers():
    procs = compose_processes(HA_FILES)
    managers = [n for n in procs if procs[n].argv[0] == "manager"]
    assert sorted(managers) == ["manager", "manager-1", "manager-2"]
    for proc in procs.values():
        proc.check()
    etcd = compose_services(*HA_FILES)["etcd"]
    for name in managers:
        ns = parse(procs[name].argv, procs[name].env, name)
        assert ns.etcd == "http://etcd:2379" and not ns.state_dir, name
        assert ns.advertise == f"{name}:{port_of(ns.listen)}", name
    assert "--listen-client-urls=http://0.0.0.0:2379" in etcd["command"]
    for name, proc in procs.items():
        if proc.argv[0] in ("server", "worker"):
            ns = parse(proc.argv, proc.env, name)
            listed = ns.manager.split(",")
            assert sorted(a.rsplit(":", 1)[0] for a in listed) == sorted(managers), (name, ns.manager)
            for address in listed:
                host = address.rsplit(":", 1)[0]
                assert port_of(address) == procs[host].bound_ports()["listen"], (name, address)


@pytest.mark.slow          # a process (check-jsonschema)
def test_ha_compose_file_matches_the_compose_spec_schema():
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          "docker-compose.ha.yml"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- Kubernetes
@pytest.mark.slow          # kubectl kustomize
def test_manager_ha_component_renders_validates_and_wires_etcd():
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ha").mkdir()
        docs = render_with_components(Path(tmp) / "ha", ["manager-ha"])
        (Path(tmp) / "ha-tls").mkdir()
        with_tls = render_with_components(Path(tmp) / "ha-tls", ["manager-ha", "tls"])
    kv = kubernetes_validate()
    for doc in docs + with_tls:
        for version in KUBERNETES_VERSIONS:
            kv.validate(doc, version, strict=True)
    manager = find(docs, "StatefulSet", "shardps-manager")
    assert manager["spec"]["replicas"] == 3
    assert manager["spec"]["serviceName"] == "shardps-manager-replicas"
    assert find(docs, "Service", "shardps-manager-replicas")["spec"]["clusterIP"] == "None"
    c = manager["spec"]["template"]["spec"]["containers"][0]
    # the Service routes to the leader only; liveness checks the process
    assert c["readinessProbe"]["grpc"]["service"] == MANAGER_SERVICE
    assert "service" not in c["livenessProbe"]["grpc"] and "service" not in c["startupProbe"]["grpc"]
    env = env_of(c)
    assert list(env).index("POD_NAME") < list(env).index("SHARDPS_ADVERTISE")
    etcd = find(docs, "StatefulSet", "shardps-etcd")
    assert etcd["spec"]["replicas"] == 3
    members = {f"http://shardps-etcd-{i}.shardps-etcd:2379" for i in range(etcd["spec"]["replicas"])}
    assert set(env["SHARDPS_ETCD"]["value"].split(",")) == members
    ns = parse(["manager"], {k: v["value"] for k, v in env.items() if "value" in v and k.startswith("SHARDPS_")},
               "manager-ha")
    assert ns.etcd and ns.leader_lease_seconds == 2
    # under TLS the probes move to the plaintext health port and keep the service name
    c_tls = find(with_tls, "StatefulSet", "shardps-manager")["spec"]["template"]["spec"]["containers"][0]
    assert c_tls["readinessProbe"]["grpc"] == {"port": 7080, "service": MANAGER_SERVICE}
