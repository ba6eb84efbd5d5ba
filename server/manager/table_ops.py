"""Creating tables and changing their configs: one table, or several of one job in one epoch
(a model's every parameter at once; a learning-rate schedule over all of them), all or none.

Functions of (``ManagerState``, arguments); no I/O. Every check runs before anything
changes; a creation bumps the epoch once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from shardps.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from shardps.server import optimizers
from shardps.server.manager import moves
from shardps.server.manager.records import BlockRecord, TableRecord, dense_bytes, describe_config, describe_spec
from shardps.server.placement import block_name
from shardps.tables import TableConfig, TableKind, TableSpec, default_sparse_blocks

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState


def create_tables(st: ManagerState, job: str, tables: Sequence[tuple[TableSpec, TableConfig]]
                  ) -> list[tuple[TableRecord, bool]]:
    """Create ``tables`` ((spec, config) each) of ``job`` in one epoch: per table (its
    record, whether it was created; an identical existing one is returned). All or
    none: every check runs before anything changes."""
    st.job(job)
    existing: list[TableRecord | None] = []
    seen: set[str] = set()
    for spec, config in tables:
        if spec.name in seen:
            raise InvalidArgument(f"table {spec.name!r} of job {job!r} is named twice in one call: "
                                  f"name each table once")
        seen.add(spec.name)
        existing.append(_existing(st, job, spec, config))
    new = [(spec, config) for (spec, config), old in zip(tables, existing) if old is None]
    if not new:
        return [(old, False) for old in existing if old is not None]
    nodes = st.candidates()
    if not nodes:
        raise FailedPrecondition("no live server to place the table on: start a server first")
    _check_quota(st, job, [spec for spec, _ in new], [config for _, config in new])
    what = (f"table {new[0][0].name!r}" if len(new) == 1 else f"{len(new)} tables") + f" of job {job!r}"
    moves.warn_if_short(st, what, nodes)
    epoch = st.bump()
    names = [block_name(job, spec.name, i) for spec, _ in new for i in range(spec.block_count)]
    placement = moves.place_new(st, names, nodes)
    for spec, config in new:
        blocks = [BlockRecord(placement[block_name(job, spec.name, i)], epoch, epoch)
                  for i in range(spec.block_count)]
        st.tables[(job, spec.name)] = TableRecord(job, spec, config.replace(version=1), blocks,
                                                  created=config.replace(version=0))
    return [(old, False) if old is not None else (st.tables[(job, spec.name)], True)
            for (spec, _), old in zip(tables, existing)]


def _existing(st: ManagerState, job: str, spec: TableSpec, config: TableConfig) -> TableRecord | None:
    """The table ``spec`` names if it exists as asked (None if it does not exist);
    AlreadyExists if it exists otherwise. Checks ``spec`` and ``config``."""
    spec.validate()
    config.validate()
    existing = st.tables.get((job, spec.name))
    if existing is None:
        return None
    if existing.spec != spec and not _blocks_left_to_the_table(existing.spec, spec):
        raise AlreadyExists(
            f"table {spec.name!r} of job {job!r} exists with another spec "
            f"({describe_spec(existing.spec)}; requested {describe_spec(spec)}): use "
            f"another name or delete it first")
    created = existing.created          # None: restored, or persisted before it was kept
    if created is not None and created != config.replace(version=0):
        raise AlreadyExists(
            f"table {spec.name!r} of job {job!r} exists, created with "
            f"{describe_config(created, config)}; this call asks for {describe_config(config, created)}. "
            f"A job keeps its tables across runs: change the settings with update_config, "
            f"delete the table (or end the job), or use a fresh job per run")
    return existing


def _blocks_left_to_the_table(existing: TableSpec, spec: TableSpec) -> bool:
    """Whether ``spec`` differs from the table's only in a sparse block count the caller left
    at its default (which the request cannot tell apart from choosing it): the table keeps
    the count it was created with, so a job made when the default was another (64 for every
    sparse table) is reused as it is. The count is layout, not values."""
    return (spec.kind is TableKind.SPARSE and spec.num_blocks == default_sparse_blocks(spec.num_rows, spec.dim)
            and dataclasses.replace(spec, num_blocks=existing.num_blocks) == existing)


def _check_quota(st: ManagerState, job: str, specs: list[TableSpec], configs: list[TableConfig]) -> None:
    quota = st.jobs[job].quota_bytes
    if not quota:
        return
    dense = sum(dense_bytes(t.spec, t.config) for (j, _), t in st.tables.items() if j == job)
    for spec, config in zip(specs, configs):
        need = dense_bytes(spec, config)
        if dense + need > quota:
            raise ResourceExhausted(
                f"job {job!r} storage quota_bytes={quota}: its dense tables hold {dense} bytes and "
                f"{spec.name!r} needs {need} more (values and optimizer state): raise the quota "
                f"or delete tables")
        dense += need


def update_table_configs(st: ManagerState, job: str, changes: Sequence[tuple[str, TableConfig, int]]
                         ) -> list[TableConfig]:
    """Replace the configs of tables of ``job`` ((name, config, expected_version) each; an
    expected version of 0 matches any) in one epoch; returns the new configs. All or none:
    every check runs before anything changes. The optimizer kind (and its state) cannot
    change."""
    seen: set[str] = set()
    records = []
    for name, config, expected_version in changes:
        if name in seen:
            raise InvalidArgument(f"table {name!r} of job {job!r} is named twice in one call: "
                                  f"name each table once")
        seen.add(name)
        rec = st.table(job, name)
        config.validate()
        if expected_version and expected_version != rec.config.version:
            raise FailedPrecondition(
                f"table {name!r} config is at version {rec.config.version}, not "
                f"{expected_version}: re-read it and retry")
        old, new = rec.config.optimizer, config.optimizer
        if old.kind is not new.kind or optimizers.state_names(old) != optimizers.state_names(new):
            raise InvalidArgument(
                f"table {name!r}: the optimizer cannot change from {old.kind.name}"
                f"(momentum={old.momentum}) to {new.kind.name}(momentum={new.momentum}) "
                f"while it holds state; change hyperparameters only")
        records.append((rec, config))
    if not records:
        return []
    for rec, config in records:
        rec.config = config.replace(version=rec.config.version + 1)
    st.bump()
    return [rec.config for rec, _ in records]
