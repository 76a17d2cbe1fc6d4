#!/usr/bin/env bash
# One script for the lent GPU machine (no network, torch and triton preinstalled there): build the
# extension for sm_80/sm_90, run the GPU tests and the kernel CPU tests, benchmark the kernels on the
# GPU, and print a short table last. Budget: about 8 minutes. Results land in $OUT (or benchmarks/results).
#     bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
log="$out_dir/gpu_check.log"
exec > >(tee "$log") 2>&1

echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

echo "== build (setup.py build_ext --inplace, no pip: there is no network)"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" TORCH_CUDA_ARCH_LIST="8.0;9.0" MAX_JOBS="$(nproc)"
start=$(date +%s)
timeout 300 python3 setup.py build_ext --inplace > "$out_dir/gpu_build.log" 2>&1 || { tail -40 "$out_dir/gpu_build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0

echo "== GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -x 2>&1 | tail -15
tests_status=${PIPESTATUS[0]}

echo "== GPU benchmark"
timeout 240 python3 benchmarks/bench_kernels.py --device cuda --sizes 64M,256M,1G --rules adam,adamw,sgd,rmsprop \
    --rounds 10 --out "$out_dir/kernels_cuda.csv" 2>&1 | tail -20
bench_status=${PIPESTATUS[0]}

echo "== summary: tests exit $tests_status, benchmark exit $bench_status (table above: ratios from one run)"
exit $(( tests_status != 0 || bench_status != 0 ))
