"""Job tokens: what they claim, the key ring that signs them, and the revocation floors.

A job token is ``<job>.<claims>.<mac>``::

    claims = <key id>-<generation>-<issued>-<expires>-<nonce>
    mac    = base64url(HMAC-SHA256(key, job + "." + claims))

* ``key id``: the first 8 hex digits of a SHA-256 of the signing key (``key_id``): it picks
  the key of the ring that verifies the token, and says nothing usable about the key.
* ``generation``: the job's token generation when the token was issued. The manager keeps
  one per job (``JobRecord.token_id``); ``RevokeJobTokens`` raises it, and every process
  refuses a token below its job's floor (``Revocations``). A job created again under an
  old name gets a generation above every token of the old job.
* ``issued`` / ``expires``: Unix seconds. A token is refused from ``expires`` on, by the
  verifying process's own clock (keep the cluster's clocks in step, e.g. NTP).

``KeyRing``: the keys a process accepts; the first one signs. ``KeyFile`` reads a ring from a
file (one key per line, the signing key first) and reads it again when the file changes, so
keys rotate without a restart (see SECURITY.md, "Rotating the token key"). ``TokenVerifier``
checks a token whole (format, key, signature, expiry, revocation) and, for a principal that
was verified earlier and is cached (the data plane checks credentials once per connection),
whether it is still current.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, Union

from shardps.errors import InvalidArgument, Unauthenticated

log = logging.getLogger("shardps.auth")

DEFAULT_TTL_SECONDS = 7 * 24 * 3600.0
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600.0
FORMAT = "<job>.<key id>-<generation>-<issued>-<expires>-<nonce>.<mac>"


def key_id(key: bytes) -> str:
    """The public name of a signing key (8 hex digits of a SHA-256 of it)."""
    return hashlib.sha256(b"shardps-token-key:" + key).hexdigest()[:8]


def _mac(key: bytes, text: str) -> str:
    digest = hmac.new(key, text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def when(unix_seconds: float) -> str:
    """``unix_seconds`` as an ISO 8601 UTC time, for messages."""
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Claims:
    """What a verified token grants: ``job``, until ``expires`` (Unix seconds), as long as
    ``generation`` is not below the job's floor and key ``key_id`` is accepted."""

    job: str
    key_id: str
    generation: int
    issued: int
    expires: int


class KeyRing:
    """Token keys: ``keys[0]`` signs new tokens, every key verifies. Immutable."""

    def __init__(self, keys: Sequence[bytes]):
        keys = tuple(bytes(k) for k in keys)
        if not keys or not all(keys):
            raise ValueError("a token key ring needs at least one key, and no empty one")
        self.keys = keys
        self.by_id = {key_id(k): k for k in keys}

    @classmethod
    def parse(cls, text: bytes, source: str = "the token key file") -> "KeyRing":
        """One key per line (blank lines and lines starting with ``#`` ignored), the signing
        key first. ValueError naming ``source`` when there is none."""
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith(b"#")]
        if not keys:
            raise ValueError(f"{source} holds no key: one key per line, the signing key first")
        return cls(keys)

    @staticmethod
    def empty(text: bytes) -> bool:
        """Whether ``text`` holds no key (job tokens off)."""
        return not any(k.strip() and not k.strip().startswith(b"#") for k in text.splitlines())

    @property
    def signing_id(self) -> str:
        return key_id(self.keys[0])

    def ring(self) -> "KeyRing":
        return self


class KeyFile:
    """The key ring in file ``path``, read again when the file changes (checked at most
    every ``interval`` seconds, on use). A file that cannot be read or holds no key keeps
    the ring in use (logged): a half-written file does not lock everyone out. The first read
    raises ValueError instead."""

    def __init__(self, path: str | os.PathLike, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.path = str(path)
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._ring = KeyRing.parse(self._read(), self.path)
        self._checked = clock()

    def _stat(self):
        st = os.stat(self.path)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def ring(self) -> KeyRing:
        now = self.clock()
        if now - self._checked < self.interval:
            return self._ring
        with self._lock:
            self._checked = now
            try:
                stamp = self._stat()
                if stamp != self._stamp:
                    ring = KeyRing.parse(self._read(), self.path)
                    if ring.by_id.keys() != self._ring.by_id.keys() or ring.signing_id != self._ring.signing_id:
                        log.info("token keys reloaded from %s: signing with %s, accepting %s", self.path,
                                 ring.signing_id, ", ".join(sorted(ring.by_id)))
                    self._ring, self._stamp = ring, stamp
            except (OSError, ValueError) as exc:
                log.warning("token keys: keeping the keys in use: %s", exc)
            return self._ring


Keys = Union[KeyRing, KeyFile]


def keys_from(source: "bytes | KeyRing | KeyFile | None") -> Keys | None:
    """A key source from a single key (bytes), a ring or a key file; None for none."""
    if source is None or source == b"":
        return None
    if isinstance(source, (bytes, bytearray)):
        return KeyRing([bytes(source)])
    return source


def check_ttl(ttl_seconds: float, default: float = DEFAULT_TTL_SECONDS) -> float:
    """The token lifetime to use: ``default`` for 0; InvalidArgument outside (0, 10 years]."""
    ttl = float(ttl_seconds) or default
    if not (0 < ttl <= MAX_TTL_SECONDS):
        raise InvalidArgument(f"token_ttl_seconds={ttl_seconds!r}: must be in (0, {MAX_TTL_SECONDS:g}] "
                              f"(0: the manager's default)")
    return ttl


def issue(keys: Keys, job: str, generation: int, ttl_seconds: float,
          now: float | None = None) -> tuple[str, float]:
    """A token for ``job`` of ``generation``, valid ``ttl_seconds`` from ``now``, signed with
    the ring's signing key; returns (token, expires)."""
    ring = keys.ring()
    issued = int(time.time() if now is None else now)
    expires = issued + max(1, int(round(ttl_seconds)))
    claims = f"{ring.signing_id}-{int(generation)}-{issued}-{expires}-{secrets.token_hex(8)}"
    body = f"{job}.{claims}"
    return f"{body}.{_mac(ring.keys[0], body)}", float(expires)


def _not_signed(why: str) -> Unauthenticated:
    return Unauthenticated(f"invalid token: not signed by this cluster's token key ({why}); "
                           f"expected {FORMAT}")


def parse(keys: Keys, token: str) -> Claims:
    """The claims of a token signed by a key of the ring (expiry and revocation unchecked);
    Unauthenticated otherwise."""
    try:
        job, claims, mac = token.rsplit(".", 2)
        kid, generation, issued, expires, _nonce = claims.split("-")
        values = int(generation), int(issued), int(expires)
    except ValueError:
        raise _not_signed("malformed") from None
    key = keys.ring().by_id.get(kid)
    if key is None:
        raise _not_signed(f"key {kid} is not among the keys this cluster accepts: retired, or "
                          f"another cluster's; ask the operator for a new token")
    if not hmac.compare_digest(mac, _mac(key, f"{job}.{claims}")):
        raise _not_signed("bad signature")
    return Claims(job, kid, *values)


class Revocations:
    """Per job, the lowest token generation still accepted (the revocation floor). Floors
    only rise. Thread-safe; reads take no lock."""

    def __init__(self, floors: Mapping[str, int] | None = None):
        self._floors: dict[str, int] = dict(floors or {})
        self._lock = threading.Lock()

    def floor(self, job: str) -> int:
        return self._floors.get(job, 0)

    def raise_floors(self, floors: Mapping[str, int] | Iterable[tuple[str, int]]) -> None:
        """Merge ``floors`` in: each job's floor becomes the larger of the two."""
        items = floors.items() if isinstance(floors, Mapping) else floors
        with self._lock:
            new = dict(self._floors)
            for job, floor in items:
                if int(floor) > new.get(job, 0):
                    new[job] = int(floor)
            self._floors = new          # one assignment: readers see the old or the new dict


class TokenVerifier:
    """Verifies job tokens against a key source, the revocation floors and a clock."""

    def __init__(self, keys: Keys, revocations: Revocations | None = None,
                 clock: Callable[[], float] = time.time):
        self.keys = keys
        self.revocations = revocations if revocations is not None else Revocations()
        self.clock = clock

    def verify(self, token: str) -> Claims:
        """The claims of a valid, current token; Unauthenticated naming what is wrong."""
        claims = parse(self.keys, token)
        self.check_current(claims)
        return claims

    def check_current(self, claims: Claims) -> None:
        """Unauthenticated if the token of ``claims`` expired, was revoked or its key was
        retired since it was verified."""
        now = self.clock()
        if now >= claims.expires:
            raise Unauthenticated(
                f"the token of job {claims.job!r} expired at {when(claims.expires)} "
                f"({now - claims.expires:.0f} s ago): ask the operator for a new one "
                f"(`shardps job revoke {claims.job}` issues one)")
        floor = self.revocations.floor(claims.job)
        if claims.generation < floor:
            raise Unauthenticated(
                f"the token of job {claims.job!r} was revoked (generation {claims.generation}, "
                f"the job accepts {floor} and later): use the token `shardps job revoke` printed")
        if claims.key_id not in self.keys.ring().by_id:
            raise _not_signed(f"key {claims.key_id} was retired; ask the operator for a new token")
