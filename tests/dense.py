"""The servers' values of one of a ``PSModel``'s dense parameters (its piece of its bucket's
table), for tests that check what a push left on the servers."""

import numpy as np

from shardps.worker.dense_buckets import bucket_of


def server_value(client, ps_model, name: str) -> np.ndarray:
    """Parameter ``name``'s values on the servers now, flat."""
    bucket = bucket_of(ps_model.buckets, name)
    assert bucket is not None, f"{name!r} is not one of the model's dense parameters"
    a, z = bucket.piece(name)
    return client.pull_dense(bucket.table).reshape(-1)[a:z]
