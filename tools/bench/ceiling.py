"""The compute ceiling of the e2e part's two workers on this machine:
``python -m shardps.tools.bench.ceiling [rounds]``.

Per round, interleaved: the single-process ctr baseline alone, two of them at once (no
communication at all: the most two workers can do here), and sparse DDP with two ranks.
Prints samples/s; a parameter server's two workers can at best reach the second figure.
"""

from __future__ import annotations

import argparse
import threading

from shardps.tools.bench import ddp, e2e
from shardps.tools.bench.config import PRESETS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardps.tools.bench.ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rounds", type=int, nargs="?", default=2, help="interleaved rounds (default 2)")
    args = p.parse_args(argv)
    cfg = PRESETS["quick"]
    n, rows = cfg.e2e_train_samples, cfg.e2e_rows
    for _ in range(args.rounds):
        one = e2e.run_single(rows, n, cfg.process_timeout_s)["samples_per_s"]
        two = [0.0, 0.0]

        def go(i: int, out: list[float] = two) -> None:
            out[i] = e2e.run_single(rows, n, cfg.process_timeout_s)["samples_per_s"]
        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        d = ddp.summarize(ddp.run_ddp(rows, True, n, world=2, seed=0, timeout=cfg.process_timeout_s))
        print(f"one process alone {one:,.0f} samples/s; two at once {two[0]:,.0f} + {two[1]:,.0f} = "
              f"{sum(two):,.0f} ({sum(two) / one:.2f} x one); sparse DDP, 2 ranks {d['samples_per_s']:,.0f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
