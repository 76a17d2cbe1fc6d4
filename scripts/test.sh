#!/usr/bin/env bash
# Installs (see install.sh) and runs the whole CPU test suite; Triton kernels run through Triton's
# interpreter, GPU tests (tests/gpu) skip without a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
set +e
python3 -m pytest -q -p no:cacheprovider tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
exit "$status"
