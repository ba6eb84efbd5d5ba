"""The benchmark harness (``python -m shardps.tools.bench``) works and writes every key.

No timing assertions: the speed targets live in the benchmark's own report. The harness test
runs the ``--tiny`` preset, every part on toy sizes with real processes (clusters, torch RPC,
DDP over gloo, shardps workers); the others check the pure pieces.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from shardps.tools.bench.config import PRESETS, TINY
from shardps.tools.bench.report import REQUIRED_KEYS, TARGETS, add_derived, table


def test_quick_and_full_presets_measure_the_target_sizes():
    quick, full = PRESETS["quick"], PRESETS["full"]
    for cfg in (quick, full):
        assert cfg.dense_sizes_mib == (16, 64) and cfg.dense_servers == (1, 2)
        assert (cfg.sparse_rows, cfg.sparse_ids, cfg.sparse_dim) == (1_000_000, 10_000, 64)
        assert (cfg.e2e_rows, cfg.e2e_workers, cfg.e2e_servers) == (1_000_000, 2, 2)
        assert cfg.mem_dense_params == 10_000_000 and cfg.mem_sparse_rows == 1_000_000
        assert cfg.mem_worker_rows == (1_000_000, 10_000_000)
        for axis in (0, 1):
            assert {p[axis] for p in cfg.curve_points} >= {1, 2, 4}
        assert min(cfg.placement_sizes) <= 10 and max(cfg.placement_sizes) >= 100
        assert cfg.placement_blocks_per_server >= 1000
    assert max(full.placement_sizes) == 1000


def test_targets_and_table_from_a_results_dict():
    results = {k: 1.0 for k in REQUIRED_KEYS}
    results.update(ratio_dense_push_ps_over_rpc=1.2, ratio_dense_pull_ps_over_rpc=0.5,
                   e2e_auc_gap_ps_async_minus_ddp_sparse=-0.004, server_bytes_per_param_sgd=float("nan"))
    add_derived(results)
    assert results["target_dense_push_met"] == 1.0
    assert results["target_dense_pull_met"] == 0.0
    assert results["e2e_auc_abs_gap_ps_async_ddp_sparse"] == pytest.approx(0.004)
    assert results["target_e2e_auc_met"] == 1.0
    assert "target_mem_sgd_met" not in results            # not measured: no verdict
    text = table(results)
    for t in TARGETS:
        assert t.text in text
    assert "MISSED" in text and "not measured" in text


def test_the_scale_targets_read_the_point_of_8_workers_and_every_point_for_sync():
    results = {"scale_w1_s1_ps_sync_over_ddp_sparse": 1.3, "scale_w2_s2_ps_sync_over_ddp_sparse": 0.9}
    add_derived(results)
    assert "scale_worst_ps_sync_over_ddp_sparse" not in results, "no verdict without the 8 x 4 point"
    assert "target_scale_sync_met" not in results
    results.update(scale_w8_s4_ps_sync_over_ddp_sparse=1.1, scale_w8_s4_ps_async_over_w_single=0.75,
                   scale_w8_s4_ps_async_over_ddp_sparse=1.9)
    add_derived(results)
    assert results["scale_worst_ps_sync_over_ddp_sparse"] == 0.9
    assert results["target_scale_sync_met"] == 0.0
    assert results["target_scale_w8_vs_single_met"] == 1.0
    assert results["target_scale_w8_vs_ddp_sparse_met"] == 0.0
    assert "target_scale_w8_per_core_met" not in results


def test_placement_simulation_small():
    from shardps.tools.bench.placement_sim import main, simulate
    res = simulate(5, 40)
    assert res["blocks"] == 200
    assert 1.0 <= res["worst_max_over_mean"] < 2.0
    assert 0.0 < res["join_moved_fraction"] <= 1.0 and 0.0 < res["leave_moved_fraction"] <= 1.0
    assert res["join_ideal_fraction"] == pytest.approx(1 / 6)
    assert main(["--servers", "3", "--blocks-per-server", "20"]) in (0, 1)


@pytest.mark.slow          # about a minute: some 30 real processes start and stop
def test_tiny_run_writes_every_key(tmp_path):
    from shardps.tools.bench.cli import main
    out = tmp_path / "results" / "latest.json"
    img = tmp_path / "img"
    code = main(["--tiny", "--out", str(out), "--plots", str(img), "--quiet"])
    meta = json.loads((out.parent / "latest.meta.json").read_text())
    assert code == 0, meta["errors"]
    assert meta["preset"] == "tiny" and meta["config"]["name"] == TINY.name
    results = json.loads(out.read_text())
    missing = [k for k in REQUIRED_KEYS if results.get(k) is None]
    assert not missing, f"keys without a number: {missing}"
    assert all(v is None or math.isfinite(v) for v in results.values())
    import torch
    for t in TARGETS:          # every target has a verdict; those of GPU runs only where CUDA is,
        measured = ((not t.cuda or torch.cuda.is_available())       # those of many cores where they are
                    and (os.cpu_count() or 1) >= t.cores)
        assert (f"target_{t.name}_met" in results) == measured, t.name
    assert {p.name for p in img.glob("*.png")} >= {"bench-dense.png", "bench-sparse.png", "bench-e2e.png",
                                                   "bench-memory.png", "bench-curves.png", "bench-placement.png"}
    # the "Results of one run" section of docs/performance.md, from this run's files
    from shardps.tools.bench.report import markdown_results, md_cell
    section = markdown_results(results, meta)
    assert f"| shardps, 1 server (shared memory) | {md_cell(results, 'ps_sparse_rows_per_s')} |" in section
    for mib in TINY.dense_sizes_mib:
        assert f"| {mib} MiB | push | {md_cell(results, f'ps_dense_push_gbps_{mib}mib_1s')} |" in section
        assert results.get(f"ps_dense_push_gbps_{mib}mib_1s") is not None
    # --only merges one part into the existing file
    assert main(["--tiny", "--only", "transport", "--out", str(out), "--quiet"]) == 0
    again = json.loads(out.read_text())
    assert set(results) <= set(again)


def test_control_map_simulation_small():
    """Whole maps against changes at a small size; the changes are a small share already."""
    from shardps.tools.bench.control_map import main, simulate
    res = simulate(8, 100, jobs=4, workers=40)
    assert res["blocks"] == 800 and res["map_bytes"] > 0
    for event in ("death", "join"):
        assert 0 < res[f"{event}_bytes_delta"] < res[f"{event}_bytes_full"]
    assert res["worker_map_bytes"] < res["map_bytes"]
    assert main(["--servers", "6", "--blocks-per-server", "50", "--jobs", "3", "--workers", "30"]) in (0, 1)


def test_reply_scatter_times_both_placements_of_a_pull(capsys):
    from shardps.tools.bench import reply_scatter
    got = reply_scatter.measure(tables=3, rows=20, dim=4, number=20, repeat=1)
    assert set(got) == {"one_array", "apart"} and all(v > 0 for v in got.values())
    assert reply_scatter.main(["--tables", "2", "--rows", "5", "--repeat", "1"]) == 0
    assert "outputs in one array" in capsys.readouterr().out


@pytest.mark.slow               # ~4 s: a manager and two servers in this process
def test_exchange_split_divides_the_cpu_of_both_sides(capsys):
    from shardps.tools.bench import exchange_split
    before = [getattr(owner, name) for owner, name in exchange_split.KERNELS + exchange_split.SOCKET]
    assert exchange_split.main(["--steps", "5", "--rounds", "1", "--warmup", "3"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[-2:]}
    assert set(rows) == {"client", "servers"}
    for side, cells in rows.items():
        whole, kernel, socket_ = float(cells[1]), float(cells[2]), float(cells[4])
        # each side's kernels and socket calls were seen on its own threads, and are part of it
        assert 0 < kernel < whole and 0 < socket_ < whole, (side, cells)
    # the wrappers are gone: other code in this process runs the functions themselves
    assert [getattr(owner, name) for owner, name in exchange_split.KERNELS + exchange_split.SOCKET] == before


@pytest.mark.slow               # ~10 s: two server processes, a worker in this process
def test_worker_split_measures_the_loop_the_exchanges_and_the_servers(capsys):
    from shardps.tools.bench import worker_split
    from shardps.worker import runtime
    train = runtime.train_with_ps
    assert worker_split.main(["--train-samples", "40960", "--rounds", "1"]) == 0
    assert runtime.train_with_ps is train            # the wrapper is gone
    out = capsys.readouterr().out
    assert "round 1/1: 80 steps" in out, out
    table = {line[:30].strip(): float(line[30:]) for line in out.splitlines()[-5:]}
    assert set(table) == {"wall", "training thread cpu", "other threads cpu", "servers cpu",
                          "forward and backward alone"}, table
    # every part ran and took time; the training thread's CPU fits in the wall time
    assert all(v > 0 for v in table.values()), table
    assert table["training thread cpu"] <= table["wall"] * 1.05, table


@pytest.mark.slow               # ~15 s: two local clusters of two server processes, one process
def test_many_tables_compares_a_block_count_with_the_default(capsys, monkeypatch):
    from shardps.tools.bench import many_tables
    from shardps.worker.client import PSClient
    counts: list[set[int]] = []
    create = PSClient.create_tables

    def spy(self, tables, *a, **kw):
        counts.append({spec.num_blocks for spec, _ in tables if spec.kind.name == "SPARSE"})
        return create(self, tables, *a, **kw)
    monkeypatch.setattr(PSClient, "create_tables", spy)
    many_tables.main(["--num-blocks", "4", "--rounds", "1", "--steps", "2"])
    assert counts == [{4}, {1}]            # the variant's tables, then the default's (4 MiB each)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("round 1/1: samples/s with 4 blocks per table ") and "one process" in line


def test_server_cpu_measures_requests_of_one_and_of_several_tables(capsys):
    from shardps.tools.bench import server_cpu
    assert server_cpu.main(["--rows", "40", "--rounds", "2", "--repeats", "1", "--blocks", "4",
                            "--table-rows", "1000", "--dim", "4", "--tables", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["compiled", "no-cache", "general"]
    assert all("of each of 3 tables" in line for line in lines)
    assert server_cpu.measure("compiled", 1000, 4, 40, 2, tables=1, dim=4) > 0


def test_server_cpu_at_replication_2_counts_a_backup_that_ends_with_the_primarys_blocks(capsys):
    import numpy as np

    from shardps.messages import GRADIENT, Header, PushRequest
    from shardps.server.node.digest import block_digest
    from shardps.tools.bench import server_cpu
    assert server_cpu.main(["--rows", "40", "--rounds", "2", "--repeats", "1", "--blocks", "4",
                            "--table-rows", "1000", "--dim", "4", "--replication", "2"]) == 0
    assert all("primary and backup" in line for line in capsys.readouterr().out.splitlines())
    node = server_cpu._node(1000, 4, 4, replication=2)
    ids = np.arange(0, 1000, 9, dtype="<i8")
    node.push(PushRequest(Header(server_cpu.JOB, epoch=1, session="w0", incarnation=1, sequence=1), GRADIENT,
                          server_cpu._segments([server_cpu.TABLE], [ids]),
                          ids.tobytes() + np.ones((ids.shape[0], 4), "<f4").tobytes()))
    backup = node.peers.backup
    assert sorted(backup.table.blocks) == sorted(node.table.blocks)
    for key, blk in node.table.blocks.items():
        assert blk.version == 1 and block_digest(blk) == block_digest(backup.table.blocks[key]), key


def test_chosen_scale_points_and_gpu_sizes_reach_the_config_and_bad_ones_are_refused(capsys):
    from shardps.tools.bench import scale
    from shardps.tools.bench.cli import build_parser

    args = build_parser().parse_args(["--scale-points", "8x4,2x2", "--gpu-batches", "4096", "--gpu-workers", "2"])
    assert (args.scale_points, args.gpu_batches, args.gpu_workers) == (((8, 4), (2, 2)), (4096,), (2,))
    assert scale.points(16, args.scale_points) == [(8, 4), (2, 2)]
    assert scale.points(2, args.scale_points) == []                    # workers + servers > cores
    assert scale.points(16) == list(scale.POINTS)
    for bad in (["--scale-points", "8"], ["--scale-points", "8x0"], ["--gpu-batches", "4096,x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)
        assert repr(bad[1]) in capsys.readouterr().err


def test_report_merges_results_files_and_names_a_missing_one(tmp_path, capsys):
    import json

    from shardps.tools.bench.report import main

    (tmp_path / "a.json").write_text(json.dumps({"gpu_ps_w2_b4096_over_single": 0.5,
                                                 "cache_gpu_on_auc_abs_gap": 0.001}))
    (tmp_path / "b.json").write_text(json.dumps({"gpu_ps_w2_b4096_over_single": 1.3, "cache_gpu_on_auc_abs_gap": None}))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "1.300" in next(s for s in lines if "gpu_ps_w2_b4096_over_single" in s)    # the later file wins
    assert "1.00e-03" in next(s for s in lines if "cache_gpu_on_auc_abs_gap" in s)    # but not with a null
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json")])
    assert "missing.json: no such results file" in capsys.readouterr().err


def test_waiting_for_processes_reports_the_first_failure_while_the_others_still_run(tmp_path):
    import subprocess
    import sys
    import time

    from shardps.tools.bench.common import BenchError, wait_all
    log = tmp_path / "w1.log"
    log.write_text("worker 1 failed: no route to the manager\n")
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(BenchError, match=r"(?s)worker 1 exited with 3.*no route to the manager"):
            wait_all([waiting, failing], 60.0, "worker", [tmp_path / "w0.log", log])
        assert time.monotonic() - t0 < 30.0          # not after the 60 s of the waiting one
        assert waiting.poll() is None
        with pytest.raises(BenchError, match="worker 0 timed out after 0s"):
            wait_all([waiting], 0.2, "worker")
    finally:
        waiting.kill()
        waiting.wait()


def _three_lines(x):
    y = x + 1
    z = y * 2
    return z


def test_the_line_counter_counts_the_lines_of_the_files_it_is_given_per_thread():
    import threading

    from shardps.tools.bench.lines import LineCounter, in_library
    counter = LineCounter(wanted=lambda name: name == __file__)
    counter.install()
    try:
        _three_lines(1)                              # not counted: inactive
        counter.active = True
        _three_lines(1)
        other = threading.Thread(target=lambda: [_three_lines(i) for i in range(2)], name="other-thread")
        other.start()
        other.join()
        counter.active = False
        _three_lines(1)
    finally:
        counter.remove()
    me = threading.get_ident()
    assert counter.lines[me] == 3 and counter.calls[me] == 1
    roles = counter.by_role(training=me)
    assert roles["train"] == (3, 1)
    assert roles["other"][0] >= 6 and roles["other"][1] >= 2        # the thread's lambda and list count too
    import shardps.tools.bench.lines as lines_module
    from shardps import kernels
    from shardps.worker.client import data
    assert in_library(data.__file__) and in_library(kernels.__file__) and not in_library(lines_module.__file__)
