#!/usr/bin/env bash
# Run several pytest selections at once, one process each (a "lane"), and report each one's
# summary line and exit status. On the device the GPU tests are bound by CuTe DSL's compiles
# (one CPU core a process, each kernel compiled in the process that runs it), not by the GPU,
# so N lanes on a 16-core machine take about 1/N of the time in series. Not for timings.
#   bash scripts/pytest_lanes.sh "tests/test_a.py -k x" "tests/test_b.py" ...
# Each argument is one lane's pytest arguments (word-split: no quotes inside). Logs go to
# $OUT/lane_N.log (or ./out); the exit status is the first failing lane's, or 0. PYTHON: the
# interpreter (python3).
set -uo pipefail
[[ $# -gt 0 ]] || { echo "usage: pytest_lanes.sh \"PYTEST ARGS\" ..." >&2; exit 2; }
out="${OUT:-out}"
mkdir -p "$out"
pids=()
n=0
for lane in "$@"; do
  n=$((n + 1))
  # shellcheck disable=SC2086  # a lane's arguments are meant to split
  "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider $lane >"$out/lane_$n.log" 2>&1 &
  pids+=($!)
done
status=0
n=0
for pid in "${pids[@]}"; do
  n=$((n + 1))
  wait "$pid"
  rc=$?
  [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
  # the failures' short lines (-ra), then pytest's closing summary
  { grep -E "^(FAILED|ERROR) " "$out/lane_$n.log" | head -5; tail -n 1 "$out/lane_$n.log"; } |
    sed "s/^/lane $n rc=$rc: /"
done
exit "$status"
