#!/usr/bin/env bash
# The one check for a lent GPU (an H200 with torch 2.11 + triton 3.6 + nvcc 13.0 preinstalled, 16 cores,
# no network): build the extension, run tests/gpu, benchmark the kernels, run the runtime on the GPU and
# time its emulated step against the plain one.
# Each step is one line of the step runner (benchmarks/step_runner.sh): its own time limit, its CSV
# under $OUT, its output in $OUT/log.txt, a row in $OUT/steps.csv and $OUT/summary.txt rewritten as it
# ends (8 files in all: as many as the device tool returns), so a step
# that fails or times out keeps what the others made. The limits add to 545 s and the runner cuts the
# last ones to a 560-s total: give the device command timeout_s=590. (The H200's run of 2026-12-04 took
# 170 s for the first five steps.)
#
#     bash benchmarks/gpu_check.sh              # on the GPU machine; results in $OUT (default /tmp/gpu_check)
#     bash benchmarks/gpu_check.sh --dry-run    # on a CPU: every step in its --device cpu --quick form
#
# The dry run is what tests/test_gpu_check.py runs in CI, so that no typo reaches the GPU: the tests run
# on CPU tensors (tests/gpu/conftest.py), the benchmarks with --device cpu --quick, and the build step
# only checks that the extension is built and current (it never compiles: the CI's own builds cover
# that, under torch 2.14 and 2.11). STEP_SKIP="name:reason" skips a step, saying why in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/step_runner.sh

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
elif [ -n "${1:-}" ]; then
    echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2
    exit 2
fi
OUT="${OUT:-/tmp/gpu_check}"
export PY=python3 DRY OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
    export DEV=cpu QUICK=--quick TRITON_INTERPRET=1 PIPEOPTIM_GPU_TESTS_ON_CPU=1 KERNEL_SIZES=""
    export PEER_ARGS="--models tiny --rounds 2 --warmup 1"
    export STEP_LIMIT_SCALE="${STEP_LIMIT_SCALE:-4}"  # the CPU forms are not sized to the GPU's minutes
    STEPS_TITLE="gpu_check dry run on the CPU"
else
    export DEV=cuda QUICK="" TRITON_INTERPRET=0 PIPEOPTIM_GPU_TESTS_ON_CPU=0 KERNEL_SIZES="--sizes 256M,1G --rounds 5"
    # issue 23's emulated rows on the GPU, where a stage's forward takes microseconds and the runtime's own work per
    # action shows most: an emulated 1F1B step against the plain step and the staged floor (~40 s on an H200)
    export PEER_ARGS="--models tiny gpt --rounds 40 --warmup 5"
    STEPS_TITLE="gpu_check on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
fi
# the toolkit setup.py builds with (the nvcc on PATH seen through wrapper scripts: pipeoptim_kernels/_build.py)
export CUDA_HOME="${CUDA_HOME:-$("$PY" -c 'from pipeoptim_kernels._build import cuda_home; print(cuda_home() or "")')}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# The machine and the versions, as CSV.
report_env() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
        || { [ "$DRY" = 1 ] && echo "no GPU: a dry run"; }
    "$PY" - <<'PY'
import csv, os, platform, subprocess, sys
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "absent"
nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:] \
    if os.path.exists(nvcc) else ["absent"]
rows = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton_version, "nvcc": nvcc_version[0], "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "TORCH_CUDA_ARCH_LIST": os.environ["TORCH_CUDA_ARCH_LIST"], "dry_run": os.environ["DRY"]}
with open(os.path.join(os.environ["OUT"], "env.csv"), "w", newline="") as f:
    csv.writer(f).writerows([("key", "value"), *rows.items()])
for k, v in rows.items():
    print(f"{k}: {v}")
if os.environ["DRY"] != "1" and not torch.cuda.is_available():
    sys.exit("torch sees no GPU: use --dry-run on a machine without one")
PY
}

# Build in place unless the extension is current (never in a dry run), then check what it offers.
build_extension() {
    local reason start rebuilt=no seconds=0
    if reason=$("$PY" -c "from pipeoptim_kernels._build import stale_reason as s; r = s(); print(r or ''); raise SystemExit(1 if r else 0)"); then
        echo "the extension is current for this torch and TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST: not rebuilt"
    elif [ "$DRY" = 1 ]; then
        echo "a dry run does not build, and the extension here needs it: $reason (run bash scripts/install.sh)"
        return 1
    else
        echo "building ($reason) with $MAX_JOBS jobs for $TORCH_CUDA_ARCH_LIST, CUDA_HOME=$CUDA_HOME"
        start=$(date +%s)
        "$PY" setup.py build_ext --inplace || return 1
        rebuilt=yes
        seconds=$(( $(date +%s) - start ))
        echo "built in $seconds s"
    fi
    printf 'build_rebuilt,%s\nbuild_seconds,%s\nbuild_jobs,%s\n' "$rebuilt" "$seconds" "$MAX_JOBS" >> "$OUT/env.csv"
    "$PY" -c "
import pipeoptim_kernels as pk
backends = pk.available_backends()
print('backends:', backends)
want = {'cuda', 'triton'} if '$DEV' == 'cuda' else {'cpu'}
assert want <= set(backends), f'missing {want - set(backends)}'
"
}
export -f report_env build_extension

steps_begin "$OUT" 560
run_step env        30 'report_env'
run_step build     150 'build_extension'
run_step tests_gpu 120 'PIPEOPTIM_GPU_TESTS_CSV=$OUT/tests_gpu.csv $PY -m pytest -q -p no:cacheprovider tests/gpu'
run_step kernels    90 '$PY benchmarks/bench_kernels.py --device $DEV $QUICK $KERNEL_SIZES --rules adam,sgd --out $OUT/kernels_$DEV.csv --no-plot'
run_step runtime    90 '$PY benchmarks/bench_large.py --device $DEV $QUICK --mode emulate --policies pipeoptim,none --timeout-s 55 --csv $OUT/large.csv'
run_step runtime_peer 65 '$PY benchmarks/bench_runtime_peer.py --emulated-only --device $DEV $PEER_ARGS --microbatches 8 --csv $OUT/runtime_peer.csv'
steps_end
