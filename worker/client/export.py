"""Whole tables out of the servers: a job's parameters as plain arrays (``PSClient.state_dict``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from shardps.tables import TableKind
from shardps.worker.client.fanout import RETRYABLE
from shardps.worker.routing import Piece

if TYPE_CHECKING:
    from shardps.worker.client.data import DataPath


def export(data: "DataPath", tables: list[str], timeout: float | None) -> dict[str, np.ndarray]:
    """``tables`` as plain arrays: a dense table in its shape under its name; a sparse
    one as ``{name}.ids`` and ``{name}.rows`` (see ``pull_stored``)."""
    out = {}
    for name in tables:
        t = data.maps.table(name)
        if t.spec.kind is TableKind.DENSE:
            values = np.empty(t.spec.numel, np.float32)
            data.pull([Piece(0, name, True, 0, t.spec.numel)], [values], timeout)
            out[name] = values.reshape(t.spec.shape)
        else:
            out[f"{name}.ids"], out[f"{name}.rows"] = pull_stored(data, name, timeout)
    return out

def pull_stored(data: "DataPath", table: str, timeout: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Every stored row of a sparse table as (ids ascending, rows ``[n, dim]``); the
    whole export restarts if the map changes under it."""
    t = data.maps.table(table)
    deadline = data.deadline(timeout)
    while True:
        try:
            res = data.pull([Piece(0, table, False, all_stored=True)], [None],
                            max(0.001, deadline - time.monotonic()))
            break
        except RETRYABLE:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
            data.maps.refresh_map()
    ids, rows = res.values[0]
    order = np.argsort(ids)
    return ids[order], rows.reshape(-1, t.spec.dim)[order]

