"""What a push left on the servers, for tests: one of a ``PSModel``'s dense parameters (its
piece of its bucket's table), and whether every block's replicas agree."""

import numpy as np

from shardps.server.node.digest import held_digests
from shardps.worker.dense_buckets import bucket_of


def server_value(client, ps_model, name: str) -> np.ndarray:
    """Parameter ``name``'s values on the servers now, flat."""
    bucket = bucket_of(ps_model.buckets, name)
    assert bucket is not None, f"{name!r} is not one of the model's dense parameters"
    a, z = bucket.piece(name)
    return client.pull_dense(bucket.table).reshape(-1)[a:z]


def replicas_agree(cluster, job: str) -> int:
    """Every block of ``job``'s replicas holds bit-identical state on the in-process
    ``cluster``'s servers; returns how many blocks."""
    held: dict = {}
    for server in cluster.servers.values():
        for d in held_digests(server.node.table, job):
            held.setdefault(d.key, set()).add(d.digest)
    assert held and all(len(digests) == 1 for digests in held.values()), held
    return len(held)
