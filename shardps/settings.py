"""Settings: frozen dataclasses built once, at start-up, from flags and ``SHARDPS_*`` variables.

Every flag ``--some-flag`` has the environment variable ``SHARDPS_SOME_FLAG`` as its default
(flags win). Nothing else in shardps reads the environment. ``FLAGS`` lists every flag of every
subcommand, so that tests can check that manifests only use flags the binaries accept.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

MANAGER_PORT = 7070          # the manager's default port: also the port of an address given without one
SERVER_ROLES = frozenset({"manager", "server"})
ENV_SOURCES = "env_sources"  # the parsed args' record of the values taken from the environment
# what `shardps local --secure` tells clients to export besides SHARDPS_MANAGER (local.Secured)
CLIENT_VARIABLES = ("SHARDPS_TLS_CERT", "SHARDPS_TLS_KEY", "SHARDPS_TLS_CA", "SHARDPS_TOKEN_FILE")


def env_name(flag: str) -> str:
    return "SHARDPS_" + flag.lstrip("-").upper().replace("-", "_")


def _parse_bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


class FlagSet:
    """Adds flags whose defaults come from the environment, and records them: ``names`` the
    flags, and the parsed args' ``env_sources`` (``source_of``) the values that came from a
    variable, so that errors can name the variable."""

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str]):
        self.parser = parser
        self.environ = environ
        self.names: list[str] = []
        self.from_env: dict[str, tuple[str, Any]] = {}      # dest -> (variable, value)
        parser.set_defaults(**{ENV_SOURCES: self.from_env})

    def add(self, flag: str, default: Any, help: str, type=None, choices=None) -> None:
        env = env_name(flag)
        kind = type or (bool if isinstance(default, bool) else
                        int if isinstance(default, int) else
                        float if isinstance(default, float) else str)
        conv = _parse_bool if kind is bool else kind
        if env in self.environ:
            try:
                default = conv(self.environ[env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise SystemExit(f"shardps: environment variable {env}={self.environ[env]!r}: {exc}") from None
            self.from_env[flag.lstrip("-").replace("-", "_")] = (env, default)
        shown = "" if default in ("", None) else f" (default: {default})"
        if kind is bool:
            self.parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=default,
                                     metavar="BOOL", help=f"{help}{shown}; env {env}")
        else:
            self.parser.add_argument(flag, type=conv, default=default, choices=choices,
                                     help=f"{help}{shown}; env {env}")
        self.names.append(flag)


def add_common(fs: FlagSet) -> None:
    fs.add("--log-format", "human", "log lines: human or json", choices=["human", "json"])
    fs.add("--log-level", "info", "log level", choices=["debug", "info", "warning", "error"])
    fs.add("--tls-cert", "", "PEM certificate of this process (enables TLS)")
    fs.add("--tls-key", "", "PEM private key of --tls-cert")
    fs.add("--tls-ca", "", "PEM CA bundle that peers' certificates must chain to")
    fs.add("--tls-require-client-cert", False, "servers: require client certificates (mutual TLS)")
    fs.add("--token", "", "credential sent as 'authorization: Bearer ...' (admin or job token)")
    fs.add("--token-file", "", "file holding the token (a mounted Secret)")


def add_serving(fs: FlagSet, listen: str, metrics_port: int) -> None:
    fs.add("--listen", listen, "gRPC listen address host:port (port 0 picks a free port)")
    fs.add("--advertise", "", "address others use to reach this process, HOST:PORT, or HOST with the "
           "port bound (default: the listen address, with 0.0.0.0 replaced by this host's name)")
    fs.add("--metrics-port", metrics_port, "Prometheus /metrics port (0 picks a free one, -1 disables)")
    fs.add("--metrics-host", "0.0.0.0", "Prometheus /metrics bind address")
    fs.add("--health-port", -1, "with TLS on: plaintext gRPC health port for probes (-1: none)")
    fs.add("--ready-file", "", "write a JSON line with the bound addresses here once serving")
    fs.add("--threads", 32, "gRPC worker threads")
    fs.add("--admin-token", "", "admin token: required for admin RPCs when set")
    fs.add("--admin-token-file", "", "file holding --admin-token (a mounted Secret)")
    fs.add("--token-key", "", "secret that signs and verifies job tokens (enables per-job auth)")
    fs.add("--token-key-file", "", "file holding the token keys, one per line: the first signs new "
           "tokens, all verify; read again when it changes (key rotation without a restart)")


def _value_or_file(value: str, path: str) -> str:
    """A secret given inline (``--x``) or as a file holding it (``--x-file``); inline wins."""
    if value:
        return value
    if path:
        with open(path) as f:
            return f.read().strip()
    return ""


@dataclass(frozen=True)
class Common:
    log_format: str = "human"
    log_level: str = "info"
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_require_client_cert: bool = False
    token: str = ""
    token_file: str = ""

    def resolved_token(self) -> str:
        return _value_or_file(self.token, self.token_file)

    def check_files(self, role: str, sources: Mapping[str, str] | None = None) -> None:
        """SystemExit naming the setting (``--tls-cert /x`` or ``SHARDPS_TLS_CERT=/x (from the
        environment)``, per ``sources``: ``source_of``) and the file when ``role`` cannot use
        a file it names: one that cannot be read, or, for the manager and servers, a
        ``tls_cert`` that is not a server certificate. The manager sends no token: it ignores
        ``token_file``. Reads the files; called once, at start-up (``build``)."""
        sources = sources or {}
        names = ["tls_cert", "tls_key", "tls_ca"] + ([] if role == "manager" else ["token_file"])
        for name in names:
            path = getattr(self, name)
            if not path:
                continue
            problem = _unreadable(path)
            if not problem and name == "tls_cert" and role in SERVER_ROLES:
                problem = _not_a_server_certificate(path)
            if problem:
                raise SystemExit(_file_error(role, name, path, problem, sources.get(name, "")))


@dataclass(frozen=True)
class Serving:
    listen: str = "127.0.0.1:0"
    advertise: str = ""
    metrics_port: int = 0
    metrics_host: str = "0.0.0.0"
    health_port: int = -1
    ready_file: str = ""
    threads: int = 32
    admin_token: str = ""
    admin_token_file: str = ""
    token_key: str = ""
    token_key_file: str = ""

    def resolved_admin_token(self) -> str:
        return _value_or_file(self.admin_token, self.admin_token_file)

    def resolved_token_key(self) -> bytes:
        """The signing key (the key file's first key), or b"" when job tokens are off."""
        keys = self.token_keys()
        return keys.ring().keys[0] if keys is not None else b""

    def token_keys(self):
        """The token keys (``shardps.server.tokens``): a ``KeyRing`` of ``--token-key``, a
        ``KeyFile`` of ``--token-key-file`` (re-read when it changes), or None (neither, or
        an empty file). SystemExit
        naming the flag when the key or the file is unusable."""
        from shardps.server import tokens
        try:
            if self.token_key:
                return tokens.KeyRing([self.token_key.encode()])
            if self.token_key_file:
                with open(self.token_key_file, "rb") as f:
                    if tokens.KeyRing.empty(f.read()):
                        return None             # an empty Secret: job tokens off
                return tokens.KeyFile(self.token_key_file)
        except (OSError, ValueError) as exc:
            flag = "--token-key" if self.token_key else "--token-key-file"
            raise SystemExit(f"shardps: {flag}: {exc}") from None
        return None


@dataclass(frozen=True)
class ManagerProcessSettings:
    common: Common = field(default_factory=Common)
    serving: Serving = field(default_factory=lambda: Serving(listen=f"0.0.0.0:{MANAGER_PORT}", metrics_port=9100))
    state_dir: str = ""
    checkpoint_dir: str = ""
    replication: int = 2
    server_lease_seconds: float = 3.0
    worker_lease_seconds: float = 10.0
    token_ttl_seconds: float = 7 * 24 * 3600.0   # lifetime of the job tokens it issues
    # several replicas on one etcd (server/manager/replica.py); empty: one manager, state file
    etcd: str = ""                    # etcd endpoints, comma-separated http(s)://host:port
    etcd_prefix: str = "/shardps"     # the keys of this cluster: {prefix}/leader, {prefix}/state/
    leader_lease_seconds: int = 2     # a dead leader is replaced after about this long
    exit_when_job_ends: str = ""      # a cluster for one job: retire the servers and exit when it ends


@dataclass(frozen=True)
class ServerProcessSettings:
    common: Common = field(default_factory=Common)
    serving: Serving = field(default_factory=lambda: Serving(listen="0.0.0.0:7071", metrics_port=9101))
    name: str = ""
    manager: str = f"127.0.0.1:{MANAGER_PORT}"   # comma-separated: several replicas, the leader is followed
    max_request_bytes: int = 1 << 30
    max_rows: int = 4_000_000
    forward_timeout: float = 1.5
    cold_dir: str = ""                # the cold tiers of sparse tables (server/node/cold.py)
    data_plane_port: int = 0          # the data plane's port (0: any free one; -1: none, gRPC only)
    # per-job admission control (server/node/admission.py); 0: off
    job_max_requests_per_second: float = 0.0
    job_max_bytes_in_flight: int = 0
    # TEST-ONLY: a fixed defect the node re-introduces (shardps.tools.verify.defects); "" in production
    test_defect: str = ""


def _unreadable(path: str) -> str:
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if not os.access(path, os.R_OK):
        return "not readable by this process"
    return ""


def _not_a_server_certificate(path: str) -> str:
    """Why the PEM certificate at ``path`` cannot identify a server ("" when it can)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID
    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificates(f.read())[0]
    except ValueError:
        return "not a PEM certificate"
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return ""                                   # no restriction: any use
    if ExtendedKeyUsageOID.SERVER_AUTH in usage:
        return ""
    return ("a client certificate (its extended key usage has no serverAuth): peers refuse it "
            "as a server's")


def _file_error(role: str, name: str, path: str, problem: str, source: str) -> str:
    flag = "--" + name.replace("_", "-")
    given = source or f"{flag} {path}"
    text = f"shardps {role}: {given}: {problem}"
    variable = source.split("=", 1)[0]
    if source and role in SERVER_ROLES:
        return (f"{text}. The {role} takes {variable} as its own setting: if it is a client's (the "
                f"`export` line that `shardps local --secure` prints), unset the client's variables "
                f"where the {role} starts (`unset {' '.join(CLIENT_VARIABLES)}`), or give the "
                f"{role}'s own with {flag}")
    if source:
        return f"{text}: point {variable} at a readable file, or unset it"
    return f"{text}: give {flag} a readable file"


def source_of(args: argparse.Namespace) -> dict[str, str]:
    """Per setting that came from an environment variable (and was not overridden by its
    flag): ``SHARDPS_X=value (from the environment)``, for error messages."""
    out = {}
    for dest, (variable, value) in getattr(args, ENV_SOURCES, {}).items():
        if getattr(args, dest, None) == value:
            out[dest] = f"{variable}={value} (from the environment)"
    return out


def build(cls, args: argparse.Namespace, **nested):
    """Fill dataclass ``cls`` from parsed args (attribute names match field names). A
    ``Common`` is checked for the role ``args.command`` (``Common.check_files``): SystemExit
    naming the flag or variable when a file it names cannot be used."""
    values = dict(nested)
    for f in fields(cls):
        if f.name in values:
            continue
        if hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    built = cls(**values)
    if isinstance(built, Common):
        built.check_files(getattr(args, "command", "") or "", source_of(args))
    return built
