"""``shardps dev-certs DIR``: a development CA and the certificates for mutual TLS.

    paths = make_dev_certs("certs")          # CA, server and client certificates and keys
    tls = TlsConfig.from_files(paths["server_cert"], paths["server_key"], paths["ca"],
                               require_client_cert=True)

What it writes into ``directory`` (PEM; keys are created with mode 0600, a new directory 0700):

* ``ca.pem`` / ``ca-key.pem``: a self-signed CA (``CA:TRUE, pathlen 0``). Keep the key to
  issue more certificates; every process needs only ``ca.pem`` (``--tls-ca``).
* ``server.pem`` / ``server-key.pem``: for the manager and every server node (``--tls-cert``,
  ``--tls-key``). Its subject alternative names are the given hosts (DNS names and IP
  addresses, never wildcards). It carries both the server and the client extended key
  usage, because server processes also dial the manager and each other with it.
* ``client.pem`` / ``client-key.pem``: for workers and the CLI when servers require client
  certificates (``--tls-require-client-cert``).

Development only: one key pair is shared by every server process, the CA key lies beside the
certificates, and nothing is ever revoked. Production deployments issue per-process
certificates from their own CA (cert-manager, Vault, ...) and mount them as Secrets.
Keys are ECDSA P-256, certificates SHA-256; the default validity is 365 days.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Loopback names, the service names of docker-compose.yml, and the names the Kubernetes base
# advertises (the manager's Service; the servers' StatefulSet pods under their headless
# Service). Other names: --host.
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", "manager", "s0", "s1", "s2", "shardps-manager",
                 "shardps-server-0.shardps-server", "shardps-server-1.shardps-server",
                 "shardps-server-2.shardps-server")

FILES = {
    "ca": "ca.pem",
    "ca_key": "ca-key.pem",
    "server_cert": "server.pem",
    "server_key": "server-key.pem",
    "client_cert": "client.pem",
    "client_key": "client-key.pem",
}


class DevCertsError(ValueError):
    """A host name that cannot go into a certificate, or files that already exist."""


def make_dev_certs(directory: str | os.PathLike, hosts: Iterable[str] = DEFAULT_HOSTS,
                   days: int = 365, overwrite: bool = False,
                   organisation: str = "shardps development") -> dict[str, Path]:
    """Write a development CA, a server and a client certificate into ``directory``.

    ``hosts`` become the server certificate's subject alternative names: IP addresses as IP
    entries, everything else as DNS entries (wildcards are refused). Returns the paths by
    role: ``ca``, ``ca_key``, ``server_cert``, ``server_key``, ``client_cert``,
    ``client_key``. Raises ``DevCertsError`` if a file exists and ``overwrite`` is false
    (a new CA would silently invalidate the certificates already handed out).
    """
    names = _subject_alt_names(hosts)
    if days < 1:
        raise DevCertsError(f"days={days}: certificates must be valid for at least one day")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = {role: out / name for role, name in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise DevCertsError(f"{', '.join(existing)} already exist: pass overwrite=True "
                            f"(shardps dev-certs --force) to replace them")

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{organisation} CA", organisation)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usages: list, alt_names: list | None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organisation)).issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
        )
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_key, server_cert = leaf("shardps-server",
                                   [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                                   names)
    client_key, client_cert = leaf("shardps-client", [ExtendedKeyUsageOID.CLIENT_AUTH], None)

    _write_key(paths["ca_key"], ca_key)
    _write_key(paths["server_key"], server_key)
    _write_key(paths["client_key"], client_key)
    _write_cert(paths["ca"], ca_cert)
    _write_cert(paths["server_cert"], server_cert)
    _write_cert(paths["client_cert"], client_cert)
    return paths


def _subject_alt_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in hosts:
        host = str(raw).strip()
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
            continue
        except ValueError:
            pass
        if "*" in host:
            raise DevCertsError(f"host {host!r}: wildcards are not issued; list each name")
        try:
            host.encode("ascii")
        except UnicodeEncodeError:
            raise DevCertsError(f"host {host!r}: use the ASCII (punycode) form of the name") from None
        if any(c.isspace() for c in host) or ":" in host or "/" in host:
            raise DevCertsError(f"host {host!r}: a DNS name or an IP address, without a port")
        names.append(x509.DNSName(host))
    if not names:
        raise DevCertsError("no host names: the server certificate needs at least one")
    return names


def _name(common_name: str, organisation: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=True, content_commitment=False,
                         key_encipherment=not cert_sign, data_encipherment=False,
                         key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
                         encipher_only=False, decipher_only=False)


# ``make_dev_secrets``: the files beside the certificates (``make secrets`` writes the same
# names into deploy/secrets/ for docker-compose.tls.yml)
SECRET_FILES = {"admin_token": "admin-token", "token_key": "token-key"}
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def make_dev_secrets(directory: str | os.PathLike, hosts: Iterable[str] = LOOPBACK_HOSTS,
                     days: int = 365) -> dict[str, Path]:
    """Everything a development cluster with mutual TLS and tokens needs, in ``directory``:
    the files of ``make_dev_certs`` plus ``admin-token`` (the admin token) and ``token-key``
    (the key that signs job tokens; a key file, see ``shardps.server.tokens.KeyFile``), both
    random (256 bits) and mode 0600. Files already there are kept when all of them are
    (a cluster restarted on the same directory keeps accepting the tokens it issued);
    otherwise all are written anew. Returns the paths by role (``make_dev_certs``'s roles,
    ``admin_token`` and ``token_key``)."""
    import secrets
    out = Path(directory)
    paths = {role: out / name for role, name in {**FILES, **SECRET_FILES}.items()}
    if all(p.exists() for p in paths.values()):
        return paths
    paths.update(make_dev_certs(out, hosts, days, overwrite=True))
    for role in SECRET_FILES:
        write_private(paths[role], secrets.token_urlsafe(32).encode())
    return paths


def write_private(path: str | Path, data: bytes) -> None:
    """Write a secret readable by its owner only."""
    # Created 0600 from the start (no window in which it is readable by others); chmod as
    # well in case the file existed with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_key(path: Path, key) -> None:
    write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(path, 0o644)


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``shardps dev-certs``."""
    parser.add_argument("directory", metavar="DIR", help="where to write the PEM files")
    parser.add_argument("--host", action="append", default=[], metavar="NAME",
                        help="another DNS name or IP address for the server certificate "
                             f"(repeatable; always included: {', '.join(DEFAULT_HOSTS)})")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    parser.add_argument("--force", action="store_true", help="replace existing files")


def run(args: argparse.Namespace) -> int:
    """Execute ``shardps dev-certs``; prints the flags to use. Returns the exit status."""
    try:
        paths = make_dev_certs(args.directory, tuple(DEFAULT_HOSTS) + tuple(args.host),
                               days=args.days, overwrite=args.force)
    except (DevCertsError, OSError) as exc:
        print(f"shardps dev-certs: {exc}", file=sys.stderr)
        return 2
    p = {k: str(v) for k, v in paths.items()}
    print(f"shardps dev-certs: wrote a development CA and certificates to {args.directory}\n"
          f"  manager and servers: --tls-cert {p['server_cert']} --tls-key {p['server_key']} "
          f"--tls-ca {p['ca']} --tls-require-client-cert\n"
          f"  workers and the CLI: --tls-cert {p['client_cert']} --tls-key {p['client_key']} "
          f"--tls-ca {p['ca']}\n"
          f"  keep {p['ca_key']} private; development only (see SECURITY.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardps dev-certs",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
