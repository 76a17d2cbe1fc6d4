#!/usr/bin/env bash
# Installs (see install.sh) and runs the main job on its built-in default: `pipeoptim train` trains a small
# GPT on the standard library's source through a 4-stage asynchronous pipeline with PipeOptim.
# Extra arguments go to `pipeoptim train` (see `pipeoptim train --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
pipeoptim train "$@"
