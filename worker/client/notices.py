"""What the client tells its user about the job, decided purely from shard maps: a run that
uses a job which existed (continuing an earlier run's tables, or joining a running group),
and each loss of the job's blocks and what became of it. ``Admin`` logs them."""

from __future__ import annotations

import logging

from shardps.shardmap import LOSS_PENDING, LOSS_RESET, LOSS_RESTORED, ShardMapView
from shardps.status import restored_text

Notice = tuple[int, str]          # (logging level, message)


def existing_job(job: str, view: ShardMapView, step: int) -> Notice | None:
    """A run's ``create_job`` found ``job`` existing at ``step`` (the most steps a worker of
    it reported): INFO when its group has live workers (this one joins a running job),
    WARNING when it has tables or steps but no live worker (a rerun continues from its
    tables' values, and how to start fresh), else nothing."""
    tables = sorted(name for j, name in view.tables if j == job)
    group = view.groups.get(job)
    live = len(group.members) if group is not None else 0
    if live:
        return logging.INFO, (f"job {job!r} is running ({live} live workers, step {step}, tables: "
                              f"{', '.join(tables) or 'none yet'}): joining it")
    if tables or step:
        return logging.WARNING, (f"job {job!r} exists from an earlier run ({step} steps, tables: "
                                 f"{', '.join(tables) or 'none'}): this run continues from its tables' values. "
                                 f"To start fresh, end it first (shardps job end {job}, or client.end_job()) "
                                 f"or name another job")
    return None


def losses(job: str, old: ShardMapView, new: ShardMapView) -> list[Notice]:
    """Each loss of ``job``'s blocks, or its recovery, that ``new`` shows and ``old`` did not
    (a loss still being restored is told once it is settled)."""
    before = {(d.epoch, d.table, d.recovery) for d in (old.groups[job].data_loss if job in old.groups else ())}
    group = new.groups.get(job)
    out: list[Notice] = []
    for d in group.data_loss if group is not None else ():
        if (d.epoch, d.table, d.recovery) in before or d.recovery == LOSS_PENDING:
            continue
        what = (f"job {job!r}: {len(d.blocks)} block(s) of table {d.table!r} lost every replica "
                f"with server {d.server} at epoch {d.epoch} (step {d.lost_at_step})")
        if d.recovery == LOSS_RESTORED:
            t = new.tables.get((job, d.table))
            out.append((logging.WARNING, f"{what}; " + restored_text(d, t.spec.block_count if t is not None else 0)
                        .replace("JOB", job)))
        elif d.recovery == LOSS_RESET:
            out.append((logging.WARNING, f"{what}; reset: they start again from their initial values"))
        else:
            out.append((logging.ERROR, f"{what}: their values are gone ({d.detail or 'no checkpoint'}); calls "
                        f"touching them fail with DataLost until `shardps restore {job}` or "
                        f"`shardps reset-lost {job} {d.table}`"))
    return out
