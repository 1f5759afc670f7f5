# Sourced by the GPU stage scripts (gpu_run.sh, gpu_prefill_bench.sh): `stage NAME SECONDS
# CMD...` runs CMD under a time limit, its output into $RESULTS/NAME.log, shows the log's
# tail and records a failing exit status in $rc.
stage() {
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local r=$?
    tail -n 40 "$RESULTS/$name.log"
    echo "=== $name: exit $r after $(( $(date +%s) - t0 ))s"
    [ $r -eq 0 ] || rc=$r
}
