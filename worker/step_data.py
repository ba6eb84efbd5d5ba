"""A ``PSModel`` step's data between the model and the client: the values a pull brought into
the dense parameters (``load_dense``), and the gradients of the dense parameters and of every
table's lookups into one push's requests (``gradient_requests``). On a GPU both cross the
host in one batch of copies (``DeviceCopies``)."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from shardps.worker.dense_buckets import DenseBucket
from shardps.worker.device_copies import DeviceCopies
from shardps.worker.embeddings import PSRows
from shardps.worker.lookup_batch import LookupBatch


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
    training thread waits once."""
    dense = [(b, start, grad) for b in buckets for start, grad in b.gradients()]
    tables: list[tuple] = [(emb.table, emb.take_gradient_rows()) for emb in embeddings if emb.stage.pending]
    if batches:
        tables = _with_batches(tables, batches)
    on_host = copies.to_host_all([grad for _, _, grad in dense] + [grad for _, got in tables for _, grad in got])
    requests: list[tuple] = [(b.table, grad) if start == 0 and grad.shape[0] == b.numel else (b.table, grad, start)
                             for (b, start, _), grad in zip(dense, on_host)]
    at = len(dense)
    for table, got in tables:
        if got:                  # a table looked up once: its rows as they are, else every lookup's together
            rows = on_host[at:at + len(got)]
            at += len(got)
            requests.append((table, got[0][0], rows[0]) if len(got) == 1 else
                            (table, np.concatenate([ids for ids, _ in got]), np.concatenate(rows)))
    return requests


def _with_batches(tables: list[tuple], batches: list[LookupBatch]) -> list[tuple]:
    """``tables`` ((table, [(ids, rows) of each lookup])) with the tables' parts of
    ``batches`` (which this drains), each table once."""
    batched = [(t, [(ids, grad)]) for batch in batches for t, ids, grad in batch.gradients()]
    once = not tables and len(batches) == 1     # the common case: a batch holds each table once
    batches.clear()
    if once:
        return batched
    by_table: dict[str, list] = {}
    for table, got in tables + batched:
        by_table.setdefault(table, []).extend(got)
    return list(by_table.items())
