# Sourced by gpu_check.sh (and by tests/test_gpu_check.py): run one step of the device check under
# its own time limit, keep whatever results it wrote, and say in one line how a step that did not
# end cleanly ended. A device session is minutes long: a benchmark that measured everything and
# then died at exit (issue 23: a segmentation fault at interpreter shutdown) must not cost its
# results, and must not be mistaken for one that ran out of time.

steps_not_clean=()  # one line per step that did not end cleanly, for report_steps

# Whether the JSON file $1 says its step measured everything ("complete": true, written by the
# benchmarks with their last results; they write atomically, so the file is never half written).
results_complete() {
    [ -s "$1" ] && python3 -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("complete") is True else 1)' \
        "$1" 2>/dev/null
}

# run_step NAME SECONDS JSON LOG COMMAND...: COMMAND under `timeout` (SIGTERM after SECONDS, SIGKILL
# 10 s later), its output to the terminal and to LOG. With PYTHONFAULTHANDLER, a Python that dies of
# a signal writes every thread's stack to LOG first: what was still running. (That is how issue 23's
# "SIGSEGV at exit" was found to be oneDNN corrupting the heap in a CPU backward pass, mid-run: see
# learner.to_device.) JSON is where it writes its results ("-": it
# writes none). Returns 0 when COMMAND exited 0, else prints and records one line saying how it
# ended and what became of its results, and returns 1.
# With GPU_CHECK_SMOKE=1 no step has a limit: the limits are the device's budget and mean nothing on
# a CPU shared with other work (torch.compile's smoke step ran past its 100 s beside three test
# workers on 2 cores); the smoke test's own timeout still ends a step that hangs.
run_step() {
    local name=$1 seconds=$2 json=$3 log=$4
    shift 4
    local limit=$seconds
    [ "${GPU_CHECK_SMOKE:-0}" = 1 ] && limit=0  # `timeout 0`: no limit
    PYTHONFAULTHANDLER=1 timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]} how line
    [ "$rc" = 0 ] && return 0
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # 137: still alive 10 s after the SIGTERM
        how="ran out of time ($seconds s)"
    elif [ "$rc" -gt 128 ]; then  # killed by a signal, which timeout passes on as 128 + its number
        how="died (SIG$(kill -l $((rc - 128))), exit $rc)"
    else
        how="failed (exit $rc)"
    fi
    if [ "$json" != - ] && results_complete "$json"; then
        case $how in
            "ran out of time"*) how="did not exit within its $seconds s";;
            died*) how="died at exit ${how#died }";;
            *) how="exited $rc";;
        esac
        line="step $name wrote all its results to $json, then $how; they are kept and used"
    elif [ "$json" != - ] && [ -s "$json" ]; then
        line="step $name $how; its partial results are kept in $json"
    else
        line="step $name $how, with no results; its log is $log"
    fi
    steps_not_clean+=("$line")
    echo "gpu_check: $line" >&2
    return 1
}

# report_steps OUT: exit 1 with a last line when a step did not end cleanly (each one named above).
report_steps() {
    if [ ${#steps_not_clean[@]} -gt 0 ]; then
        echo "gpu_check: ${#steps_not_clean[@]} step(s) did not end cleanly (above); all logs and results are in $1" >&2
        exit 1
    fi
}
