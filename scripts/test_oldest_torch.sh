#!/usr/bin/env bash
# The kernel and runtime tests once more under the oldest torch this project supports: torch 2.11.0 with
# triton 3.6.0, what the lent GPU machine has. Only the tests of what a torch version can change run here
# (OLDEST_TORCH_TESTS below: the kernels on every CPU backend and compiled by Triton for sm_90, the
# flat buffers and the predictor, the policies, the runtime on one process and on several over gloo,
# checkpoints, torch's own pipelining runtime, the build, the GPU script's dry run); the schedules, the
# simulator and pictures, the fault drills, the models and the other benchmarks' tests run in the main pass
# only, which keeps CI within its 20 minutes. It runs in a venv cached under the clone (.venv/torch-2.11.0/,
# ignored by git), with the extension built there for that torch (CUDA code for sm_90, the GPU machine's
# target) by setup.py, and loaded from there through PIPEOPTIM_KERNELS_BUILD. scripts/test.sh calls this
# after the main suite; alone (after scripts/install.sh):
#     bash scripts/test_oldest_torch.sh [pytest arguments]
#     bash scripts/test_oldest_torch.sh --prepare   # only the venv and the extension (test.sh runs this early)
#     bash scripts/test_oldest_torch.sh --venv-only # only the venv (test.sh: while the main extension builds)
# The first run downloads torch's CUDA wheel (about 0.5 GB). Importing that torch needs CUDA 13's runtime
# libraries even on a CPU; they are not downloaded again (about 3 GB): the venv links the ones the main
# install's torch (also a CUDA 13 build) brought. Without those, torch's own requirements are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
prepare_only=0 venv_only=0
if [ "${1:-}" = "--prepare" ]; then
    prepare_only=1
    shift
elif [ "${1:-}" = "--venv-only" ]; then
    venv_only=1
    shift
fi

TORCH_VERSION=2.11.0
TRITON_VERSION=3.6.0
VENV=".venv/torch-$TORCH_VERSION"
VPY="$VENV/bin/python"
pip_install() { "$VPY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts "$@"; }

if ! "$VPY" -c "import torch, triton, pytest, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' \
        or triton.__version__ != '$TRITON_VERSION')" 2>/dev/null; then
    echo "setting up $VENV (torch $TORCH_VERSION, triton $TRITON_VERSION)"
    python3 -m venv "$VENV"
    pip_install --no-deps "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
    cuda_libs=$(python3 -c "import nvidia, torch; print(list(nvidia.__path__)[0] if torch.version.cuda else '')" \
        2>/dev/null || true)
    if [ -n "$cuda_libs" ]; then
        # torch's own pure-Python requirements (not its CUDA runtime packages, linked below)
        requirements=$("$VPY" - <<'PY'
from importlib.metadata import requires
for line in requires("torch"):
    spec, _, marker = line.partition(";")
    name = spec.split("[")[0].strip().split("<")[0].split(">")[0].split("=")[0].lower()
    if "extra ==" in marker or name.startswith(("nvidia-", "cuda-", "triton")):
        continue
    print(spec.strip().replace(" ", ""))
PY
)
        # shellcheck disable=SC2086  # one requirement per word
        pip_install $requirements
        ln -sfn "$cuda_libs" "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
    else
        echo "no CUDA 13 runtime libraries beside the main torch: installing torch $TORCH_VERSION's own"
        pip_install "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
    fi
    pip_install numpy matplotlib tqdm pytest scikit-learn ninja setuptools wheel
fi
if [ "$venv_only" -eq 1 ]; then
    echo "$VENV is ready (torch $TORCH_VERSION, triton $TRITON_VERSION)"
    exit 0
fi

# The extension for this torch, in the venv: the same setup.py the GPU machine builds with (it finds the
# CUDA toolkit itself; its first line in the log says which).
export TORCH_CUDA_ARCH_LIST="${OLDEST_TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
start=$(date +%s)
if ! "$VPY" setup.py build_ext --build-temp "$VENV/build/temp" --build-lib "$VENV/build/lib" > "$VENV/build.log" 2>&1; then
    tail -n 60 "$VENV/build.log"
    echo "building the extension under torch $TORCH_VERSION failed (whole log: $VENV/build.log)" >&2
    exit 1
fi
echo "extension for torch $TORCH_VERSION built or current in $(( $(date +%s) - start )) s ($VENV/build.log)"
if [ "$prepare_only" -eq 1 ]; then
    exit 0
fi

export PIPEOPTIM_KERNELS_BUILD="$VENV/build/lib" TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
export PATH="$PWD/$VENV/bin:$PATH"  # subprocesses (python3, gpu_check.sh's steps) use this torch too
"$VPY" -c "import torch, triton, pipeoptim_kernels as pk; print(f'torch {torch.__version__}, triton \
{triton.__version__}: backends {pk.available_backends()}')"
OLDEST_TORCH_TESTS=(tests/test_kernels_*.py tests/test_triton_backend.py tests/test_triton_targets.py
                    tests/test_build.py tests/test_flat.py tests/test_predictor.py tests/test_policies.py
                    tests/test_runtime.py tests/test_checkpoint.py tests/test_torch_pipelining_csv.py
                    tests/test_gpu_check.py)
# Not here: the kernels' environment-variable tests (a process each, ~2 s; they test parsing in our C++, the same
# source whatever torch it is built against), and Triton's sm_80 target (the GPU machine is an sm_90; the main pass
# compiles both with the newest Triton; ~50 s). A -k of the caller's replaces this one.
set +e
"$VPY" -m pytest -q -p no:cacheprovider --durations=15 "${OLDEST_TORCH_TESTS[@]}" \
    -k "not from_the_environment and not in_the_environment and not (triton_targets and 80)" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
exit "$status"
