"""``python -m shardps.tools.bench`` (``shardps bench``, ``make bench`` / ``make bench-quick``).

    python -m shardps.tools.bench                       # --quick: every part, under 10 minutes
    python -m shardps.tools.bench --full                # more rounds and data
    python -m shardps.tools.bench --only dense          # one part, merged into the existing --out
    python -m shardps.tools.bench --plots docs/img      # also draw the PNGs of docs/performance.md

Writes ``--out`` (default ``bench/results/latest.json``): a flat JSON object of metric name to
number (``null`` where a part failed), and beside it ``latest.meta.json`` with the
configuration, the machine's load before and after, and any part's error. Exit status 1 if
a part failed; targets missed do not change it (the table says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from shardps.tools.bench.common import Progress, clean_environment
from shardps.tools.bench.config import PRESETS
from shardps.tools.bench.report import add_derived, table

PARTS = {
    "transport": "shardps.tools.bench.transport",
    "kernels": "shardps.tools.bench.kernels",
    "dense": "shardps.tools.bench.dense",
    "sparse": "shardps.tools.bench.sparse",
    "e2e": "shardps.tools.bench.e2e",
    "scale": "shardps.tools.bench.scale",
    "cache": "shardps.tools.bench.cache",
    "memory": "shardps.tools.bench.memory",
    "curves": "shardps.tools.bench.curves",
    "placement": "shardps.tools.bench.placement_sim",
    "control": "shardps.tools.bench.control_map",
    "lifecycle": "shardps.tools.bench.lifecycle",
    "cold": "shardps.tools.bench.cold",
    "gpu": "shardps.tools.bench.gpu",
    "lines": "shardps.tools.bench.lines",
    "hybrid": "shardps.tools.bench.hybrid",
}
DEFAULT_OUT = "bench/results/latest.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardps bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="the default: every part in under 10 minutes on 2 cores")
    size.add_argument("--full", dest="preset", action="store_const", const="full",
                      help="more rounds, more training data, the full cost-curve grid")
    size.add_argument("--tiny", dest="preset", action="store_const", const="tiny",
                      help="toy sizes to check the harness (the tests); the numbers mean nothing")
    p.set_defaults(preset="quick")
    p.add_argument("--only", action="append", choices=list(PARTS), metavar="PART",
                   help=f"run only this part (repeatable; one of {', '.join(PARTS)}); results are merged "
                        f"into an existing --out file")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    p.add_argument("--plots", default="", metavar="DIR", help="also draw the PNG plots into DIR")
    p.add_argument("--seed", type=int, default=0, help="seed of every generated tensor and id set")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--scale-points", type=_points, default=(), metavar="WxS,...",
                   help="the scale part's (workers x servers) points, e.g. 8x4 (default: every one of "
                        "1x1, 2x2, 4x4 and 8x4 that the cores fit)")
    p.add_argument("--gpu-batches", type=_numbers, default=(), metavar="B,...",
                   help="the gpu part's batch sizes per process (default: 512,4096); the cache part's "
                        "GPU case uses the largest")
    p.add_argument("--gpu-workers", type=_numbers, default=(), metavar="W,...",
                   help="the gpu part's worker counts (default: 1,2,4)")
    return p


def _numbers(text: str) -> tuple[int, ...]:
    """``4096`` or ``512,4096``: positive integers."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas")
    return values


def _points(text: str) -> tuple[tuple[int, int], ...]:
    """``8x4`` or ``2x2,8x4``: (workers, servers) pairs."""
    try:
        return tuple((w, s) for w, s in (_numbers(p.replace("x", ",")) for p in text.split(",")))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: give WORKERSxSERVERS pairs separated by commas, "
                                         f"e.g. 2x2,8x4") from None


def _finite_or_none(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    clean_environment()
    cfg = PRESETS[args.preset].replace(seed=args.seed)
    chosen = {"scale_points": args.scale_points, "gpu_batches": args.gpu_batches, "gpu_workers": args.gpu_workers}
    cfg = cfg.replace(**{k: v for k, v in chosen.items() if v})
    parts = args.only or list(PARTS)
    out_path = Path(args.out)
    meta_path = out_path.with_name(out_path.stem + ".meta.json")
    results: dict = {}
    meta: dict = {}
    if args.only and out_path.exists():
        results = {k: v for k, v in json.loads(out_path.read_text()).items() if v is not None}
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
    progress = Progress(quiet=args.quiet)
    errors = dict(meta.get("errors", {}))
    started = time.monotonic()
    meta.update(preset=cfg.name, config=dataclasses.asdict(cfg), commit=_git("rev-parse", "--short", "HEAD"),
                uncommitted_changes=bool(_git("status", "--porcelain", "--untracked-files=no")),
                started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                cpus=os.cpu_count(), loadavg_before=os.getloadavg())
    progress(f"preset {cfg.name}, parts: {', '.join(parts)}; load average {os.getloadavg()[0]:.1f} "
             f"on {os.cpu_count()} cores")
    for name in parts:
        progress.part = name
        t0 = time.monotonic()
        try:
            module = importlib.import_module(PARTS[name])
            results.update(module.run(cfg, progress))
            errors.pop(name, None)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            progress(f"FAILED: {errors[name]}")
            traceback.print_exc(file=sys.stderr)
        results[f"part_{name}_seconds"] = time.monotonic() - t0
        progress(f"done in {time.monotonic() - t0:.0f}s")
    progress.part = ""
    add_derived(results)
    meta.update(errors=errors, loadavg_after=os.getloadavg(), seconds=time.monotonic() - started)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({k: _finite_or_none(results[k]) for k in sorted(results)}, indent=1) + "\n")
    meta_path.write_text(json.dumps(meta, indent=1, default=str) + "\n")
    if args.plots:
        from shardps.tools.bench.plots import draw_all
        written = draw_all(results, Path(args.plots))
        progress(f"plots: {', '.join(str(p) for p in written)}")
    print(table(results))
    print(f"\nwrote {out_path} and {meta_path} in {time.monotonic() - started:.0f}s"
          + (f"; FAILED parts: {', '.join(errors)}" if errors else ""))
    return 1 if errors else 0
