#!/usr/bin/env bash
# Installs everything the project needs into the python3 first on PATH (a venv if one is active: see the
# README's "Set-up"), then builds the kernels extension. Says what each step does and about how long it takes.
# Idempotent: a second run only rebuilds what changed. Used by main.sh, test.sh and CI.
#     bash scripts/install.sh                    # the packages, then the extension
#     bash scripts/install.sh --packages-only    # the packages alone, then
#     bash scripts/install.sh --extension-only   # the extension alone (test.sh sets up the oldest torch's venv,
#                                                # which needs the packages, while the extension builds)
set -euo pipefail
cd "$(dirname "$0")/.."
packages=1 extension=1
case "${1:-}" in
    "") ;;
    --packages-only) extension=0 ;;
    --extension-only) packages=0 ;;
    *) echo "usage: bash scripts/install.sh [--packages-only | --extension-only]" >&2; exit 2 ;;
esac
START=$(date +%s)
step() { echo "==> [$(( $(date +%s) - START )) s] $*"; }
PIP=(python3 -m pip install --disable-pip-version-check)

if [ "$packages" -eq 1 ]; then
    step "installing into $(python3 -c 'import sys; print(sys.prefix)') ($(python3 -c 'import sys; print(sys.executable)')):" \
         "torch 2.14.1 with its CUDA 13 libraries and triton (about 5.5 GB), numpy, matplotlib, tqdm, pytest," \
         "scikit-learn, ninja; minutes on a fresh machine, seconds once installed"
    "${PIP[@]}" "torch==2.14.1" triton numpy matplotlib tqdm pytest scikit-learn ninja setuptools wheel \
        | { grep -v '^Requirement already satisfied' || true; }  # (pip's own failure still stops the script)
    # optional extras (pipeoptim[hf], pipeoptim[vision]): Hugging Face and torchvision models; their tests skip
    # without them, and CI installs them so they run. torchvision must match torch (0.29.1 <-> 2.14.1).
    step "installing the optional extras transformers 5.24.0, torchvision 0.29.1, pyarrow 26.0.1 and datasets 5.2.0 (about 0.2 GB)"
    "${PIP[@]}" --quiet "transformers==5.24.0" "torchvision==0.29.1" "pyarrow==26.0.1" "datasets==5.2.0"
    # the documentation site (mkdocs.yml): tests/test_docs.py builds it with --strict
    step "installing the documentation tools mkdocs, mkdocs-material and mkdocstrings[python] (about 0.02 GB)"
    "${PIP[@]}" --quiet mkdocs mkdocs-material "mkdocstrings[python]"
fi
if [ "$extension" -eq 0 ]; then
    step "packages installed (--packages-only: the extension is not built)"
    exit 0
fi

# The CUDA kernels compile wherever a CUDA toolkit is found (they run only on a GPU): setup.py finds it as
# torch does (CUDA_HOME, else the nvcc on PATH, seen through wrapper scripts, else /usr/local/cuda), checks
# it and says which it took, or warns once and builds the CPU kernels alone. A target list is needed when
# there is no GPU to ask.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
mkdir -p build
LOG=build/install.log
step "building the kernels extension (pip install --no-build-isolation -e .; MAX_JOBS=$MAX_JOBS," \
     "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST): minutes (this whole script took 5.6 on 2 idle cores" \
     "with CUDA; up to 20 on loaded ones); a line per compile step as it ends, the whole log in $LOG"
# pip shows a build's output only with -v; of that, the build's own lines and one line per compile step
if ! "${PIP[@]}" -v --no-build-isolation -e . 2>&1 | tee "$LOG" | awk -v start="$START" '
        /pipeoptim_kernels:/ { sub(/^ +/, ""); print; fflush(); next }
        /^ *\[[0-9]+\/[0-9]+\] / {
            src = ""
            for (i = 1; i < NF; i++) if ($i == "-c") src = $(i + 1)
            sub(/.*\/csrc\//, "csrc/", src)
            match($0, /\[[0-9]+\/[0-9]+\]/)
            printf "    %s %s compiled (at %d s)\n", substr($0, RSTART, RLENGTH), src, systime() - start; fflush()
        }'; then
    tail -n 40 "$LOG"
    echo "building the extension failed (the whole log: $LOG)" >&2
    exit 1
fi
step "checking the build"
python3 - <<'PY'
import torch, pipeoptim_kernels as pk
from pipeoptim_kernels import compiled
module = compiled.load()
assert module is not None, "the compiled extension did not build"
print(f"pipeoptim_kernels built: backends {pk.available_backends()}, cpu isa {compiled.cpu_isa()}, "
      f"CUDA kernels compiled in: {module.with_cuda}")
PY
step "installed"
