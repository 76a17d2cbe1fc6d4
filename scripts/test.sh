#!/usr/bin/env bash
# Installs (see install.sh) and runs the whole CPU test suite; Triton kernels run through Triton's
# interpreter, GPU tests (tests/gpu) skip without a GPU. Then the kernel and runtime tests again under the
# oldest supported torch (scripts/test_oldest_torch.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
set +e
# The GPU script's dry run (a minute) runs once, in the oldest-torch pass below: that pass has the GPU machine's
# torch 2.11 and triton 3.6, the versions the script meets on the GPU.
python3 -m pytest -q -p no:cacheprovider --durations=25 tests \
    --deselect tests/test_gpu_check.py::test_dry_run_runs_every_step_on_the_cpu "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
# The kernel and runtime tests once more under the oldest supported torch, the GPU machine's (torch 2.11 +
# triton 3.6, its own venv).
if [ "$status" -eq 0 ]; then
    bash scripts/test_oldest_torch.sh "$@" || status=$?
fi
exit "$status"
