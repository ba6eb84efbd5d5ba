"""``MapHistory``: the manager's recently published shard maps, to send changes instead of
whole maps (``shardps.mapdelta``; docs/architecture.md, "Maps travel as changes").

It keeps the maps of the last ``MAP_HISTORY`` epochs and the diffs asked for recently, knows
which servers take changes (``accepts``: they registered with ``accepts_map_changes``), and
counts the bytes sent in each form (``shardps_map_sent_bytes_total``). Thread-safe.
"""

from __future__ import annotations

import threading

from shardps import mapdelta
from shardps.errors import FailedPrecondition
from shardps.metrics import ManagerMetrics
from shardps.protos.v1 import common_pb2 as pb
from shardps.protos.v1 import parameter_server_pb2 as ps
from shardps.rpc.status import translated

MAP_HISTORY = 8             # published maps kept to answer "changes since epoch E"


class MapHistory:
    def __init__(self, first: pb.ShardMap, metrics: ManagerMetrics):
        self.metrics = metrics
        self.accepts: set[str] = set()              # servers that apply InstallShardMap changes
        self._lock = threading.Lock()
        self._maps: dict[int, pb.ShardMap] = {first.epoch: first}
        self._diffs: dict[tuple[int, int], pb.ShardMap] = {}          # (from, to) -> changes

    def remember(self, msg: pb.ShardMap) -> None:
        """``msg`` was published; the oldest maps beyond ``MAP_HISTORY`` are forgotten."""
        with self._lock:
            self._maps[msg.epoch] = msg
            for epoch in sorted(self._maps)[:-MAP_HISTORY]:
                del self._maps[epoch]

    def changes_since(self, epoch: int, msg: pb.ShardMap) -> pb.ShardMap | None:
        """``msg`` as its changes since the published map of ``epoch`` (no changes at all
        when ``epoch`` is ``msg``'s), or None when that map is no longer kept (the caller
        sends the whole map). Diffs are cached."""
        if epoch == msg.epoch:
            return mapdelta.unchanged(msg)
        key = (epoch, msg.epoch)
        with self._lock:
            cached = self._diffs.get(key)
            old = self._maps.get(epoch) if cached is None else None
        if cached is not None:
            return cached
        if old is None or epoch > msg.epoch:
            return None
        out = mapdelta.diff(old, msg)
        with self._lock:
            self._diffs[key] = out
            for k in sorted(self._diffs)[:-2 * MAP_HISTORY]:
                del self._diffs[k]
        return out

    def install_requests(self, prev: pb.ShardMap, msg: pb.ShardMap, targets) -> tuple:
        """(InstallShardMap request of ``msg``'s changes since ``prev``, of the whole ``msg``);
        the first is the whole one when no target takes changes."""
        whole = ps.InstallShardMapRequest(map=msg)
        diff = self.changes_since(prev.epoch, msg) if any(s.name in self.accepts for s in targets) else None
        return (ps.InstallShardMapRequest(map=diff) if diff is not None else whole), whole

    def install(self, stub, address: str, request, whole, timeout: float, metadata) -> None:
        """Install ``request`` with ``stub`` (the server at ``address``); if it holds another
        epoch than the changes start from (FAILED_PRECONDITION), install ``whole``. Raises
        ShardpsError."""
        what = f"install on {address}"
        try:
            with translated(what):
                stub.InstallShardMap(request, timeout=timeout, metadata=metadata)
        except FailedPrecondition:
            if request is whole:
                raise
            request = whole
            with translated(what):
                stub.InstallShardMap(whole, timeout=timeout, metadata=metadata)
        self.count_sent(request.map)

    def count_sent(self, msg: pb.ShardMap) -> None:
        """Count a map sent to a server or a client (``shardps_map_sent_bytes``)."""
        self.metrics.map_bytes.labels("changes" if msg.HasField("changes") else "whole").inc(msg.ByteSize())
