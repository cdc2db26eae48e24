#!/usr/bin/env bash
# Run several pytest selections at once, one process each (a "lane"), and report each one's
# failures, closing summary and exit status. On the device the GPU tests are bound by CuTe
# DSL's compiles (one CPU core a process, each kernel compiled in the process that runs it),
# not by the GPU, so N lanes on a 16-core machine take about 1/N of the time in series. Not
# for timings.
#   bash scripts/pytest_lanes.sh "tests/test_a.py -k 'x or y'" "tests/test_b.py" ...
#   bash scripts/pytest_lanes.sh --shards N "-m gpu tests"   # one selection cut into N lanes
# Each argument is one lane's pytest arguments (shell words: quotes inside work). --shards N:
# N lanes of the one selection, lane i with GRAPHSTEP_TEST_SHARD=i/N (conftest.py: contiguous
# runs, so a parametrized test's cases mostly share one process's compiled kernels). Logs go
# to $OUT/lane_N.log (or ./out); the exit status is the first failing lane's, or 0. PYTHON:
# the interpreter (python3).
set -uo pipefail
usage() { echo "usage: pytest_lanes.sh \"PYTEST ARGS\" ... | --shards N \"PYTEST ARGS\"" >&2; exit 2; }
shards=0
if [[ "${1:-}" == --shards ]]; then
  [[ $# -eq 3 && "$2" =~ ^[1-9][0-9]*$ ]] || usage
  shards=$2
  lanes=()
  for ((i = 0; i < shards; i++)); do lanes+=("$3"); done
  set -- "${lanes[@]}"
fi
[[ $# -gt 0 ]] || usage
out="${OUT:-out}"
mkdir -p "$out"
pids=()
n=0
for lane in "$@"; do
  shard=""
  ((shards > 0)) && shard="$n/$shards"
  n=$((n + 1))
  (
    eval "set -- $lane"
    GRAPHSTEP_TEST_SHARD="$shard" exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
  ) >"$out/lane_$n.log" 2>&1 &
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
