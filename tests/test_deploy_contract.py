"""The deployment files speak the binaries' language.

Every ``shardps`` process that docker-compose.yml, the Dockerfiles and the rendered Kubernetes
manifests start is parsed with the real command-line parser (``shardps.tools.cli.build_parser``) and
the environment it would get, and checked:

* every flag is one its subcommand accepts (``FLAGS``; no abbreviations) and parses;
* every ``SHARDPS_*`` variable is ``env_name(flag)`` of one of that subcommand's flags;
* every port the files declare (compose ports, EXPOSE, containerPort, Service targetPort,
  probes, health checks, scrape annotations, Prometheus targets) is a port the process
  binds: its --listen port, --metrics-port or --health-port;
* every manager address names a service that listens there.

The compose files also validate against the compose-spec schema.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from shardps.settings import env_name
from shardps.tools.cli import FLAGS, build_parser
from tests.test_k8s import pod_templates, rendered_sets

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.tls.yml")
DOCKERFILES = {"server": ROOT / "deploy/docker/server.Dockerfile",
               "worker": ROOT / "deploy/docker/worker.Dockerfile"}


# ---------------------------------------------------------------- the binaries' view
def accepted_env(subcommand: str) -> set[str]:
    build_parser({})
    return {env_name(f) for f in FLAGS[subcommand]}


def parse(argv: list[str], env: dict[str, str], where: str, check_env: bool = True):
    """``shardps ARGV`` parsed as the process would, with ``env`` as its environment. With
    ``check_env``, every SHARDPS_* variable of ``env`` must be one the subcommand reads (off for
    helper commands such as health checks, which share their container's environment)."""
    build_parser({})
    sub = argv[0]
    assert sub in FLAGS, f"{where}: `shardps {sub}` is not a subcommand ({sorted(FLAGS)})"
    tokens = argv[1:]
    if sub == "run":              # its flags (--x=y) end at the command it runs, itself checked
        cut = next((i for i, t in enumerate(tokens) if not t.startswith("-")), len(tokens))
        tokens, command = tokens[:cut], tokens[cut:]
        if command[:1] == ["shardps"]:
            parse(command[1:], env, f"{where} (the command it runs)", check_env)
    for token in tokens:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            assert flag in FLAGS[sub], f"{where}: `shardps {sub}` has no flag {flag}"
    unknown = {k for k in env if k.startswith("SHARDPS_")} - accepted_env(sub) if check_env else set()
    assert not unknown, f"{where}: `shardps {sub}` reads no variable {sorted(unknown)}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser(env).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `shardps {' '.join(argv)}` does not parse: {exc} {err.getvalue().strip()}")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@dataclass
class Process:
    """One shardps process a deployment file starts, and the ports the file says it has."""
    where: str
    argv: list[str]
    env: dict[str, str]
    declared_ports: set[int] = field(default_factory=set)     # published / exposed / containerPort
    grpc_checks: set[int] = field(default_factory=set)        # health checks and probes
    scrape_port: int | None = None
    commands: list[list[str]] = field(default_factory=list)   # other `shardps ...` it runs (hooks)

    def bound_ports(self) -> dict[str, int]:
        ns = parse(self.argv, self.env, self.where)
        ports = {}
        if getattr(ns, "listen", None):
            ports["listen"] = port_of(ns.listen)
        if getattr(ns, "metrics_port", -1) >= 0:
            ports["metrics"] = ns.metrics_port
        if getattr(ns, "health_port", -1) >= 0:
            ports["health"] = ns.health_port
        return ports

    def check(self) -> None:
        ns = parse(self.argv, self.env, self.where)
        bound = self.bound_ports()
        assert self.declared_ports <= set(bound.values()), \
            f"{self.where}: declares ports {sorted(self.declared_ports - set(bound.values()))} " \
            f"that `shardps {self.argv[0]}` does not bind ({bound})"
        grpc = {bound[k] for k in ("listen", "health") if k in bound}
        tls = bool(getattr(ns, "tls_cert", ""))
        if tls and "health" in bound:
            grpc = {bound["health"]}      # the main port speaks TLS: probes cannot use it
        assert self.grpc_checks <= grpc, \
            f"{self.where}: health checks on {sorted(self.grpc_checks)}, gRPC health is on {sorted(grpc)}"
        if self.scrape_port is not None:
            assert self.scrape_port == bound.get("metrics"), \
                f"{self.where}: scraped on {self.scrape_port}, metrics on {bound.get('metrics')}"
        if getattr(ns, "advertise", ""):
            assert port_of(ns.advertise) == bound["listen"], f"{self.where}: advertises {ns.advertise}"
        for cmd in self.commands:
            parse(cmd, self.env, f"{self.where} (runs `shardps {' '.join(cmd)}`)", check_env=False)


def shardps_commands(script: str) -> list[list[str]]:
    """The `shardps ...` invocations in a shell command line, with shell variables replaced
    by a placeholder that parses as a host:port or a name."""
    commands = []
    for part in re.split(r"\|\||&&|;|\|", script):
        words = shlex.split(part.replace(">/dev/null", "").replace("2>&1", ""))
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]   # VAR=value prefixes
        if "shardps" in words:
            args = words[words.index("shardps") + 1:]
            args = [re.sub(r"\$\{?([A-Z_]+)(:-([^}]*))?\}?", lambda m: m.group(3) or "placeholder:1", a)
                    for a in args]
            commands.append(args)
    return commands


# ---------------------------------------------------------------- Dockerfiles
def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def image_defaults(role: str) -> dict:
    """The final stage's ENV (SHARDPS_*), EXPOSE, HEALTHCHECK command and CMD."""
    ins = dockerfile_instructions(DOCKERFILES[role])
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    env, expose, health, cmd = {}, set(), None, None
    for word, rest in ins[last_from:]:
        if word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
        elif word == "EXPOSE":
            expose |= {int(p.split("/")[0]) for p in rest.split()}
        elif word == "HEALTHCHECK":
            health = json.loads(rest[rest.index("CMD") + 3:].strip())
        elif word == "CMD":
            cmd = json.loads(rest)
    return {"env": env, "expose": expose, "health": health, "cmd": cmd}


def health_argv(test: list[str]) -> list[str]:
    """`shardps health ...` argv of a Docker health check test (exec form or `sh -c`)."""
    if test[0] in ("CMD", "CMD-SHELL"):
        test = test[1:]
    if test[0] == "sh":
        cmds = shardps_commands(test[-1])
        assert len(cmds) == 1, test
        return cmds[0]
    assert test[0] == "shardps", test
    return test[1:]


def test_dockerfiles_speak_the_cli():
    for role in DOCKERFILES:
        d = image_defaults(role)
        assert d["cmd"] and d["cmd"][0] == role, f"{role} image: CMD {d['cmd']}"
        assert d["env"].get("SHARDPS_LOG_FORMAT") == "json"
        env = {k: v for k, v in d["env"].items() if k.startswith("SHARDPS_")}
        unknown = set(env) - accepted_env(role)
        assert not unknown, f"{role} image sets {unknown}"
        health = health_argv(d["health"])
        parse(health, env, f"{role} image HEALTHCHECK", check_env=False)
        assert health[0] == "health"
    # The server image runs the manager and server nodes on their default ports.
    server = image_defaults("server")
    defaults = Process("server image", ["manager"], {}).bound_ports() | {
        f"server-{k}": v for k, v in Process("server image", ["server"], {}).bound_ports().items()}
    assert server["expose"] <= set(defaults.values()), (server["expose"], defaults)
    assert port_of(health_argv(server["health"])[1]) == defaults["server-listen"]


# ---------------------------------------------------------------- compose
def compose_services(*names: str) -> dict:
    """Services of one compose file, or of a file and its overrides merged as compose does
    (environments merged key by key, other settings replaced)."""
    merged: dict = {}
    for name in names:
        for svc_name, svc in yaml.safe_load((ROOT / name).read_text())["services"].items():
            base = merged.setdefault(svc_name, {})
            for key, value in svc.items():
                if key == "environment" and isinstance(value, dict):
                    base["environment"] = {**compose_env(base), **{k: str(v) for k, v in value.items()}}
                else:
                    base[key] = value
    return merged


def compose_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_processes(files=("docker-compose.yml",)) -> dict[str, Process]:
    images = {role: image_defaults(role) for role in DOCKERFILES}
    procs = {}
    for name, svc in compose_services(*files).items():
        image = svc.get("image", "")
        role = next((r for r in DOCKERFILES if f"/{r}:" in image), None)
        if role is None:
            continue                                    # prometheus, grafana
        argv = list(svc.get("command") or images[role]["cmd"])
        env = {**images[role]["env"], **compose_env(svc)}
        proc = Process(f"docker-compose.yml: {name}", argv, env)
        for p in svc.get("ports", []):
            proc.declared_ports.add(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
        if (svc.get("healthcheck") or {}).get("disable"):
            procs[name] = proc                          # a one-shot command (job-init)
            continue
        test = (svc.get("healthcheck") or {}).get("test") or images[role]["health"]
        health = health_argv(test)
        proc.commands.append(health)
        if role == "server":                            # its own health; a worker checks its manager
            proc.grpc_checks.add(port_of(health[1]))
        procs[name] = proc
    return procs


def test_compose_processes_speak_the_cli():
    procs = compose_processes()
    assert {"manager", "s0", "s1", "s2", "worker"} <= procs.keys()
    for proc in procs.values():
        proc.check()


def test_tls_compose_override_speaks_the_cli():
    """docker-compose.tls.yml on top of docker-compose.yml: certificates, tokens, the
    plaintext health port and the job-init service all use flags and variables that exist."""
    procs = compose_processes(("docker-compose.yml", "docker-compose.tls.yml"))
    assert {"manager", "s0", "worker", "job-init"} <= procs.keys()
    # opt-in services (profiles: the hybrid demo) run on docker-compose.yml alone
    opt_in = {n for n, svc in compose_services("docker-compose.yml").items() if svc.get("profiles")}
    assert "hybrid" in opt_in
    for name, proc in procs.items():
        proc.check()
        assert name in opt_in or "SHARDPS_TLS_CA" in proc.env, proc.where


def test_compose_addresses_point_at_listening_services():
    procs = compose_processes()
    for name, proc in procs.items():
        ns = parse(proc.argv, proc.env, proc.where)
        manager = getattr(ns, "manager", None)
        if manager and proc.argv[0] != "manager":
            host = manager.rsplit(":", 1)[0]
            assert host in procs and procs[host].argv[0] == "manager", f"{name}: manager {manager}"
            assert port_of(manager) == procs[host].bound_ports()["listen"], f"{name}: manager {manager}"
        if getattr(ns, "advertise", ""):
            assert ns.advertise.rsplit(":", 1)[0] == name, f"{name} advertises {ns.advertise}"
        if proc.argv[0] == "server":
            assert ns.name == name, f"service {name} registers as {ns.name!r}: the ring name must match"
    # the GPU override changes workers only, and sets no setting the worker does not read
    for name, svc in compose_services("docker-compose.gpu.yml").items():
        assert name in procs
        assert set(compose_env(svc)) - {"NVIDIA_VISIBLE_DEVICES"} <= accepted_env(procs[name].argv[0])


def test_prometheus_targets_are_metrics_ports():
    config = ROOT / "deploy" / "prometheus" / "prometheus.yml"
    procs = compose_processes()
    metrics = {name: p.bound_ports().get("metrics") for name, p in procs.items()}
    seen = 0
    for job in yaml.safe_load(config.read_text())["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host = target.rsplit(":", 1)[0]
                if host in procs:
                    assert port_of(target) == metrics[host], f"{job['job_name']}: {target}"
                    seen += 1
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                assert sd["port"] == metrics[host], f"{job['job_name']}: {host}:{sd['port']}"
                seen += 1
    assert seen >= 5


def compose_named_volumes(*names: str) -> set[str]:
    """The named volumes the compose files declare (top-level ``volumes``), merged."""
    return {v for name in names for v in (yaml.safe_load((ROOT / name).read_text()).get("volumes") or {})}


def compose_mounts(svc: dict) -> dict[str, dict]:
    """A service's volumes by container path, each as the long syntax ({type, source, target})."""
    mounts = {}
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            parts = v.split(":")
            if len(parts) == 1:
                v = {"type": "volume", "target": parts[0]}         # anonymous
            else:
                kind = "bind" if parts[0].startswith((".", "/", "~", "$")) else "volume"
                v = {"type": kind, "source": parts[0], "target": parts[1]}
        mounts[v["target"].rstrip("/")] = v
    for t in svc.get("tmpfs") or []:
        mounts[t.split(":")[0].rstrip("/")] = {"type": "tmpfs", "target": t}
    return mounts


def runtime_owned_dirs(role: str) -> set[str]:
    """The folders the image creates for its runtime user (``install -d -o USER``), USER being
    the final stage's: Docker copies their ownership into a fresh named volume mounted there."""
    ins = dockerfile_instructions(DOCKERFILES[role])
    user = next(rest for word, rest in reversed(ins) if word == "USER").split(":")[0]
    owned = set()
    for word, rest in ins:
        if word == "RUN":
            for m in re.finditer(r"install -d -o (\S+)(?: -g \S+)? ([^;&|]+)", rest):
                if m[1] == user:
                    owned |= {d.rstrip("/") for d in m[2].split()}
    return owned


@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.tls.yml"),
                                   ("docker-compose.yml", "docker-compose.ha.yml"),
                                   ("docker-compose.yml", "docker-compose.gpu.yml")], ids=lambda f: "+".join(f))
def test_compose_servers_keep_their_cold_tier_on_a_volume_of_their_own(files):
    """Every server's --cold-dir (flag or SHARDPS_COLD_DIR) is a named volume of its own,
    not the container's writable layer nor a tmpfs (RAM, the very thing the tier saves), in
    a folder the image gives its user, so a fresh volume is writable."""
    services = compose_services(*files)
    declared = compose_named_volumes(*files)
    owned = runtime_owned_dirs("server")
    servers = {n: p for n, p in compose_processes(files).items() if p.argv[0] == "server"}
    assert {"s0", "s1", "s2"} <= servers.keys()
    sources = []
    for name, proc in servers.items():
        cold_dir = parse(proc.argv, proc.env, proc.where).cold_dir.rstrip("/")
        assert cold_dir, f"{proc.where}: no --cold-dir (the cold tier would go to the container's /tmp)"
        mount = compose_mounts(services[name]).get(cold_dir)
        assert mount is not None, f"{proc.where}: --cold-dir {cold_dir} is not a mounted volume"
        assert mount["type"] == "volume" and mount.get("source") in declared, \
            f"{proc.where}: {cold_dir} must be a named volume of the file, not {mount}"
        assert cold_dir in owned, f"server image: {cold_dir} is not created for its user ({sorted(owned)})"
        sources.append(mount["source"])
    assert len(sources) == len(set(sources)), f"servers share a cold-tier volume: {sources}"


@pytest.mark.slow          # a process (check-jsonschema)
def test_compose_files_match_the_compose_spec_schema():
    try:
        import check_jsonschema  # noqa: F401
    except ImportError:
        pytest.fail("the check-jsonschema package is missing: it belongs to the dev extra")
    out = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                          *COMPOSE_FILES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- Kubernetes
def _k8s_env(container: dict, pod_name: str, configmaps: dict[str, dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        env.update(configmaps[ref["configMapRef"]["name"]])
    for e in container.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
        else:
            src = e["valueFrom"]
            field_path = src.get("fieldRef", {}).get("fieldPath", "")
            if field_path == "metadata.name":
                value = pod_name
            elif "job-completion-index" in field_path:
                value = "0"
            elif "configMapKeyRef" in src:
                value = configmaps[src["configMapKeyRef"]["name"]][src["configMapKeyRef"]["key"]]
            else:
                value = "secret-or-field"
        env[e["name"]] = value
    return env


def k8s_processes(docs: list[dict], label: str) -> list[Process]:
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    procs = []
    for owner, tmpl in pod_templates(docs):
        pod = f"{owner['metadata']['name']}-0"
        for c in tmpl["spec"]["containers"]:
            if not c["image"].startswith("shardps/"):
                continue
            proc = Process(f"{label}: {owner['kind']}/{owner['metadata']['name']}", list(c["args"]),
                           _k8s_env(c, pod, configmaps))
            proc.declared_ports = {p["containerPort"] for p in c.get("ports", [])}
            proc.grpc_checks = {c[p]["grpc"]["port"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                                if p in c}
            port = tmpl["metadata"].get("annotations", {}).get("prometheus.io/port")
            proc.scrape_port = int(port) if port else None
            hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
            if hook:
                proc.commands += shardps_commands(hook[-1] if hook[0] == "sh" else shlex.join(hook))
            procs.append(proc)
    return procs


@pytest.mark.slow          # processes (kubectl kustomize)
def test_kubernetes_processes_speak_the_cli():
    checked = 0
    for label, docs in rendered_sets().items():
        for proc in k8s_processes(docs, label):
            proc.check()
            checked += 1
    assert checked >= 3 * len(rendered_sets())


@pytest.mark.slow          # processes (kubectl kustomize)
def test_kubernetes_services_and_addresses_match_the_pods():
    for label, docs in rendered_sets().items():
        templates = list(pod_templates(docs))
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        for svc in services.values():
            sel = svc["spec"]["selector"]
            pods = [t for _, t in templates if sel.items() <= t["metadata"]["labels"].items()]
            assert pods, f"{label}: Service {svc['metadata']['name']} selects no pod"
            for p in svc["spec"]["ports"]:
                for t in pods:
                    ports = {cp["name"]: cp["containerPort"] for c in t["spec"]["containers"] for cp in c["ports"]}
                    target = p["targetPort"]
                    assert target in ports or target in ports.values(), f"{label}: {svc['metadata']['name']} {p}"
                    if target in ports:
                        assert ports[target] == p["port"], f"{label}: {svc['metadata']['name']} {p}"
        managers = [p for p in k8s_processes(docs, label) if p.argv[0] == "manager"]
        manager_port = managers[0].bound_ports()["listen"]
        for proc in k8s_processes(docs, label):
            ns = parse(proc.argv, proc.env, proc.where)
            if proc.argv[0] != "manager":
                host, port = ns.manager.rsplit(":", 1)
                svc = services.get(host)
                assert svc is not None, f"{proc.where}: manager address {ns.manager} names no Service"
                assert int(port) in {p["port"] for p in svc["spec"]["ports"]} and int(port) == manager_port
            if proc.argv[0] == "server":
                host = ns.advertise.rsplit(":", 1)[0]
                pod, _, service = host.partition(".")
                assert pod == ns.name and service in services, f"{proc.where}: advertises {ns.advertise}"


@pytest.mark.slow          # processes (kubectl kustomize)
def test_kubernetes_servers_keep_their_cold_tier_on_a_bounded_emptydir():
    """Every server pod's --cold-dir (flag or SHARDPS_COLD_DIR) is where an emptyDir is
    mounted: node-local scratch disk (not medium Memory: RAM is what the tier saves) with a
    sizeLimit, in every overlay and component render."""
    checked = 0
    for label, docs in rendered_sets().items():
        for owner, tmpl in pod_templates(docs):
            volumes = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
            for c in tmpl["spec"]["containers"]:
                if not c["image"].startswith("shardps/") or c["args"][:1] != ["server"]:
                    continue
                where = f"{label}: {owner['kind']}/{owner['metadata']['name']}"
                configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
                env = _k8s_env(c, f"{owner['metadata']['name']}-0", configmaps)
                cold_dir = parse(list(c["args"]), env, where).cold_dir.rstrip("/")
                assert cold_dir, f"{where}: no --cold-dir (the cold tier would go to /tmp)"
                mounts = {m["mountPath"].rstrip("/"): m for m in c.get("volumeMounts", [])}
                assert cold_dir in mounts, f"{where}: nothing is mounted at --cold-dir {cold_dir}"
                mount = mounts[cold_dir]
                assert not mount.get("readOnly") and not mount.get("subPath"), f"{where}: {mount}"
                volume = volumes.get(mount["name"], {})
                assert "emptyDir" in volume, f"{where}: {cold_dir} must be an emptyDir, not {volume}"
                assert (volume["emptyDir"] or {}).get("medium", "") != "Memory", f"{where}: {volume}"
                assert (volume["emptyDir"] or {}).get("sizeLimit"), f"{where}: {volume} has no sizeLimit"
                checked += 1
    assert checked == len(rendered_sets()), checked
