"""A ``PSModel`` step's data between the model and the client: the values a pull brought into
the dense parameters (``load_dense``), and the gradients of the dense parameters and of every
table's lookups into one push's requests (``gradient_requests``). On a GPU both cross the
host in one batch of copies (``DeviceCopies``)."""

from __future__ import annotations

import operator
from typing import Iterable

import numpy as np
import torch

from shardps.worker.dense_buckets import DenseBucket
from shardps.worker.device_copies import DeviceCopies
from shardps.worker.embeddings import PSRows
from shardps.worker.lookup_batch import LookupBatch

_PENDING = operator.attrgetter("stage.pending")


def load_dense(buckets: list[DenseBucket], values: list, copies: DeviceCopies) -> None:
    """Copy pulled values (``values[i]`` for ``buckets[i]``) into the dense parameters (on a
    GPU: through ``copies``, every bucket's values in one copy, without waiting for it)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, b in enumerate(buckets):
        by_device.setdefault(b.device, []).append(i)
    for device, members in by_device.items():
        arrays = [np.asarray(values[i]) for i in members]
        for i, on_device in zip(members, copies.to_device_all(arrays, device)):
            buckets[i].load(on_device)


def gradient_requests(buckets: list[DenseBucket], embeddings: Iterable[PSRows], copies: DeviceCopies,
                       batches: list[LookupBatch]) -> list[tuple]:
    """A step's push: each dense bucket's gradient (whole, or the pieces of its parameters
    that have one), then each table's gradient rows (one request per table: its lookups'
    and its parts of ``batches``, which this drains). The gradients reach the host in one
    ``copies.to_host_all``: on a GPU every table's copy is in flight together and the
    training thread waits once. A step whose tables were all looked up in one batch (the
    common case) takes their rows without Python per table."""
    dense = [(b, start, grad) for b in buckets for start, grad in b.gradients()]
    pending = list(filter(_PENDING, embeddings))
    if not pending and len(batches) == 1:
        got = batches.pop().gradients()
        on_host = copies.to_host_all([grad for _, _, grad in dense] + [grad for _, _, grad in got])
        return _dense_requests(dense, on_host) + [(table, ids, rows) for (table, ids, _), rows
                                                  in zip(got, on_host[len(dense):])]
    got_rows: list[tuple] = [(emb.table, emb.take_gradient_rows()) for emb in pending]
    if batches:
        got_rows = _with_batches(got_rows, batches)
    on_host = copies.to_host_all([grad for _, _, grad in dense] + [grad for _, got in got_rows for _, grad in got])
    requests = _dense_requests(dense, on_host)
    at = len(dense)
    for table, got in got_rows:
        if got:                  # a table looked up once: its rows as they are, else every lookup's together
            rows = on_host[at:at + len(got)]
            at += len(got)
            requests.append((table, got[0][0], rows[0]) if len(got) == 1 else
                            (table, np.concatenate([ids for ids, _ in got]), np.concatenate(rows)))
    return requests


def _dense_requests(dense: list[tuple], on_host: list[np.ndarray]) -> list[tuple]:
    """The push requests of the buckets' gradients ``dense`` ((bucket, start, gradient)),
    whose host arrays begin ``on_host``."""
    return [(b.table, grad) if start == 0 and grad.shape[0] == b.numel else (b.table, grad, start)
            for (b, start, _), grad in zip(dense, on_host)]


def _with_batches(tables: list[tuple], batches: list[LookupBatch]) -> list[tuple]:
    """``tables`` ((table, [(ids, rows) of each lookup])) with the tables' parts of
    ``batches`` (which this drains), each table once."""
    by_table: dict[str, list] = {}
    for table, got in tables:
        by_table.setdefault(table, []).extend(got)
    for batch in batches:
        for table, ids, grad in batch.gradients():
            by_table.setdefault(table, []).append((ids, grad))
    batches.clear()
    return list(by_table.items())
