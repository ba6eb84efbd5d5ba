"""Checkpoint files: a consistent snapshot of one job, written and read without grpc.

Layout of a checkpoint directory ``<root>/<job>/<id>/`` (job and id follow the rules of
``shardps.names``, so the directory is always inside ``root`` and no two jobs share one)::

    manifest.json                 job, step, consistency, creation time, tables (spec and
                                  config as JSON), per block: metadata (version, exactly-once
                                  records, step counters, pending SYNC state) and its arrays,
                                  the sha256 of every file, the worker states by rank
    tables/<table>.safetensors    every block's arrays, named "<block>/<array>"
    workers/rank-<r>.bin          each worker's local state, opaque to the manager (shardps
                                  workers write ``shardps.worker.local_state``: safetensors
                                  plus JSON, never a pickle)

The directory is written under a temporary name and renamed when complete, so a
half-written checkpoint is never taken for a good one; ``latest(root, job)`` finds the newest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from google.protobuf.json_format import MessageToDict, ParseDict
from safetensors.numpy import load_file, save_file

from shardps import names
from shardps.blockops import ArrayInfo, BlockRef, BlockSnapshot, BlockState
from shardps.errors import FailedPrecondition, InvalidArgument, NotFound
from shardps.protos.v1 import common_pb2 as pb

FORMAT = 1


@dataclass
class Checkpoint:
    path: Path
    job: str
    step: int
    consistency: dict
    tables: list[dict]                          # {"spec": TableSpec dict, "config": TableConfig dict}
    blocks: dict[str, list[BlockSnapshot]]      # table -> snapshots in block order
    workers: dict[int, bytes] = field(default_factory=dict)

    def table_specs(self) -> list[tuple[pb.TableSpec, pb.TableConfig]]:
        return [(ParseDict(t["spec"], pb.TableSpec()), ParseDict(t["config"], pb.TableConfig()))
                for t in self.tables]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checkpoint(root: str | Path, job: str, checkpoint_id: str, step: int, consistency: pb.Consistency,
                     tables: list[pb.TablePlacement], snapshots: dict[str, list[BlockSnapshot]],
                     workers: dict[int, bytes]) -> Path:
    """Write a checkpoint atomically; returns its directory ``<root>/<job>/<id>``.
    InvalidArgument if ``job`` or ``checkpoint_id`` break their rules (``shardps.names``)."""
    names.check(names.JOB, job, "job")
    names.check(names.CHECKPOINT_ID, checkpoint_id, "checkpoint_id")
    root = Path(root).resolve()
    final = root / job / checkpoint_id
    if final.resolve().parent != root / job:        # the names' rules make this unreachable
        raise InvalidArgument(f"checkpoint {job}/{checkpoint_id} would leave the root {root}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = root / job / f".{checkpoint_id}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    (tmp / "workers").mkdir()
    manifest = {"format": FORMAT, "job": job, "id": checkpoint_id, "step": step,
                "created": time.time(), "consistency": MessageToDict(consistency),
                "tables": [], "files": {}, "workers": {}}
    for t in tables:
        name = t.spec.name
        arrays: dict[str, np.ndarray] = {}
        blocks_meta = []
        for snap in sorted(snapshots.get(name, []), key=lambda s: s.header.ref.block):
            b = snap.header.ref.block
            array_names = []
            for info, arr in zip(snap.header.arrays, snap.arrays):
                arrays[f"{b}/{info.name}"] = np.ascontiguousarray(arr)
                array_names.append(info.name)
            blocks_meta.append({"block": b, "version": snap.header.version,
                                "initialized": snap.header.initialized,
                                "metadata": snap.header.metadata.decode(), "arrays": array_names})
        if len(blocks_meta) != len(t.blocks):
            raise FailedPrecondition(f"checkpoint of {job}/{name}: got {len(blocks_meta)} of "
                                     f"{len(t.blocks)} blocks")
        rel = f"tables/{_safe(name)}.safetensors"
        save_file(arrays or {"_empty": np.zeros(0, np.float32)}, str(tmp / rel))
        manifest["tables"].append({"spec": MessageToDict(t.spec), "config": MessageToDict(t.config),
                                   "file": rel, "blocks": blocks_meta})
        manifest["files"][rel] = _sha256(tmp / rel)
    for rank, state in sorted(workers.items()):
        rel = f"workers/rank-{rank}.bin"
        (tmp / rel).write_bytes(state)
        manifest["workers"][str(rank)] = rel
        manifest["files"][rel] = _sha256(tmp / rel)
    with open(tmp / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def _safe(name: str) -> str:
    return name.replace("/", "__")


def read_checkpoint(path: str | Path, verify: bool = True) -> Checkpoint:
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise NotFound(f"no checkpoint at {path} (manifest.json missing)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise InvalidArgument(f"checkpoint {path}: format {manifest.get('format')} is not {FORMAT}")
    if verify:
        for rel, digest in manifest["files"].items():
            if _sha256(path / rel) != digest:
                raise FailedPrecondition(f"checkpoint {path}: {rel} is corrupt (sha256 mismatch)")
    blocks: dict[str, list[BlockSnapshot]] = {}
    for t in manifest["tables"]:
        name = t["spec"]["name"]
        arrays = load_file(str(path / t["file"]))
        snaps = []
        for bm in t["blocks"]:
            header = BlockState(BlockRef(manifest["job"], name, int(bm["block"])), int(bm["version"]),
                                bool(bm["initialized"]), metadata=bm["metadata"].encode())
            arrs = []
            for a in bm["arrays"]:
                arr = arrays[f"{bm['block']}/{a}"]
                dtype = "<i8" if arr.dtype.kind in "iu" else "<f4"
                header.arrays.append(ArrayInfo(a, dtype, tuple(arr.shape)))
                arrs.append(arr.astype(dtype))
            snaps.append(BlockSnapshot(header, arrs))
        blocks[name] = snaps
    workers = {int(r): (path / rel).read_bytes() for r, rel in manifest["workers"].items()}
    return Checkpoint(path, manifest["job"], int(manifest["step"]), manifest["consistency"],
                      manifest["tables"], blocks, workers)


def latest(root: str | Path, job: str) -> Path | None:
    """The newest complete checkpoint of ``job`` under ``root``: in ``<root>/<job>/``, or in
    the flat layout of earlier versions (``<root>/<job>-<id>``), whose manifest must name
    ``job`` (job "a" would otherwise find job "a-b"'s)."""
    names.check(names.JOB, job, "job")
    root = Path(root)
    candidates: list[Path] = []
    if (root / job).is_dir():
        candidates += (d for d in (root / job).iterdir() if not d.name.startswith("."))
    if root.is_dir():
        candidates += (d for d in root.iterdir() if d.name.startswith(f"{job}-"))
    found = []
    for d in candidates:
        try:
            manifest = json.loads((d / "manifest.json").read_text())
            if manifest["job"] == job:
                found.append((manifest["created"], str(d), d))
        except (OSError, ValueError, KeyError, TypeError):
            continue                    # not a complete checkpoint (or a temporary one)
    return max(found)[2] if found else None
