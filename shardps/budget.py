"""Set a sparse table's lifecycle policy (memory budget, admission, TTL) from a client.

``set_lifecycle(client, table, LifecyclePolicy(...))`` sends the table's current config
with the new policy through the manager's ``UpdateTableConfig`` (the versioned config path):
it keeps the optimizer, takes effect on every server before it returns, and applies from the
next push of each block (one eviction pass). Use it right after ``create_sparse`` to set a
policy at creation, or at any time while training runs. See docs/memory-budget.md.

Client-side only (no server imports). ``PSClient.update_config`` does not carry the policy
yet; until it does, change optimizer settings with ``set_lifecycle`` too (``optimizer=``).
"""

from __future__ import annotations

import dataclasses

from shardps.convert import config_from_proto, config_to_proto
from shardps.protos.v1 import manager_pb2 as mg
from shardps.tables import LifecyclePolicy, OptimizerConfig, TableConfig


def set_lifecycle(client, table: str, policy: LifecyclePolicy, optimizer: OptimizerConfig | None = None,
                  timeout: float | None = None) -> TableConfig:
    """Install ``policy`` (and ``optimizer`` if given) on ``table`` of the client's job;
    returns the new config. InvalidArgument naming a bad value; NotFound for an unknown
    table."""
    policy.validate()
    admin = client._admin                   # PSClient's manager calls (worker/client/admin.py)
    current = admin.refresh_map().table(admin.job, table).config
    config = dataclasses.replace(current, lifecycle=policy, version=0,
                                 optimizer=optimizer if optimizer is not None else current.optimizer)
    config.validate()
    resp = admin.call("UpdateTableConfig", admin.stub.UpdateTableConfig, mg.UpdateTableConfigRequest(
        job=admin.job, table=table, config=config_to_proto(config)), timeout)
    admin.refresh_map()
    return config_from_proto(resp)
