#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine, then builds the kernels extension.
# Idempotent: a second run only rebuilds what changed. Used by main.sh, test.sh and CI.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check \
    "torch==2.14.1" triton numpy matplotlib tqdm pytest scikit-learn ninja setuptools wheel
# optional extras (pipeoptim[hf], pipeoptim[vision]): Hugging Face and torchvision models; their tests skip
# without them, and CI installs them so they run. torchvision must match torch (0.29.1 <-> 2.14.1).
python3 -m pip install --quiet --disable-pip-version-check "transformers==5.24.0" "torchvision==0.29.1"

# The CUDA kernels compile wherever nvcc is found (they run only on a GPU); torch needs CUDA_HOME to
# find it, and a target list when there is no GPU to ask.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
python3 -m pip install --quiet --disable-pip-version-check --no-build-isolation -e .
python3 - <<'PY'
import torch, pipeoptim_kernels as pk
from pipeoptim_kernels import compiled
module = compiled.load()
assert module is not None, "the compiled extension did not build"
print(f"pipeoptim_kernels built: backends {pk.available_backends()}, cpu isa {compiled.cpu_isa()}, "
      f"CUDA kernels compiled in: {module.with_cuda}")
PY
