#!/usr/bin/env bash
# The checks and figures that only a machine with a CUDA device and 16 cores can give: the
# CUDA tests and the bench's `gpu` and `cache` parts, then (a second call) its `scale` part.
#
#   bash scripts/gpu-machine.sh                  # tests, gpu, cache: about 6 minutes
#   PARTS=scale bash scripts/gpu-machine.sh      # scale: about 6 minutes more
#
# Writes into $OUT (default bench/results/gpu-machine): env.txt (versions, cores, GPU),
# tests.log, bench.log (the parts' progress lines) and device.json (+ device.meta.json), the
# parts' figures merged as `python -m shardps.tools.bench --only PART --out` does.
#
# Without an installed shardps (a bare machine with PyTorch, numpy and numba), put the other
# wheels it needs in .whl/ (grpcio, protobuf, grpcio-health-checking, grpcio-reflection,
# uhashring, prometheus-client, cryptography, cffi, pycparser, for that machine's Python): they
# go to /tmp/site, and the source tree's packages are linked where the installed names expect.
# PARTS (default "tests gpu cache"), BENCH_ARGS (default --quick; e.g. --scale-points 8x4) and
# LIMITS ("tests scale gpu cache" seconds) tune a run. On an H100 with 16 cores: pytest 66 s;
# gpu 117 s to its 2-worker point at batch 4096 (both batches, 1, 2 and 4 workers: about 190 s);
# cache 85 s; scale 153 s to its 4x4 point; on an H200, the 8x4 point alone 79 s. A part cut
# at its limit writes no figures, hence two calls: one call's command may run 10 minutes.
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
read -r T_TESTS T_SCALE T_GPU T_CACHE <<< "${LIMITS:-90 500 220 110}"
PARTS=${PARTS:-tests gpu cache}
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
for part in $PARTS; do
    case $part in
        tests)
            step "$T_TESTS" "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
                tests/test_cuda.py tests/test_device.py tests/test_device_copies.py \
                "tests/test_checkpoint.py::test_worker_state_survives_a_restore"
            continue ;;
        scale) secs=$T_SCALE ;;
        gpu) secs=$T_GPU ;;
        cache) secs=$T_CACHE ;;
        *) echo "unknown part $part (tests, scale, gpu, cache)" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    step "$secs" "$OUT/bench.log" python3 -m shardps.tools.bench ${BENCH_ARGS:---quick} --only "$part" \
        --out "$OUT/device.json"
done
