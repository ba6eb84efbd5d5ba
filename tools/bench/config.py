"""The benchmark's configuration: one frozen dataclass, three presets.

``QUICK`` (the default, under 10 minutes on a 2-core machine) and ``FULL`` measure the same
things; ``FULL`` repeats more and trains on more data. ``TINY`` runs every part's machinery on
toy sizes in seconds; the tests use it, and its numbers mean nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class BenchConfig:
    name: str
    seed: int = 0
    # transport: one process sends `tcp_mib` to another over a loopback socket, `tcp_repeats` times
    tcp_mib: int = 64
    tcp_repeats: int = 10
    # transport call cost: raw TCP, gRPC and the data plane, client and server in two processes
    transport_rounds: int = 10
    transport_small_calls: int = 300      # 64-byte calls per system per round
    transport_1mib_calls: int = 30        # 1 MiB calls per system per round
    # dense: whole-tensor push (SGD on the server) and pull; rounds interleave the systems
    dense_sizes_mib: tuple[int, ...] = (16, 64)
    dense_servers: tuple[int, ...] = (1, 2)
    dense_rounds: int = 5
    dense_lr: float = 0.01
    # sparse: pull then push of `sparse_ids` unique ids x `sparse_dim` of a `sparse_rows` table
    sparse_rows: int = 1_000_000
    sparse_dim: int = 64
    sparse_ids: int = 10_000
    sparse_rounds: int = 10
    sparse_populate: bool = True          # store every row on the server before timing
    sparse_servers: tuple[int, ...] = (1, 2)
    # end to end: the ctr model
    e2e_rows: int = 1_000_000
    e2e_train_samples: int = 400_000       # the ctr model's default data size
    e2e_ddp_dense_train_samples: int = 0   # 0: e2e_train_samples (the dense DDP baseline is slow)
    e2e_workers: int = 2
    e2e_servers: int = 2
    # cache: the ctr model with and without the worker-side embedding cache (tools/bench/cache.py)
    cache_bytes: int = 8_000_000           # per table: about 90,000 rows of 16 floats
    cache_staleness: int = 8
    # scale: the ctr model at the (workers, servers) points the cores fit (tools/bench/scale.py)
    scale_train_samples: int = 200_000
    scale_points: tuple[tuple[int, int], ...] = ()     # (): every point of scale.POINTS the cores fit
    # many tables: the plain loop on 12 single-hot tables (tools/bench/many_tables.py)
    many_tables_steps: int = 400
    lines_steps: int = 40                 # steps the lines part counts (after its warm-up)
    hybrid_digits_epochs: int = 0         # hybrid: the digits CNN's epochs (0: the model's, 20)
    # memory
    mem_dense_params: int = 10_000_000
    mem_sparse_rows: int = 1_000_000
    mem_sparse_dim: int = 16
    mem_push_elements: int = 1 << 20       # dense elements per push while filling a table
    mem_push_rows: int = 50_000            # sparse rows per push while filling a table
    mem_worker_rows: tuple[int, int] = (1_000_000, 10_000_000)
    mem_worker_steps: int = 10
    mem_ddp_steps: int = 3                 # DDP reaches its peak (grads + optimizer state) on step 1
    mem_worker_train_samples: int = 20_000
    mem_workers: int = 2
    mem_ddp_dense: bool = True             # also measure DDP with a dense embedding
    mem_mmap_variant: bool = True          # also measure servers with MALLOC_MMAP_THRESHOLD_=65536
    # cost curves: (servers, workers) pairs, each worker runs `curve_steps` steps
    curve_points: tuple[tuple[int, int], ...] = ((1, 2), (2, 1), (2, 2), (2, 3), (2, 4), (3, 2), (4, 2))
    curve_steps: int = 60
    curve_train_samples: int = 100_000
    curve_rows: int = 1_000_000
    # placement simulation
    placement_sizes: tuple[int, ...] = (10, 100, 1000)
    placement_blocks_per_server: int = 1000
    placement_timeout_s: float = 120.0     # per size; a size that takes longer is reported as such
    # shard-map bytes, whole maps against changes (tools/bench/control_map.py)
    control_servers: int = 1000
    control_blocks_per_server: int = 1000
    control_jobs: int = 100
    control_workers: int = 10_000
    # lifecycle: the ctr model over 100M ids with / without a budget (tools/bench/lifecycle.py)
    lifecycle_train_samples: int = 400_000
    lifecycle_test_samples: int = 50_000
    lifecycle_batch: int = 1024
    lifecycle_budget_mib: int = 64
    lifecycle_admit_after: int = 2
    # cold: that model and data with a tenth of the rows in RAM, with and without the cold tier
    # (tools/bench/cold.py)
    cold_train_samples: int = 300_000
    # every part gives up after this long (processes are stopped)
    process_timeout_s: float = 900.0
    # gpu: the ctr model on CUDA, one process against GPU workers (tools/bench/gpu.py); skipped without CUDA
    gpu_train_samples: int = 400_000
    gpu_batches: tuple[int, ...] = (512, 4096)
    gpu_workers: tuple[int, ...] = (1, 2, 4)

    def replace(self, **changes) -> "BenchConfig":
        return dataclasses.replace(self, **changes)


QUICK = BenchConfig(
    name="quick",
    e2e_train_samples=200_000,
    e2e_ddp_dense_train_samples=50_000,    # it runs at ~500-4,000 samples/s here
    mem_mmap_variant=False,
    mem_ddp_dense=False,            # its 10M-row run alone takes 1-2 minutes here: --full
    curve_points=((1, 2), (2, 2), (4, 2), (2, 1), (2, 4)),
    curve_steps=60,
)

FULL = BenchConfig(
    name="full",
    tcp_repeats=20,
    transport_rounds=20,
    dense_rounds=10,
    sparse_rounds=30,
    e2e_train_samples=400_000,
    mem_worker_steps=40,
    mem_ddp_steps=10,
    curve_points=tuple((s, w) for s in (1, 2, 3, 4) for w in (1, 2, 3, 4)),
    curve_steps=150,
    curve_train_samples=200_000,
    placement_timeout_s=1800.0,
    process_timeout_s=3600.0,
    gpu_train_samples=2_000_000,
)

TINY = BenchConfig(
    name="tiny",
    tcp_mib=1,
    tcp_repeats=2,
    transport_rounds=1,
    transport_small_calls=5,
    transport_1mib_calls=2,
    dense_sizes_mib=(1,),
    dense_servers=(1,),
    dense_rounds=1,
    sparse_rows=10_000,
    sparse_dim=8,
    sparse_ids=100,
    sparse_rounds=1,
    sparse_servers=(1,),
    e2e_rows=10_000,
    e2e_train_samples=4_096,
    e2e_workers=1,
    e2e_servers=1,
    scale_train_samples=4_096,
    many_tables_steps=5,
    lines_steps=2,
    hybrid_digits_epochs=1,
    mem_dense_params=1 << 18,
    mem_sparse_rows=10_000,
    mem_push_elements=1 << 16,
    mem_push_rows=5_000,
    mem_worker_rows=(10_000, 20_000),
    mem_worker_steps=2,
    mem_ddp_steps=1,
    mem_worker_train_samples=2_048,
    mem_workers=1,
    mem_ddp_dense=False,
    mem_mmap_variant=False,
    curve_points=((1, 1),),
    curve_steps=2,
    curve_train_samples=2_048,
    curve_rows=10_000,
    placement_sizes=(4,),
    placement_blocks_per_server=50,
    placement_timeout_s=60.0,
    control_servers=6,
    control_blocks_per_server=50,
    control_jobs=3,
    control_workers=30,
    lifecycle_train_samples=4_096,
    lifecycle_test_samples=2_048,
    lifecycle_batch=512,
    lifecycle_budget_mib=1,
    cold_train_samples=6_000,
    process_timeout_s=300.0,
    gpu_train_samples=8_192,
    gpu_batches=(512,),
    gpu_workers=(1,),
)

PRESETS = {"quick": QUICK, "full": FULL, "tiny": TINY}
