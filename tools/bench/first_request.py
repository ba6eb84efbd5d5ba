"""``python -m shardps.tools.bench.first_request``: how long a fresh server container takes from
``docker run`` to serving its first data request, with the numba cache the image ships and
without it.

Each run starts a manager container and waits for it, then times a server container from
``docker run`` until a client on this host has created a job and a sparse Adagrad table,
pushed one row's gradient and pulled the row back (the push and the pull are the first data
requests the server serves). ``--no-cache`` runs point ``NUMBA_CACHE_DIR`` at an empty folder,
as an image without the cache would be. Printed per variant: the median seconds to the first
served request over ``--runs`` and what the server's log says about its kernels (loaded from
the cache, compiled). Containers use the host's network and are removed afterwards.

    make images && python -m shardps.tools.bench.first_request --image shardps/server:latest
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import uuid

import numpy as np

from shardps import kernels
from shardps.errors import ShardpsError
from shardps.tools.bench.common import free_port


def _docker(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {(out.stderr or out.stdout).strip()[:500]}")
    return out.stdout


def _start(image: str, name: str, env: dict[str, str], *command: str) -> None:
    flags = [f"--env={k}={v}" for k, v in env.items()]
    _docker("run", "-d", "--name", name, "--network", "host", *flags, image, *command)


def _wait_serving(container: str, address: str, deadline: float) -> None:
    while subprocess.run(["docker", "exec", container, "shardps", "health", address],
                         capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{container} did not report SERVING at {address} within 60 s")
        time.sleep(0.2)


def _first_request(manager: str, deadline: float) -> None:
    """Create a job and a table, push one row and pull it back; retry until it is served."""
    from shardps.worker import PSClient, adagrad
    while True:
        try:
            with PSClient(manager, job="first-request") as client:
                client.create_job()
                client.create_sparse("emb", dim=16, optimizer=adagrad(lr=0.05))
                ids = np.array([7], dtype=np.int64)
                client.push_rows("emb", ids, np.ones((1, 16), np.float32))
                client.pull_rows("emb", ids)
                return
        except ShardpsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_once(image: str, cache: bool, timeout: float = 180.0) -> dict:
    """One manager and one server container: seconds from the server's ``docker run`` to its
    first served request, and its kernels' log line."""
    tag = uuid.uuid4().hex[:8]
    mport, sport = free_port(), free_port()
    manager = f"127.0.0.1:{mport}"
    names = (f"shardps-first-manager-{tag}", f"shardps-first-server-{tag}")
    env = {} if cache else {"NUMBA_CACHE_DIR": "/tmp/numba-empty"}
    try:
        _start(image, names[0], {}, "manager", "--listen", manager, "--metrics-port", "-1")
        _wait_serving(names[0], manager, time.monotonic() + 60)
        started = time.monotonic()
        _start(image, names[1], env, "server", "--manager", manager, "--listen", f"127.0.0.1:{sport}",
               "--name", "s0", "--metrics-port", "-1")
        _first_request(manager, started + timeout)
        seconds = time.monotonic() - started
        found = None
        while found is None and time.monotonic() < started + timeout:      # logged when all are ready
            logs = subprocess.run(["docker", "logs", names[1]], capture_output=True, text=True)
            found = kernels.READY_LINE.search(logs.stderr + logs.stdout)
            time.sleep(0.2 if found is None else 0)
        return {"seconds": seconds,
                "kernels_s": float(found.group(1)) if found else None,
                "loaded": int(found.group(2)) if found else None,
                "compiled": int(found.group(3)) if found else None}
    finally:
        subprocess.run(["docker", "rm", "-f", *names], capture_output=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m shardps.tools.bench.first_request", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="shardps/server:latest", help="the server image (make images builds it)")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant; the median is printed")
    args = ap.parse_args(argv)
    result = {}
    for variant, cache in (("image_cache", True), ("no_cache", False)):
        runs = [run_once(args.image, cache) for _ in range(args.runs)]
        result[variant] = {"median_s": statistics.median(r["seconds"] for r in runs), "runs": runs}
        k = runs[-1]
        print(f"{variant:12s} first request served {result[variant]['median_s']:.2f} s after docker run "
              f"(median of {args.runs}); kernels: {k['loaded']} loaded from the cache, {k['compiled']} "
              f"compiled, in {k['kernels_s']} s", flush=True)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
