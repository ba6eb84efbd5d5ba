"""``shardps bench``: shardps measured side by side with what users would otherwise run.

Every part runs real processes on loopback with fixed seeds and writes numbers into one flat
``{metric: number}`` JSON object (``bench/results/latest.json`` by default):

* ``transport``  raw TCP socket between two processes: the ceiling of the loopback path;
* ``dense``      16 and 64 MiB dense push (server-side SGD) and pull, shardps (1 and 2 servers)
                 against ``torch.distributed.rpc`` over TensorPipe pinned to its TCP transport;
* ``sparse``     pull then push of 10,000 unique rows x 64 of a 1,000,000-row table, shardps
                 against torch RPC gathering and scatter-updating a remote table; the bytes
                 DDP would move for the same step;
* ``e2e``        the ``ctr`` model: shardps async and sync, DDP over gloo with a dense and with a
                 sparse embedding, and a single process: samples/s and test AUC;
* ``memory``     server resident memory per stored parameter / row; worker RSS growth when
                 the ctr table grows 1M -> 10M rows, shardps against DDP;
* ``curves``     samples/s and bytes per step as servers and workers go 1 -> 4;
* ``placement``  the manager's placement simulated for 10, 100 and 1,000 servers.

Run ``python -m shardps.tools.bench --help``. The configuration of each preset is the frozen
``BenchConfig`` in ``shardps.tools.bench.config``; ``docs/performance.md`` explains the results.
"""



def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``python -m shardps.tools.bench --help``); returns the exit status."""
    from shardps.tools.bench.cli import main as run
    return run(argv)


__all__ = ["main"]
