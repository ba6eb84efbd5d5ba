#!/usr/bin/env bash
# The checks and figures that only a machine with a CUDA device and 16 cores can give, in one
# run of under 10 minutes: the CUDA tests, then the bench's `scale`, `gpu` and `cache` parts.
#
#   bash scripts/gpu-machine.sh            # on such a machine, from the repository's root
#
# Writes into $OUT (default bench/results/gpu-machine): env.txt (versions, cores, GPU),
# tests.log, bench.log (the parts' progress lines) and device.json (+ device.meta.json), the
# parts' figures merged as `python -m shardps.bench --only PART --out` does.
#
# Without an installed shardps (a bare machine with PyTorch, numpy and numba), put the other
# wheels it needs in .whl/ (grpcio, protobuf, grpcio-health-checking, grpcio-reflection,
# uhashring, prometheus-client, for that machine's Python): they go to /tmp/site, and the
# source tree's packages are linked where the installed names expect them.
# BENCH_ARGS (default --quick) and LIMITS ("tests scale gpu cache" seconds) tune a run; on an
# H100 with 16 cores the four took 54 s (pytest), about 200, 136 and 84 s.
set -u
OUT=${OUT:-bench/results/gpu-machine}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    for d in protos server worker; do [ -e "shardps/$d" ] || ln -s "../$d" "shardps/$d"; done
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
read -r T_TESTS T_SCALE T_GPU T_CACHE <<< "${LIMITS:-80 240 150 95}"
{
    date -u; echo "cores: $(nproc)"; nvidia-smi -L 2>&1
    python3 -c "import sys, torch, numpy, numba, grpc, google.protobuf as pb
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'numpy', numpy.__version__, 'numba', numba.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)"
} 2>&1 | tee "$OUT/env.txt"

step() {  # step SECONDS LOG COMMAND...: run COMMAND under a time limit, its output into LOG
    local secs=$1 log=$2; shift 2
    echo "== $* (limit ${secs} s)" | tee -a "$log"
    timeout -k 10 "$secs" "$@" >> "$log" 2>&1
    echo "== rc=$? after $SECONDS s of this script" | tee -a "$log"
    tail -n 4 "$log"
}
step "$T_TESTS" "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    tests/test_cuda.py tests/test_device.py tests/test_device_copies.py \
    "tests/test_checkpoint.py::test_worker_state_survives_a_restore"
for part in scale gpu cache; do
    case $part in scale) secs=$T_SCALE ;; gpu) secs=$T_GPU ;; cache) secs=$T_CACHE ;; esac
    # shellcheck disable=SC2086
    step "$secs" "$OUT/bench.log" python3 -m shardps.bench ${BENCH_ARGS:---quick} --only "$part" \
        --out "$OUT/device.json"
done
