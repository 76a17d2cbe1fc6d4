# A step runner for scripts that must finish inside a hard time limit (benchmarks/gpu_check.sh), sourced:
#
#     source benchmarks/step_runner.sh
#     steps_begin "$OUT" 560            # results folder, seconds for all the steps together
#     run_step NAME LIMIT 'COMMAND'      # COMMAND runs in bash, its output in $OUT/log.txt
#     steps_end                          # exit status: 0 when every step that ran succeeded
#
# Each step gets its own time limit, cut to what is left of the total so the summary is always
# written in time. Every step's output goes to $OUT/log.txt as it runs (one file for all: the GPU
# machine returns at most 8 files). As each step ends, a row goes to $OUT/steps.csv and
# $OUT/summary.txt is rewritten, so a step that fails, times out or is killed with the whole command
# loses nothing the earlier steps wrote. STEP_SKIP="name:reason;name:reason" skips the named steps and
# says why in the summary; STEP_LIMIT_SCALE=k multiplies every limit and the total (a dry run on a
# slower machine).

steps_begin() {
    STEPS_OUT=$1
    STEPS_SCALE=${STEP_LIMIT_SCALE:-1}
    STEPS_BUDGET=$(( $2 * STEPS_SCALE ))
    STEPS_T0=$(date +%s)
    STEPS_FAILED=0
    STEPS_LOGS=$(mktemp -d)
    mkdir -p "$STEPS_OUT"
    : > "$STEPS_OUT/log.txt"
    echo "step,status,exit_code,seconds,limit_s" > "$STEPS_OUT/steps.csv"
    _steps_summary
}

_skip_reason() {  # the reason STEP_SKIP gives for step $1, if any
    local entry
    IFS=';' read -ra _entries <<< "${STEP_SKIP:-}"
    for entry in "${_entries[@]}"; do
        if [ "${entry%%:*}" = "$1" ]; then
            echo "${entry#*:}"
            return 0
        fi
    done
    return 1
}

run_step() {
    local name=$1 limit=$(( $2 * STEPS_SCALE )) command=$3 reason status rc start seconds left
    local log="$STEPS_LOGS/$name.log"
    if reason=$(_skip_reason "$name"); then
        echo "== $name: skipped ($reason)"
        echo "$name,skipped: ${reason//,/;},,0,$limit" >> "$STEPS_OUT/steps.csv"
        _steps_summary
        return 0
    fi
    left=$(( STEPS_BUDGET - ($(date +%s) - STEPS_T0) - 5 ))
    if [ "$left" -lt "$limit" ]; then
        limit=$left
    fi
    if [ "$limit" -le 0 ]; then
        echo "== $name: not run, no time left of the ${STEPS_BUDGET} s"
        echo "$name,not run: no time left,,0,0" >> "$STEPS_OUT/steps.csv"
        STEPS_FAILED=1
        _steps_summary
        return 0
    fi
    echo "== $name (limit ${limit} s, t=$(( $(date +%s) - STEPS_T0 )) s)"
    start=$(date +%s)
    echo "===== $name (limit ${limit} s)" >> "$STEPS_OUT/log.txt"
    timeout --kill-after=5 "$limit" bash -c "$command" 2>&1 | tee -a "$STEPS_OUT/log.txt" > "$log"
    rc=${PIPESTATUS[0]}
    seconds=$(( $(date +%s) - start ))
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out" ;;
        *) status=failed ;;
    esac
    [ "$rc" -eq 0 ] || STEPS_FAILED=1
    echo "$name,$status,$rc,$seconds,$limit" >> "$STEPS_OUT/steps.csv"
    tail -n 8 "$log" | sed 's/^/    /'
    echo "   -> $status in ${seconds} s"
    _steps_summary
    return 0
}

_steps_summary() {  # summary.txt from steps.csv and the last lines of each step's log
    {
        echo "${STEPS_TITLE:-steps} ($(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - STEPS_T0 )) s of ${STEPS_BUDGET} s)"
        local ran="" failed="" timed="" skipped="" name status rest
        while IFS=, read -r name status rest; do
            [ "$name" = step ] && continue
            case $status in
                ok) ran="$ran $name" ;;
                "timed out") ran="$ran $name"; timed="$timed $name" ;;
                failed) ran="$ran $name"; failed="$failed $name" ;;
                *) skipped="$skipped $name (${status})" ;;
            esac
        done < "$STEPS_OUT/steps.csv"
        echo "ran:${ran:- none}"
        echo "failed:${failed:- none}"
        echo "timed out:${timed:- none}"
        echo "skipped or not run:${skipped:- none}"
        echo
        column -s, -t < "$STEPS_OUT/steps.csv" 2>/dev/null || cat "$STEPS_OUT/steps.csv"
        for log in "$STEPS_LOGS"/*.log; do
            [ -e "$log" ] || continue
            echo
            echo "--- $(basename "$log") (last lines)"
            tail -n 12 "$log"
        done
    } > "$STEPS_OUT/summary.txt"
}

steps_end() {
    _steps_summary
    echo
    sed -n '1,5p' "$STEPS_OUT/summary.txt"
    return "$STEPS_FAILED"
}
