"""Where the manager's state is persisted: one JSON file (``StateFile``, one manager: the
embedded default of ``make run`` and ``shardps local``), or etcd (``etcd_store.EtcdStore``,
several replicas); both are a ``StateStore``.

``to_dict`` / ``from_dict`` are the format (pure); ``StateFile`` does the file I/O. Fields
marked "not persisted" in ``records.py`` (heartbeats, statistics) are not written: leases
restart when the state is loaded.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Protocol

from shardps.protos.v1 import common_pb2 as pb
from shardps.rpc.convert import config_from_proto, config_to_proto, spec_from_proto, spec_to_proto
from shardps.server.manager.records import (
    BlockRecord,
    DataLossRecord,
    JobRecord,
    ManagerSettings,
    MemberRecord,
    ServerRecord,
    ServerState,
    TableRecord,
)
from shardps.server.manager.state import ManagerState
from shardps.tables import Consistency

FORMAT = 1


def to_dict(state: ManagerState) -> dict:
    return {
        "format": FORMAT,
        "epoch": state.epoch,
        "servers": [{"name": s.name, "address": s.address, "metrics_address": s.metrics_address,
                     "incarnation": s.incarnation, "boot_id": s.boot_id, "state": s.state.name,
                     "retired": s.retired}
                    for s in state.servers.values()],
        "jobs": [{"name": j.name, "consistency": j.consistency.name, "staleness": j.staleness,
                  "quota_bytes": j.quota_bytes, "token_id": j.token_id,
                  "membership_version": j.membership_version, "peak_members": j.peak_members, "step": j.step,
                  "restored_path": j.restored_path, "restored_step": j.restored_step,
                  "restore_pending": j.restore_pending,
                  "departed": j.departed,
                  "members": [_member(m) for m in j.members.values()],
                  "clients": [_member(m) for m in j.clients.values()],
                  "data_loss": [dataclasses.asdict(d) for d in j.data_loss]}
                 for j in state.jobs.values()],
        "tables": [{"job": t.job,
                    "spec": _b64(spec_to_proto(t.spec)),
                    "config": _b64(config_to_proto(t.config)),
                    **({"created": _b64(config_to_proto(t.created))} if t.created is not None else {}),
                    "blocks": [[b.replicas, b.since_epoch, b.fresh_epoch] + ([b.lost_epoch] if b.lost_epoch else [])
                               for b in t.blocks]}
                   for t in state.tables.values()],
    }


def _member(m: MemberRecord) -> dict:
    return {"rank": m.rank, "session": m.session, "incarnation": m.incarnation, "name": m.name}


def from_dict(data: dict, settings: ManagerSettings, now: float) -> ManagerState:
    """Rebuild persisted state. Leases restart at ``now``: every server and worker gets a
    full lease to reach the restarted manager before it is declared dead."""
    state = ManagerState(settings)
    state.epoch = int(data["epoch"])
    for s in data["servers"]:
        state.servers[s["name"]] = ServerRecord(
            s["name"], s["address"], s["metrics_address"], int(s["incarnation"]), s["boot_id"],
            ServerState[s["state"]], retired=bool(s.get("retired")), last_heartbeat=now)
    for j in data["jobs"]:
        job = JobRecord(j["name"], Consistency[j["consistency"]], int(j["staleness"]),
                        int(j["quota_bytes"]), j["token_id"],
                        membership_version=int(j["membership_version"]),
                        peak_members=int(j.get("peak_members", 0)), step=int(j.get("step", 0)),
                        restored_path=j.get("restored_path", ""),
                        restored_step=int(j.get("restored_step", 0)),
                        restore_pending=list(j.get("restore_pending", [])),
                        departed={k: list(v) for k, v in j.get("departed", {}).items()})
        for m in j["members"]:
            job.members[m["session"]] = MemberRecord(m["rank"], m["session"], m["incarnation"],
                                                     m["name"], last_heartbeat=now)
        for m in j.get("clients", []):
            job.clients[m["session"]] = MemberRecord(m["rank"], m["session"], m["incarnation"],
                                                     m["name"], last_heartbeat=now)
        job.data_loss = [DataLossRecord(**d) for d in j.get("data_loss", [])]
        state.jobs[job.name] = job
    for t in data["tables"]:
        spec = spec_from_proto(_unb64(pb.TableSpec, t["spec"]))
        config = config_from_proto(_unb64(pb.TableConfig, t["config"]))
        blocks = [BlockRecord(list(b[0]), int(b[1]), int(b[2]), int(b[3]) if len(b) > 3 else 0)
                  for b in t["blocks"]]
        created = config_from_proto(_unb64(pb.TableConfig, t["created"])) if "created" in t else None
        state.tables[(t["job"], spec.name)] = TableRecord(t["job"], spec, config, blocks, created)
    return state


class StateStore(Protocol):
    """What ``ManagerRuntime`` persists its state through: ``save`` after every change
    (raising when it did not persist: the change is then not acknowledged), ``load`` once at
    the start, when ``exists``."""

    @property
    def path(self) -> object: ...

    def exists(self) -> bool: ...

    def save(self, state: ManagerState) -> None: ...

    def load(self, settings: ManagerSettings, now: float) -> ManagerState: ...


class StateFile:
    """The state in one JSON file, replaced atomically on every save. Not thread-safe: the
    runtime saves under its lock."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, state: ManagerState) -> None:
        """Write the state atomically (temporary file, fsync, rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as f:
            json.dump(to_dict(state), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self, settings: ManagerSettings, now: float) -> ManagerState:
        with open(self.path) as f:
            return from_dict(json.load(f), settings, now)


def _b64(msg) -> str:
    return base64.b64encode(msg.SerializeToString()).decode()


def _unb64(cls, text: str):
    return cls.FromString(base64.b64decode(text))
