#!/usr/bin/env bash
# Installs (see install.sh) and runs the main job on its built-in default. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 benchmarks/bench_kernels.py "$@"
