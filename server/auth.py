"""Authentication and authorisation: the admin token and per-job tokens.

* The admin token (a shared secret, ``--admin-token``) authorises admin operations: creating
  and ending jobs, registering, draining and installing on servers, checkpoints and restores.
* A job token is issued by the manager when a job is created: ``<job>.<random>.<mac>`` where
  ``mac = HMAC-SHA256(token key, job + "." + random)``. Servers hold the same token key and
  verify job tokens themselves: no manager round trip per request.
* With neither an admin token nor a token key configured, authentication is off (a single
  trusted team on a private network); every call is allowed.

Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from shardps.errors import PermissionDenied, Unauthenticated

ADMIN, JOB, ANONYMOUS = "admin", "job", "anonymous"


@dataclass(frozen=True)
class Principal:
    role: str
    job: str = ""

    def may_use_job(self, job: str) -> bool:
        return self.role in (ADMIN, ANONYMOUS) or (self.role == JOB and self.job == job)


def _mac(key: bytes, text: str) -> str:
    digest = hmac.new(key, text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def issue_job_token(key: bytes, job: str) -> str:
    nonce = secrets.token_urlsafe(12)
    body = f"{job}.{nonce}"
    return f"{body}.{_mac(key, body)}"


def verify_job_token(key: bytes, token: str) -> str:
    """The job a token grants, or Unauthenticated."""
    try:
        job, nonce, mac = token.rsplit(".", 2)
    except ValueError:
        raise Unauthenticated("malformed token: expected <job>.<nonce>.<mac>") from None
    if not hmac.compare_digest(mac, _mac(key, f"{job}.{nonce}")):
        raise Unauthenticated("invalid token: not signed by this cluster's token key")
    return job


def bearer(metadata) -> str:
    for k, v in metadata or ():
        if k.lower() == "authorization":
            return v[7:].strip() if v.lower().startswith("bearer ") else v.strip()
    return ""


MANAGER_ADMIN = {"CreateJob", "EndJob", "DrainServer", "Checkpoint", "Restore", "RegisterServer",
                 "ServerHeartbeat", "GetClusterStatus"}
SERVER_ADMIN = {"Replicate", "InstallShardMap", "CopyBlocks", "LoadBlocks", "SnapshotBlocks",
                "HoldJob", "DropTables"}


class Authenticator:
    """``authenticate(full_method, context) -> Principal`` for status.bind."""

    def __init__(self, admin_token: str = "", token_key: bytes = b"", admin_methods=frozenset()):
        self.admin_token = admin_token
        self.token_key = token_key
        self.admin_methods = set(admin_methods)

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.token_key)

    def __call__(self, full_method: str, context) -> Principal:
        method = full_method.rsplit("/", 1)[-1]
        if not self.enabled:
            return Principal(ANONYMOUS)
        token = bearer(context.invocation_metadata())
        if not token:
            raise Unauthenticated(f"{method}: no token: send 'authorization: Bearer <token>' "
                                  f"(a job token, or the admin token)")
        if self.admin_token and hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return Principal(ADMIN)
        if not self.token_key:
            raise Unauthenticated(f"{method}: the token is not the admin token")
        job = verify_job_token(self.token_key, token)
        if method in self.admin_methods:
            raise PermissionDenied(f"{method} is an admin operation; a job token for {job!r} "
                                   f"cannot call it")
        return Principal(JOB, job)


def authenticator_for(serving, role: str) -> Authenticator | None:
    admin = serving.resolved_admin_token()
    key = serving.resolved_token_key()
    if not admin and not key:
        return None
    return Authenticator(admin, key, MANAGER_ADMIN if role == "manager" else SERVER_ADMIN)


def check_job(principal, job: str) -> None:
    """PermissionDenied unless ``principal`` may act on ``job``."""
    if principal is not None and not principal.may_use_job(job):
        raise PermissionDenied(f"this token grants job {principal.job!r}, not {job!r}")
