"""The fault-schedule verifier's short form (``shardps.tools.verify``): fixed seeds on real
processes, judged by its checker; and proof that it catches bugs: with the test-only switch
``SHARDPS_TEST_REINTRODUCE_DEFECT`` (``tools/verify/defects.py``) the servers re-introduce
defect 1 or 2 of issue 13, and the same short form fails, within its time.

``python -m shardps.tools.verify --short`` prints the same runs as a table; ``make torture`` runs
schedules for 30 minutes.
"""

from __future__ import annotations

import time

import pytest

from shardps.tools.verify.__main__ import print_table
from shardps.tools.verify.run import RunConfig, run_schedule, short_form

pytestmark = pytest.mark.chaos
SHORT_FORM_BUDGET = 150.0          # seconds: what the passing short form may take here


def _run(tmp_path, defect: str = "") -> tuple[list, float]:
    started = time.monotonic()
    verdicts = short_form(defect, progress=print, work_dir=str(tmp_path))
    elapsed = time.monotonic() - started
    print_table(verdicts)
    return verdicts, elapsed


def test_short_form_passes(tmp_path):
    verdicts, elapsed = _run(tmp_path)
    failed = [x for v in verdicts for x in v.violations]
    assert not failed, "\n".join(failed)
    assert sum(v.acked for v in verdicts) > 500
    assert sum(v.stale_refused for v in verdicts) > 0      # SYNC pushes for applied steps were tried
    print(f"short form: {elapsed:.0f}s")


def test_short_form_catches_defect_1_copy_destination_not_pruned(tmp_path):
    verdicts, elapsed = _run(tmp_path, defect="1")
    assert not verdicts[-1].passed, "defect 1 went unnoticed"
    assert any("no acknowledged push" in x or "R not restored" in x for x in verdicts[-1].violations)
    assert elapsed < SHORT_FORM_BUDGET


def test_short_form_catches_defect_2_sync_push_acknowledged_and_dropped(tmp_path):
    verdicts, elapsed = _run(tmp_path, defect="2")
    assert not verdicts[-1].passed, "defect 2 went unnoticed"
    assert verdicts[-1].lost > 0 and verdicts[-1].stale_acked > 0
    assert elapsed < SHORT_FORM_BUDGET


def test_a_sync_job_keeps_stepping_after_a_server_restart(tmp_path):
    v = run_schedule(RunConfig(seed=3, seconds=4, jobs=("sync",), faults=("kill",), work_dir=str(tmp_path)), print)
    print_table([v])
    assert v.passed, "\n".join(v.violations)


def test_manager_replicas_on_etcd_under_the_leaders_kill_and_its_partition_from_etcd(tmp_path):
    """Three manager replicas on a real etcd (issue 19, item 4 in the verifier): the leader is
    killed -9 and restarted, and cut off from etcd and healed, while the ASYNC workloads push;
    the checker's verdict as for every schedule (exact counters, gaps <= 5 s, replicas)."""
    from shardps.tools.verify.run import ASYNC_JOBS
    from tests.debian import debian_binary
    binary = debian_binary("etcd", "etcd-server")
    v = run_schedule(RunConfig(seed=5, seconds=16, managers=3, etcd_binary=binary, jobs=ASYNC_JOBS,
                               faults=("manager", "etcd-partition"), rss_warmup=10.0, rss_min_span=8.0,
                               work_dir=str(tmp_path)), print)
    print_table([v])
    assert v.passed, "\n".join(v.violations)
    assert len(v.episodes) >= 2 and v.acked > 100
