#!/usr/bin/env bash
# Installs (see install.sh) and runs the whole CPU test suite; Triton kernels run through Triton's
# interpreter, GPU tests (tests/gpu) skip without a GPU; and the kernel and runtime tests again under the
# oldest supported torch (scripts/test_oldest_torch.sh). Extra arguments go to pytest.
#
# Two lanes run at once, to keep CI within its 20 minutes on 2 cores: the main pass, and beside it the
# preparation of the oldest torch's venv and extension (one compile job), the fault drills
# (tests/test_faults.py, test_cli_train_faults.py, test_multinode.py), which spend most of their time waiting
# for watchdogs and signals to act, with the Triton targets' compile after them (tests/test_triton_targets.py,
# about a minute: there it balances the two lanes), and the oldest torch's pass. The second lane's output is
# printed after the main pass's; one drill runs alone at the end (ALONE below). The oldest torch's venv is set up
# earlier still, while the main extension compiles: the second lane is the longer one.
#
# Both passes launch their multi-process jobs with PIPEOPTIM_LAUNCH_METHOD=forkserver: the workers are forked
# from a server that imported torch once, where spawn spends ~3 s of CPU importing torch in every worker
# (tests/test_runtime.py: 110 CPU-seconds with spawn, 68 with it; the whole CI 36 minutes of user CPU against 23). The
# fault drills keep spawn, the default users run; tests/test_launcher.py checks both methods.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
lane_log=build/test_lane_drills.log
# The packages first; then the oldest torch's venv (pip alone, about 100 s: the second lane's first step, which
# needs the packages' torch to find its CUDA libraries) is set up while the extension compiles.
bash scripts/install.sh --packages-only
(
    echo "==> the oldest torch's venv, set up while the extension builds (scripts/test_oldest_torch.sh --venv-only)"
    bash scripts/test_oldest_torch.sh --venv-only || echo "(the second lane sets it up again and says why it failed)"
) > "$lane_log" 2>&1 &
venv=$!
bash scripts/install.sh --extension-only
wait "$venv"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
DRILLS=(tests/test_faults.py tests/test_cli_train_faults.py tests/test_multinode.py)
SECOND_LANE=("${DRILLS[@]}" tests/test_triton_targets.py)  # run by the second lane in this torch, not the main pass
# a drill whose watchdog is 4 s: it runs alone, after both lanes, so that no other job's load can delay a rank that
# much
ALONE=tests/test_faults.py::test_a_rank_frozen_at_start_up_is_named_within_the_bound
(
    set +e
    echo "==> preparing the oldest torch's venv and extension (scripts/test_oldest_torch.sh --prepare)"
    MAX_JOBS=1 bash scripts/test_oldest_torch.sh --prepare
    echo "==> the fault drills, then the Triton targets: ${SECOND_LANE[*]}"
    python3 -m pytest -q -p no:cacheprovider --durations=10 "${SECOND_LANE[@]}" --deselect "$ALONE" "$@"
    drills=$?
    # no drill collected (a -k that matches none) is fine here: the main pass says whether anything ran
    [ "$drills" -eq 5 ] && drills=0
    # The kernel and runtime tests once more under the oldest supported torch, the GPU machine's (torch 2.11 +
    # triton 3.6, its own venv).
    echo "==> the oldest torch's pass (scripts/test_oldest_torch.sh)"
    PIPEOPTIM_LAUNCH_METHOD=forkserver bash scripts/test_oldest_torch.sh "$@"
    oldest=$?
    [ "$drills" -eq 0 ] && drills=$oldest
    exit "$drills"
) >> "$lane_log" 2>&1 &
lane=$!
set +e
# The GPU script's dry run (a minute) runs once, in the second lane's oldest-torch pass: that pass has the GPU machine's
# torch 2.11 and triton 3.6, the versions the script meets on the GPU.
PIPEOPTIM_LAUNCH_METHOD=forkserver python3 -m pytest -q -p no:cacheprovider --durations=25 tests \
    --deselect tests/test_gpu_check.py::test_dry_run_runs_every_step_on_the_cpu \
    "${SECOND_LANE[@]/#/--ignore=}" "$@"
status=$?
wait "$lane"
drills=$?
set -e
echo "==> the second lane (the oldest torch prepared, the fault drills and the Triton targets, the oldest" \
     "torch's pass), whose output follows: exit status $drills"
cat "$lane_log"
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
[ "$status" -eq 0 ] && status=$drills
if [ "$status" -eq 0 ]; then
    echo "==> alone: $ALONE"
    python3 -m pytest -q -p no:cacheprovider "$ALONE" "$@" || { s=$?; [ "$s" -eq 5 ] || status=$s; }
fi
exit "$status"
