"""The manager's state in etcd (``--etcd``): what ``StateFile`` is for one manager, for several.

``EtcdClient`` is a thin layer over etcd3gw (etcd's v3 JSON gateway over HTTP: no protobuf
of its own, so nothing pins the project's protobuf; docs/architecture.md, "Control plane"):
the calls the manager makes, failing over between the cluster's endpoints.

``EtcdStore`` keeps the state under a prefix, in the format of ``store.to_dict``, cut into
keys so that a change rewrites only what it touched:

* ``{prefix}/state/meta``: format, epoch, servers, jobs (and their worker groups)
* ``{prefix}/state/tables/{job}/{table}`` (both names URL-quoted): one table's spec, config
  and the replicas of each of its blocks

``save`` writes the keys that changed and deletes the keys of dropped tables in ONE etcd
transaction, guarded by the leader key (``guard``): it applies only while that key holds this
replica's identity, so a manager that lost its leadership (its lease expired, another was
elected) can never overwrite the state of the one that replaced it. A save that did not apply
raises ``NotLeader`` (an ``Unavailable``): the change was not acknowledged.

Limits: one table's placement is one key, bounded by etcd's ``--max-request-bytes`` (1.5 MiB
by default: about 35,000 blocks); one change touching more tables than etcd's
``--max-txn-ops`` (128 by default) is refused. The deployments raise both.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, Callable, Iterable
from urllib.parse import quote, urlsplit

from shardps.errors import Unavailable
from shardps.server.manager.records import ManagerSettings
from shardps.server.manager.state import ManagerState
from shardps.server.manager.store import FORMAT, from_dict, to_dict

log = logging.getLogger("shardps.manager")


class NotLeader(Unavailable):
    """This replica may not write: it is not (or no longer) the leader."""


def parse_endpoints(text: str | Iterable[str]) -> list[tuple[str, str, int]]:
    """``http://host:port,host:port,...`` as (protocol, host, port); port 2379 when absent."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        url = urlsplit(item if "://" in item else f"http://{item}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"etcd endpoint {item!r}: expected http(s)://host:port")
        out.append((url.scheme, url.hostname, url.port or 2379))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class EtcdClient:
    """The etcd calls of the manager, over etcd3gw, on the first endpoint that answers.

    Every method tries the current endpoint, then each other once, on a connection failure
    or timeout; then raises ``Unavailable``. Errors that etcd itself answered (a bad request)
    are raised at once. Thread-safe as far as ``requests`` sessions are (one per endpoint)."""

    def __init__(self, endpoints: str | Iterable[str], timeout: float = 2.0):
        import etcd3gw
        import requests
        self.endpoints = parse_endpoints(endpoints)
        self._clients = []
        for protocol, host, port in self.endpoints:
            session = requests.Session()
            session.trust_env = False         # never through an HTTP proxy of the environment
            self._clients.append(etcd3gw.Etcd3Client(host=host, port=port, protocol=protocol,
                                                     timeout=timeout, session=session))
        self._current = 0

    def _call(self, what: str, fn: Callable[[Any], Any]):
        from etcd3gw import exceptions
        last: Exception | None = None
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError) as exc:
                last = exc
                continue
            except exceptions.Etcd3Exception as exc:
                raise Unavailable(f"etcd {what}: {exc.detail_text or exc}") from None
            self._current = index
            return result
        where = ", ".join(f"{p}://{h}:{port}" for p, h, port in self.endpoints)
        raise Unavailable(f"etcd {what}: no endpoint answered ({where}): {last}")

    def post(self, path: str, body: dict) -> dict:
        """One call of the v3 gateway (``/kv/range``, ``/kv/txn``, ``/lease/grant``, ...)."""
        return self._call(path, lambda c: c.post(c.get_url(path), json=body))

    def get(self, key: str) -> str | None:
        """The value of ``key`` (None when absent)."""
        kvs = self.post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix`` and its value, at one revision."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        resp = self.post("/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in resp.get("kvs", [])}

    def txn(self, compare: list[dict], success: list[dict], failure: tuple[dict, ...] = ()) -> dict:
        """One transaction; the response (``succeeded`` is absent when the compare failed)."""
        return self.post("/kv/txn", {"compare": compare, "success": success, "failure": list(failure)})

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds (etcd may round it up to its minimum)."""
        return int(self.post("/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL, <= 0 when it has expired."""
        return int(self.post("/lease/keepalive", {"ID": lease}).get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted."""
        try:
            self.post("/kv/lease/revoke", {"ID": lease})
        except Unavailable as exc:
            log.debug("lease revoke: %s", exc.message)

    def close(self) -> None:
        for c in self._clients:
            c.session.close()


# ---------------------------------------------------------------------- compare and ops
def value_is(key: str, value: str) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


def absent(key: str) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}


def put(key: str, value: str, lease: int = 0) -> dict:
    body: dict = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = lease
    return {"request_put": body}


def delete(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


# ---------------------------------------------------------------------- the state
def to_entries(state: ManagerState, prefix: str) -> dict[str, str]:
    """The state as etcd keys and JSON values (see the module docstring)."""
    data = to_dict(state)
    tables = data.pop("tables")             # in the order of state.tables
    out = {meta_key(prefix): _json(data)}
    for (job, name), t in zip(state.tables, tables):
        out[table_key(prefix, job, name)] = _json(t)
    return out


def meta_key(prefix: str) -> str:
    return f"{prefix}/state/meta"


def table_key(prefix: str, job: str, table: str) -> str:
    return f"{prefix}/state/tables/{quote(job, safe='')}/{quote(table, safe='')}"


def _json(data) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def from_entries(entries: dict[str, str], prefix: str, settings: ManagerSettings, now: float) -> ManagerState:
    """Rebuild the state saved by ``to_entries`` (leases restart at ``now``)."""
    meta = json.loads(entries[meta_key(prefix)])
    if int(meta.get("format", 0)) != FORMAT:
        raise Unavailable(f"etcd state format {meta.get('format')}: this manager reads format {FORMAT}")
    tables_prefix = f"{prefix}/state/tables/"
    meta["tables"] = [json.loads(v) for k, v in sorted(entries.items()) if k.startswith(tables_prefix)]
    return from_dict(meta, settings, now)


class EtcdStore:
    """The manager's state in etcd: ``exists`` / ``load`` / ``save``, as ``StateFile``.

    ``guard`` (key, value): saves apply only while ``key`` holds ``value`` (the leader key
    and this replica's identity); None: unguarded (tests, tools). ``save`` raises
    ``NotLeader`` when the guard failed and ``Unavailable`` when etcd could not be reached;
    either way nothing of the change was written, and ``on_failure(error)`` is called first
    (the replica then resigns: its state in memory may be ahead of etcd's). ``grace``: the
    leases of servers and workers restart ``grace`` seconds after ``load``'s ``now``. Not
    thread-safe: the runtime saves under its lock."""

    def __init__(self, client: EtcdClient, prefix: str = "/shardps", guard: tuple[str, str] | None = None,
                 on_failure: Callable[[Exception], None] | None = None, grace: float = 0.0):
        self.client = client
        self.grace = grace
        self.prefix = prefix.rstrip("/")
        self.guard = guard
        self.on_failure = on_failure
        self._written: dict[str, str] = {}      # what etcd holds, as far as this store knows

    @property
    def path(self) -> str:
        """Where the state is (for log lines)."""
        ends = ",".join(f"{p}://{h}:{port}" for p, h, port in self.client.endpoints)
        return f"etcd {ends} {self.prefix}/state/"

    def exists(self) -> bool:
        return self.client.get(meta_key(self.prefix)) is not None

    def load(self, settings: ManagerSettings, now: float) -> ManagerState:
        entries = self.client.get_prefix(f"{self.prefix}/state/")
        self._written = dict(entries)
        return from_entries(entries, self.prefix, settings, now + self.grace)

    def save(self, state: ManagerState) -> None:
        """Write what changed since the last save or load, in one guarded transaction."""
        entries = to_entries(state, self.prefix)
        ops = [put(k, v) for k, v in entries.items() if self._written.get(k) != v]
        ops += [delete(k) for k in self._written if k not in entries]
        if not ops:
            return
        compare = [value_is(*self.guard)] if self.guard is not None else []
        try:
            resp = self.client.txn(compare, ops)
            if not resp.get("succeeded"):
                raise NotLeader("state not saved: this manager is no longer the leader "
                                "(the leader key changed)")
        except Unavailable as exc:
            if self.on_failure is not None:
                self.on_failure(exc)
            raise
        self._written = entries
