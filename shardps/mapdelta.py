"""Shard maps sent as changes: what changed from one epoch's map to another's, and back.

A receiver that holds the map of epoch E (a server, a worker) is sent only what changed
since E (``ShardMap.changes``, see common.proto) instead of the whole map: a server's death
changes the placement of the blocks it held and one server entry, not the other million
blocks. A worker holds only its own job's tables (``only_job``), and its changes are
filtered the same way (``changes_only_job``).

* ``diff(old, new)`` -> a ``ShardMap`` whose ``changes`` turn ``old`` into ``new``;
* ``apply(base, changes)`` -> the whole new map; ``StaleBase`` when ``base`` is not the
  map the changes start from (the receiver then asks for a whole map);
* ``only_job(msg, job)`` / ``changes_only_job(changes, job)``: every server, and one job's
  tables and group.

The contract: ``apply(old, diff(old, new)) == new`` for maps in the manager's order (tables
sorted by job and name, groups by job; ``ManagerState.shard_map``), and
``apply(only_job(old, j), changes_only_job(diff(old, new), j)) == only_job(new, j)``. Block
replicas are indexes into the server list: when the list changes (a server registers or is
removed), the changes carry the new list's names and ``apply`` re-indexes the blocks that
did not change. Pure functions on protobuf messages; thread-safe.
"""

from __future__ import annotations

from shardps.errors import FailedPrecondition, InvalidArgument
from shardps.protos.v1 import common_pb2 as pb


class StaleBase(FailedPrecondition):
    """The changes start from another epoch than the map they were applied to."""


def _table_key(t: pb.TablePlacement) -> tuple[str, str]:
    return t.job, t.spec.name


def diff(old: pb.ShardMap, new: pb.ShardMap) -> pb.ShardMap:
    """A map of ``new``'s epoch carrying only what changed since ``old`` (both whole)."""
    out = pb.ShardMap(epoch=new.epoch, replication=new.replication)
    ch = out.changes
    ch.from_epoch = old.epoch
    old_names = [s.name for s in old.servers]
    new_names = [s.name for s in new.servers]
    if old_names != new_names:
        ch.server_names.extend(new_names)
    before = {s.name: s for s in old.servers}
    for s in new.servers:
        if before.get(s.name) != s:
            ch.servers.add().CopyFrom(s)
    position = {n: i for i, n in enumerate(new_names)}
    remap = [position.get(n, -1) for n in old_names]
    same_order = remap == list(range(len(old_names)))
    old_tables = {_table_key(t): t for t in old.tables}
    seen = set()
    for t in new.tables:
        key = _table_key(t)
        seen.add(key)
        o = old_tables.get(key)
        if o is None or o.spec != t.spec or o.config != t.config or len(o.blocks) != len(t.blocks):
            ch.tables.add(job=key[0], table=key[1]).whole.CopyFrom(t)
            continue
        if same_order:
            if o == t:
                continue
            changed = [i for i, (a, b) in enumerate(zip(o.blocks, t.blocks)) if a != b]
        else:
            changed = [i for i, (a, b) in enumerate(zip(o.blocks, t.blocks))
                       if a.since_epoch != b.since_epoch or a.fresh_epoch != b.fresh_epoch
                       or [remap[r] for r in a.replicas] != list(b.replicas)]
        if changed:
            tc = ch.tables.add(job=key[0], table=key[1])
            tc.block_indexes.extend(changed)
            for i in changed:
                tc.blocks.add().CopyFrom(t.blocks[i])
    for key in old_tables:
        if key not in seen:
            ch.tables.add(job=key[0], table=key[1], removed=True)
    old_groups = {g.job: g for g in old.groups}
    new_jobs = set()
    for g in new.groups:
        new_jobs.add(g.job)
        if old_groups.get(g.job) != g:
            ch.groups.add().CopyFrom(g)
    ch.removed_groups.extend(j for j in old_groups if j not in new_jobs)
    return out


def whole(base: pb.ShardMap, msg: pb.ShardMap) -> pb.ShardMap:
    """The whole map ``msg`` installs over ``base``: ``msg`` itself, or (a map carrying
    ``changes``) ``apply(base, msg)``."""
    return apply(base, msg) if msg.HasField("changes") else msg


def apply(base: pb.ShardMap, msg: pb.ShardMap) -> pb.ShardMap:
    """The whole map that ``msg`` (a map carrying ``changes``) describes, built on ``base``.
    Raises ``StaleBase`` when ``base`` is not the map of ``changes.from_epoch``, and
    ``InvalidArgument`` when the changes do not fit it (a block left pointing at a removed
    server, a changed block out of range)."""
    ch = msg.changes
    if base.epoch != ch.from_epoch:
        raise StaleBase(f"map changes from epoch {ch.from_epoch} cannot be applied to epoch "
                        f"{base.epoch}: ask for the whole map")
    out = pb.ShardMap(epoch=msg.epoch, replication=msg.replication)
    old_names = [s.name for s in base.servers]
    names = list(ch.server_names) or old_names
    entries = {s.name: s for s in base.servers}
    entries.update((s.name, s) for s in ch.servers)
    missing = [n for n in names if n not in entries]
    if missing:
        raise InvalidArgument(f"map changes name servers {missing} without their entries")
    out.servers.extend(entries[n] for n in names)
    position = {n: i for i, n in enumerate(names)}
    remap = [position.get(n, -1) for n in old_names]
    same_order = remap == list(range(len(old_names)))
    changed = {(tc.job, tc.table): tc for tc in ch.tables}
    tables = {_table_key(t): t for t in base.tables}
    keys = set(tables) | {k for k, tc in changed.items() if not tc.removed}
    for key in sorted(keys):
        tc = changed.get(key)
        if tc is not None and tc.removed:
            continue
        t = out.tables.add()
        if tc is not None and tc.HasField("whole"):
            t.CopyFrom(tc.whole)
            continue
        if key not in tables:
            raise InvalidArgument(f"map changes move blocks of table {key[1]!r} of job {key[0]!r}, "
                                  f"which the map of epoch {base.epoch} does not have")
        t.CopyFrom(tables[key])
        moved: dict[int, pb.BlockPlacement] = {}
        if tc is not None:
            if len(tc.block_indexes) != len(tc.blocks) or any(i >= len(t.blocks) for i in tc.block_indexes):
                raise InvalidArgument(f"map changes of {key[0]}/{key[1]}: block indexes and placements "
                                      f"do not match its {len(t.blocks)} blocks")
            moved = dict(zip(tc.block_indexes, tc.blocks))
        if not same_order:
            for i, b in enumerate(t.blocks):
                if i in moved:
                    continue
                reps = [remap[r] for r in b.replicas]
                if -1 in reps:
                    raise InvalidArgument(f"block {i} of {key[0]}/{key[1]} still lists a server that "
                                          f"the map of epoch {msg.epoch} no longer has")
                b.replicas[:] = reps
        for i, bp in moved.items():
            t.blocks[i].CopyFrom(bp)
    groups = {g.job: g for g in base.groups}
    for job in ch.removed_groups:
        groups.pop(job, None)
    groups.update((g.job, g) for g in ch.groups)
    out.groups.extend(groups[j] for j in sorted(groups))
    return out


def only_job(msg: pb.ShardMap, job: str) -> pb.ShardMap:
    """A whole map with every server and only ``job``'s tables and group."""
    out = pb.ShardMap(epoch=msg.epoch, replication=msg.replication, servers=msg.servers)
    out.tables.extend(t for t in msg.tables if t.job == job)
    out.groups.extend(g for g in msg.groups if g.job == job)
    return out


def changes_only_job(msg: pb.ShardMap, job: str) -> pb.ShardMap:
    """A map carrying changes, reduced to what a holder of ``only_job`` maps needs."""
    out = pb.ShardMap(epoch=msg.epoch, replication=msg.replication)
    ch, src = out.changes, msg.changes
    ch.from_epoch = src.from_epoch
    ch.server_names.extend(src.server_names)
    ch.servers.extend(src.servers)
    ch.tables.extend(tc for tc in src.tables if tc.job == job)
    ch.groups.extend(g for g in src.groups if g.job == job)
    ch.removed_groups.extend(j for j in src.removed_groups if j == job)
    return out


def unchanged(msg: pb.ShardMap) -> pb.ShardMap:
    """The answer to a receiver whose map is still current: no changes since its epoch."""
    out = pb.ShardMap(epoch=msg.epoch, replication=msg.replication)
    out.changes.from_epoch = msg.epoch
    return out


__all__ = ["StaleBase", "apply", "changes_only_job", "diff", "only_job", "unchanged"]
