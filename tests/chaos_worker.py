"""A counter worker for chaos tests: a real process that every step adds +1 to its own rows.

Each worker owns one row in every block of the sparse table ``counters`` (so every push
touches every server), pushes a gradient of -1 (SGD, lr 1: +1 per acknowledged push) and
records every acknowledged push in its state file. The checker compares each row with the
number of acknowledged pushes: none lost, none doubled.

A push is applied exactly once per block, but there are no transactions across servers: a
push in flight when its worker is killed may have reached only some of the blocks. A
restarted worker (``--state-file`` exists) rejoins with its previous session (a new
incarnation: the dead process's pushes are fenced and can never be retried) and resumes from
the servers' state: it brings the rows the dead push missed level with the others, then
counts on from there.

    python tests/chaos_worker.py --manager HOST:PORT --job chaos --name w0 --steps 200 \
        --state-file /tmp/w0.json [--delay 0.01] [--log-file /tmp/w0.log]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from shardps.tables import sgd
from shardps.tools.verify.workload import sparse_ids
from shardps.worker.client import PSClient

BLOCKS = 24
TABLE = "counters"


def worker_ids(rank: int, blocks: int = BLOCKS) -> np.ndarray:
    """One id per block, from this rank's id range: every push touches every block."""
    return sparse_ids(rank, blocks)


def write_state(path: str, state: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manager", required=True)
    p.add_argument("--job", default="chaos")
    p.add_argument("--name", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--state-file", required=True)
    p.add_argument("--log-file", default="")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--stop-file", default="", help="stop early when this file appears")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="join a checkpoint barrier every this many acknowledged pushes")
    args = p.parse_args(argv)
    from shardps.tools.children import PARENT_ENV, die_with_parent
    die_with_parent(int(os.environ.get(PARENT_ENV, "0") or 0))

    previous = {}
    if os.path.exists(args.state_file):
        with open(args.state_file) as f:
            previous = json.load(f)
    client = PSClient(args.manager, args.job, timeout=args.timeout)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.create_job()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    m = client.join(name=args.name, previous_session=previous.get("session", ""))
    client.create_sparse(TABLE, 1, optimizer=sgd(1.0), num_blocks=BLOCKS)
    ids = worker_ids(m.rank)
    acked = 0
    if m.restored:
        raw, _ = client.worker_state()
        acked = int(json.loads(raw.decode())["acked"])
    elif previous:
        if previous.get("rank") != m.rank:      # before touching rows: ids follow the rank
            print(f"rank changed on rejoin: {previous.get('rank')} -> {m.rank}", file=sys.stderr)
            return 3
        rows = client.pull_rows(TABLE, ids)[:, 0]
        acked = int(round(float(rows.max())))
        behind = rows < acked
        if behind.any():          # complete the dead push on the blocks it did not reach
            client.push_rows(TABLE, ids[behind], (rows[behind] - acked)[:, None])
    state = {"session": m.session, "rank": m.rank, "incarnation": m.incarnation,
             "acked": acked, "ids": ids.tolist(), "restarts": previous.get("restarts", -1) + 1,
             "incarnations": previous.get("incarnations", []) + [m.incarnation]}
    write_state(args.state_file, state)
    log = open(args.log_file, "a") if args.log_file else None
    grad = -np.ones((ids.shape[0], 1), dtype=np.float32)
    while acked < args.steps:
        if args.stop_file and os.path.exists(args.stop_file):
            break
        if args.checkpoint_every and acked and acked % args.checkpoint_every == 0 \
                and state.get("checkpointed") != acked:
            state["checkpoint"] = client.checkpoint_barrier(acked, json.dumps({"acked": acked}).encode())
            state["checkpointed"] = acked
            write_state(args.state_file, state)
        started = time.time()
        client.push_rows(TABLE, ids, grad)
        ended = time.time()
        acked += 1
        state["acked"] = acked
        write_state(args.state_file, state)
        if log is not None:
            log.write(f"{started:.4f} {ended:.4f}\n")
            log.flush()
        if args.delay:
            time.sleep(args.delay)
    state["done"] = True
    write_state(args.state_file, state)
    client.leave()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
