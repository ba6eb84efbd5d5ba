"""Authentication and authorisation: the admin token and per-job tokens.

* The admin token (a shared secret, ``--admin-token``) authorises admin operations: creating
  and ending jobs, registering, draining and installing on servers, checkpoints and restores.
* A job token is issued by the manager when a job is created (and by ``RevokeJobTokens``):
  it names the job, the key that signed it, the job's token generation, when it was issued
  and when it expires (``shardps.server.tokens``). Servers hold the same keys and verify job
  tokens themselves: no manager round trip per request. They learn the manager's revocation
  floors with every heartbeat (``Authenticator.update_revocations``); the manager knows them
  at once.
* With neither an admin token nor a token key configured, authentication is off (a single
  trusted team on a private network); every call is allowed.

Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any, Mapping

from shardps import authz
from shardps.errors import PermissionDenied, Unauthenticated
from shardps.server import tokens

ADMIN, JOB, ANONYMOUS = authz.ROLE_ADMIN, authz.ROLE_JOB, authz.ROLE_ANONYMOUS


@dataclass(frozen=True)
class Principal:
    """Who calls: ``role`` (admin, job, anonymous, public) and, for a job token, its
    ``job``, its ``claims`` and the ``verifier`` that can tell whether it is still current
    (a principal may be cached: the data plane checks credentials once per connection)."""

    role: str
    job: str = ""
    claims: tokens.Claims | None = field(default=None, compare=False, repr=False)
    verifier: Any = field(default=None, compare=False, repr=False)

    def may_use_job(self, job: str) -> bool:
        return self.role in (ADMIN, ANONYMOUS) or (self.role == JOB and self.job == job)

    def check_current(self) -> None:
        """Unauthenticated if this job token expired, was revoked or lost its key since it
        was verified; nothing for other roles."""
        if self.claims is not None and self.verifier is not None:
            self.verifier.check_current(self.claims)


def issue_job_token(key, job: str, generation: int = 0,
                    ttl_seconds: float = tokens.DEFAULT_TTL_SECONDS, now: float | None = None) -> str:
    """A job token signed with ``key`` (bytes, a ``KeyRing`` or a ``KeyFile``)."""
    keys = tokens.keys_from(key)
    if keys is None:
        raise ValueError("no token key to sign with")
    return tokens.issue(keys, job, generation, ttl_seconds, now)[0]


def verify_job_token(key, token: str) -> str:
    """The job a valid, unexpired token grants (revocations unchecked), or Unauthenticated."""
    keys = tokens.keys_from(key)
    if keys is None:
        raise Unauthenticated("no token key: job tokens are off")
    return tokens.TokenVerifier(keys).verify(token).job


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
    what the table says (kept for callers that pass them; the table already covers them).

    ``token_key``: one key (bytes), a ``tokens.KeyRing`` or a ``tokens.KeyFile`` (rotation
    without a restart). ``revocations`` holds the per-job floors: the manager raises them
    itself, servers with ``update_revocations`` from each heartbeat."""

    def __init__(self, admin_token: str = "", token_key=b"", admin_methods=frozenset(),
                 revocations: tokens.Revocations | None = None):
        self.admin_token = admin_token
        self.keys = tokens.keys_from(token_key)
        self.revocations = revocations if revocations is not None else tokens.Revocations()
        self.verifier = tokens.TokenVerifier(self.keys, self.revocations) if self.keys else None
        self.admin_methods = set(admin_methods)

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.keys)

    def update_revocations(self, floors: Mapping[str, int]) -> None:
        """Raise the per-job token floors (the manager's, from a heartbeat response)."""
        self.revocations.raise_floors(floors)

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
        if self.verifier is None:
            raise Unauthenticated(f"{method}: the token is not the admin token")
        claims = self.verifier.verify(token)
        return Principal(JOB, claims.job, claims, self.verifier)


def authenticator_for(serving, role: str) -> Authenticator | None:
    admin = serving.resolved_admin_token()
    keys = serving.token_keys()
    if not admin and keys is None:
        return None
    return Authenticator(admin, keys, MANAGER_ADMIN if role == "manager" else SERVER_ADMIN)


def check_job(principal, job: str) -> None:
    """PermissionDenied unless ``principal`` may act on ``job``; Unauthenticated when its
    job token expired, was revoked or lost its key since it was verified (every data-plane
    request passes here with the principal its connection verified)."""
    if principal is None:
        return
    if not principal.may_use_job(job):
        raise PermissionDenied(f"this token grants job {principal.job!r}, not {job!r}")
    current = getattr(principal, "check_current", None)
    if current is not None:
        current()
