#!/usr/bin/env bash
# Installs (see install.sh) and runs the main job on its built-in default: `pipeoptim train` trains a small
# GPT on the standard library's source through a 4-stage asynchronous pipeline with PipeOptim and Muon.
# Extra arguments go to `pipeoptim train` (see `pipeoptim train --help`).
# Everything is installed into the python3 first on PATH (about 6 GB with the CUDA build of torch); to keep it
# apart, activate a venv first: python3 -m venv ~/venvs/pipeoptim && . ~/venvs/pipeoptim/bin/activate
set -euo pipefail
cd "$(dirname "$0")/.."
echo "==> scripts/main.sh: installs (scripts/install.sh: about 6 minutes on 2 idle cores once torch is" \
     "downloaded, about 6 GB), then runs pipeoptim train (about 3.5 minutes on 2 cores)"
bash scripts/install.sh
# The main job starts afresh each time (--overwrite replaces the previous main run's checkpoints, history
# and picture in runs/train); pass --resume to continue it instead.
args=("$@")
case " $* " in
    *" --resume "*) ;;
    *) args=(--overwrite "$@") ;;
esac
echo "==> pipeoptim train ${args[*]}"
pipeoptim train "${args[@]}"
