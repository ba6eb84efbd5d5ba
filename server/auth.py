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

from shardps import authz
from shardps.errors import PermissionDenied, Unauthenticated

ADMIN, JOB, ANONYMOUS = authz.ROLE_ADMIN, authz.ROLE_JOB, authz.ROLE_ANONYMOUS


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


# What a job token may not call, per service: read from the authorization table
# (``shardps.authz.TABLE``), kept for callers that name them.
MANAGER_ADMIN = authz.methods_with(authz.ADMIN, authz.INTERNAL, service=authz.RM_SERVICE)
SERVER_ADMIN = authz.methods_with(authz.ADMIN, authz.INTERNAL, service=authz.PS_SERVICE)


class Authenticator:
    """``authenticate(full_method, context) -> Principal`` for ``status.bind`` and the data
    plane: who the caller is (the admin token or a job token; Unauthenticated otherwise), then
    whether that principal may call the method at all (``authz.authorize``: the table; a
    method without an entry is refused). The job a request names is checked once the request
    is read (``authz.enforce``). ``admin_methods`` are refused to job tokens in addition to
    what the table says (kept for callers that pass them; the table already covers them)."""

    def __init__(self, admin_token: str = "", token_key: bytes = b"", admin_methods=frozenset()):
        self.admin_token = admin_token
        self.token_key = token_key
        self.admin_methods = set(admin_methods)

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.token_key)

    def __call__(self, full_method: str, context) -> Principal:
        principal = self.identify(full_method, context)
        method = full_method.rsplit("/", 1)[-1]
        if principal.role == JOB and method in self.admin_methods:
            raise PermissionDenied(f"{method} is an admin operation; a job token for "
                                   f"{principal.job!r} cannot call it")
        authz.authorize(full_method, principal)
        return principal

    def identify(self, full_method: str, context) -> Principal:
        """Who presents the call's token: anonymous when authentication is off, public for
        a PUBLIC method, else the admin or a job (Unauthenticated without a valid token)."""
        method = full_method.rsplit("/", 1)[-1]
        if not self.enabled:
            return Principal(ANONYMOUS)
        rule = authz.rule_for(full_method)
        if rule is not None and rule.access == authz.PUBLIC:
            return Principal(authz.ROLE_PUBLIC)
        token = bearer(context.invocation_metadata())
        if not token:
            raise Unauthenticated(f"{method}: no token: send 'authorization: Bearer <token>' "
                                  f"(a job token, or the admin token)")
        if self.admin_token and hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return Principal(ADMIN)
        if not self.token_key:
            raise Unauthenticated(f"{method}: the token is not the admin token")
        return Principal(JOB, verify_job_token(self.token_key, token))


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
