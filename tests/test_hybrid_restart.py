"""A hybrid job's worker dies: under ``shardps run --elastic`` (torch's elastic agent) the
whole group restarts into a new rendezvous round, each rank takes its dense state from the
job's latest checkpoint and the embeddings from the servers, and training goes on.

Three workers train examples/hybrid_ctr.py's click model with ``maybe_checkpoint(every=20)``;
rank 1 kills itself with SIGKILL after step 70. Beside its embedding push, every step each
rank pushes +1 to its own element of a ledger table and logs the step once the server
acknowledged it: at the end each element holds at least the rank's acknowledged count (none
lost). The final test AUC is compared with the same job undisturbed: each rank's batch at a
step is drawn from a generator seeded by (rank, step), so the restarted group trains on the
undisturbed job's batches from the step it resumed at, and the two AUCs differ by what the
restart did (the embeddings' updates of the steps replayed after the checkpoint), not by which
samples each run happened to draw. ``-s`` prints the figures (docs/reliability.md quotes them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORLD, STEPS, KILL_AT, EVERY = 3, 150, 70, 20

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import numpy as np
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.environ["EXAMPLES"])
    from hybrid_ctr import ClickModel, batch, held_out_auc    # the example's model, data and AUC
    from shardps.tables import dense_table, sgd
    from shardps.worker import PSClient
    from shardps.worker.torch_ps import PSModel

    out, steps, kill_at, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    client = PSClient()                                  # SHARDPS_MANAGER, SHARDPS_JOB from shardps run
    client.create_job()
    client.join()
    client.create_table(dense_table("ledger", (world,)), sgd(lr=1.0))   # [rank] += 1 per push applied
    module = ClickModel()
    model = PSModel(module, client, dense="allreduce",
                    dense_optimizer=torch.optim.Adam(module.parameters(), lr=1e-2))
    model.create_tables()
    model.resume()                                       # after the restart: the latest checkpoint's state
    taste = np.random.default_rng(0).normal(0, 1, 5_000)
    log = open(f"{out}.{rank}.jsonl", "a")
    log.write(json.dumps({"resumed": model.step, "t": time.time(), "restart": restart}) + "\\n")
    mark = -np.eye(world, dtype=np.float32)[rank]
    while model.step < steps:
        if restart == 0 and rank == 1 and model.step == kill_at:
            log.write(json.dumps({"killed": time.time()}) + "\\n"); log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        ids, clicks = batch(np.random.default_rng((rank, model.step)), taste, 256)   # step's own batch
        model.pull()
        loss = F.binary_cross_entropy_with_logits(model(ids), clicks)
        loss.backward()
        model.push()
        client.push_dense("ledger", mark)               # returns once the server acknowledged it
        log.write(json.dumps({"step": model.step, "t": time.time(), "restart": restart}) + "\\n"); log.flush()
        if every:
            model.maybe_checkpoint(every=every)
    model.flush()
    if rank == 0:
        auc = held_out_auc(model, taste, 8192)
        json.dump({"auc": auc, "ledger": client.pull_dense("ledger").tolist()}, open(f"{out}.result.json", "w"))
    client.leave()
    client.close()
""")


def _run(cluster, tmp_path: Path, job: str, kill_at: int) -> tuple[dict, list[list[dict]]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / job
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXAMPLES": str(ROOT / "examples")}
    done = subprocess.run([sys.executable, "-m", "shardps.tools.cli", "run", "--manager", cluster.address, "--job", job,
                           "--elastic", "--nproc-per-node", str(WORLD), "--max-restarts", "1",
                           str(script), str(out), str(STEPS), str(kill_at), str(EVERY)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    logs = [[json.loads(line) for line in Path(f"{out}.{r}.jsonl").read_text().splitlines()] for r in range(WORLD)]
    return json.loads(Path(f"{out}.result.json").read_text()), logs


@pytest.mark.slow          # processes: shardps run, torch's elastic agent and 3 workers, twice
def test_a_killed_hybrid_worker_restarts_the_group_from_the_checkpoint_and_loses_nothing(make_cluster, tmp_path):
    cluster = make_cluster(2, manager_settings={"checkpoint_dir": str(tmp_path / "checkpoints")})
    calm, _ = _run(cluster, tmp_path, "calm", kill_at=-1)
    hit, logs = _run(cluster, tmp_path, "hit", kill_at=KILL_AT)

    killed = next(e["killed"] for log in logs for e in log if "killed" in e)
    resumed = [next(e for e in log if e.get("restart") == 1 and "resumed" in e) for log in logs]
    first = [next(e for e in log if e.get("restart") == 1 and "step" in e) for log in logs]
    acked = [sum("step" in e for e in log) for log in logs]
    # every rank came back in the group's second round, from the same step: the latest
    # checkpoint's (60: the last multiple of 20 before the kill after step 70) or the job's later one
    assert len({e["resumed"] for e in resumed}) == 1 and 2 * EVERY <= resumed[0]["resumed"] <= KILL_AT
    # nothing acknowledged is lost: each rank's ledger element counts every acknowledged push
    # (and at most one more per rank: a push applied whose acknowledgement its SIGTERM cut off)
    for rank in range(WORLD):
        assert acked[rank] <= hit["ledger"][rank] <= acked[rank] + 1, (rank, acked, hit["ledger"])
    assert calm["ledger"] == [float(STEPS)] * WORLD
    gap = max(e["t"] for e in first) - killed
    print(f"\nhybrid restart: kill after step {KILL_AT}; the group resumed at step {resumed[0]['resumed']} "
          f"and trained again {gap:.1f} s after the kill; ledger {hit['ledger']} for {acked} acknowledged; "
          f"AUC {hit['auc']:.4f} against {calm['auc']:.4f} undisturbed (gap {abs(hit['auc'] - calm['auc']):.4f})")
    assert abs(hit["auc"] - calm["auc"]) <= 0.005
