"""Blocks that lost every replica: recording the loss, and serving them again once restored
from a checkpoint or reset. Functions of (``ManagerState``, arguments); no I/O.

A block whose last replica died is placed again, empty, and marked lost
(``BlockRecord.lost_epoch``, published as ``BlockPlacement.lost_epoch``): servers refuse
requests touching it, with UNAVAILABLE while its job's ``DataLossRecord`` is "pending" (the
manager is restoring it from the job's latest checkpoint: ``CheckpointCoordinator.recover_lost``)
and with DATA_LOSS once the manager gave up ("lost"), until it is restored or reset. Nothing
lost is ever re-created empty silently.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from shardps.server.manager.records import MAX_DATA_LOSS, DataLossRecord, TableRecord

if TYPE_CHECKING:
    from shardps.server.manager.state import ManagerState

log = logging.getLogger("shardps.manager")


def record_loss(st: ManagerState, lost: list[tuple[TableRecord, int]], server: str, epoch: int) -> None:
    """Note in each job which of its blocks (``lost``: (table, block index)) ``server``'s
    death lost, per table, with the group's step then (a ``DataLossRecord``, "pending" until
    the manager restores them or gives up), and log it naming every job and table."""
    by_table: dict[tuple[str, str], list[int]] = {}
    for t, i in lost:
        by_table.setdefault((t.job, t.spec.name), []).append(i)
    for (job, table), blocks in sorted(by_table.items()):
        rec = st.jobs.get(job)
        if rec is None:
            continue
        step = max([rec.step] + [m.step for m in rec.members.values()])
        rec.data_loss.append(DataLossRecord(epoch, server, table, sorted(blocks), step, "pending"))
        st.loss_counts[("lost", job)] += len(blocks)
        recovered = [d for d in rec.data_loss if d.recovery in ("restored", "reset")]
        while len(rec.data_loss) > MAX_DATA_LOSS and recovered:
            rec.data_loss.remove(recovered.pop(0))
    shown = "; ".join(f"{j}/{t} blocks {b[:8]}{' ...' if len(b) > 8 else ''}"
                      for (j, t), b in sorted(by_table.items())[:10])
    log.error("%d block(s) lost their last replica with %s at epoch %d (%s): their values are gone. "
              "The manager restores them from the job's latest checkpoint if it has one (requests "
              "touching them wait meanwhile); else those requests fail with DATA_LOSS until "
              "`shardps restore JOB` or `shardps reset-lost JOB TABLE`",
              sum(map(len, by_table.values())), server, epoch, shown)


def lost_blocks(st: ManagerState, job: str | None = None) -> dict[tuple[str, str], list[int]]:
    """(job, table) -> its blocks that lost every replica and are not recovered."""
    out: dict[tuple[str, str], list[int]] = {}
    for (j, name), t in st.tables.items():
        if job is None or j == job:
            lost = [i for i, b in enumerate(t.blocks) if b.lost_epoch]
            if lost:
                out[(j, name)] = lost
    return out


def recover_lost(st: ManagerState, job: str, table: str, blocks: Sequence[int], how: str,
                 checkpoint: str = "", checkpoint_step: int = 0) -> int:
    """Blocks of ``table`` are served again: "restored" from ``checkpoint`` (their values
    were loaded first) or "reset" (they start from their initial values). Their loss
    records say so. Returns how many were lost."""
    t = st.table(job, table)
    wanted = set(blocks)
    done = [i for i, b in enumerate(t.blocks) if b.lost_epoch and i in wanted]
    for i in done:
        t.blocks[i].lost_epoch = 0
    st.loss_counts[(how, job)] += len(done)
    for d in st.jobs[job].data_loss:
        if d.table == table and d.recovery in ("lost", "pending") and not any(
                t.blocks[i].lost_epoch for i in d.blocks if i < len(t.blocks)):
            d.recovery, d.checkpoint, d.checkpoint_step, d.detail = how, checkpoint, checkpoint_step, ""
    if done:
        st.bump()
    return len(done)

def give_up_recovery(st: ManagerState, job: str, detail: str) -> None:
    """The manager cannot restore ``job``'s pending lost blocks (``detail`` says why):
    from the next map on, requests touching them get DATA_LOSS instead of UNAVAILABLE."""
    changed = False
    for d in st.jobs[job].data_loss:
        if d.recovery == "pending":
            d.recovery, d.detail = "lost", detail
            changed = True
    if changed:
        st.bump()
