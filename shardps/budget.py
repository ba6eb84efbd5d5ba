"""A sparse table's lifecycle policy (memory budget, admission, TTL, cold tier), and how a
client sets it.

``set_lifecycle(client, table, LifecyclePolicy(...))`` sends the table's current config
with the new policy through the manager's ``UpdateTableConfig`` (the versioned config path):
it keeps the optimizer, takes effect on every server before it returns, and applies from the
next push of each block (one eviction pass). Use it right after ``create_sparse`` to set a
policy at creation, or at any time while training runs. See docs/memory-budget.md.

``PSClient.create_sparse(..., lifecycle=)`` and ``PSClient.update_config(..., lifecycle=)``
set it too. Shared by the client, the servers and the manager; no server imports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardps.errors import InvalidArgument

if TYPE_CHECKING:
    from shardps.tables import OptimizerConfig, TableConfig

MAX_ADMIT_AFTER = 255      # the admission sketch's counters are 8-bit


@dataclass(frozen=True)
class LifecyclePolicy:
    """How a sparse table lives within a memory budget (docs/memory-budget.md).

    * ``budget_bytes``: the most bytes one copy of the table may take (values, optimizer
      state, per-row bookkeeping, index, admission sketch); 0: unbounded. Each block may
      hold ``budget_bytes / num_blocks``: when a push leaves a block above its share, the
      block's least recently pushed rows (LRU on the job's clock, ties by id) are evicted
      down to ``LOW_WATERMARK`` of it.
    * ``admit_after`` (k): a row is stored only from its k-th push (counted in a per-block
      count-min sketch); before that, pulls return its initial value and its gradients are
      dropped (counted). 0 or 1: every pushed row is stored.
    * ``ttl_steps`` / ``ttl_seconds``: rows not pushed for more than this many steps of the
      job's clock (the pushes' clock) / seconds are evicted; 0: never.
    * ``cold``: the rows the budget evicts move to the server's cold tier on local disk (its
      ``--cold-dir``) with their optimizer state, are read there by pulls and come back to
      RAM on their next push, instead of starting again from their initial value. Needs
      ``budget_bytes``.

    A policy with every field 0 is disabled (the table behaves as without one).
    """

    budget_bytes: int = 0
    admit_after: int = 0
    ttl_steps: int = 0
    ttl_seconds: float = 0.0
    cold: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.budget_bytes or self.admit_after > 1 or self.ttl_steps or self.ttl_seconds)

    def validate(self) -> None:
        if not 0 <= self.budget_bytes < 1 << 62:
            raise InvalidArgument(f"lifecycle budget_bytes={self.budget_bytes}: must be >= 0 (0: unbounded)")
        if not 0 <= self.admit_after <= MAX_ADMIT_AFTER:
            raise InvalidArgument(f"lifecycle admit_after={self.admit_after}: must lie in "
                                  f"[0, {MAX_ADMIT_AFTER}] (0 or 1: admit at the first push)")
        if not 0 <= self.ttl_steps < 1 << 31:
            raise InvalidArgument(f"lifecycle ttl_steps={self.ttl_steps}: must lie in [0, 2**31) (0: no TTL)")
        if not (math.isfinite(self.ttl_seconds) and self.ttl_seconds >= 0):
            raise InvalidArgument(f"lifecycle ttl_seconds={self.ttl_seconds!r}: must be a finite "
                                  f"number >= 0 (0: no TTL)")
        if self.cold and not self.budget_bytes:
            raise InvalidArgument("lifecycle cold=True needs budget_bytes > 0 (the cold tier holds the rows "
                                  "the memory budget evicts)")




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
    return admin.set_config(table, config, timeout)
