#!/usr/bin/env bash
# Nsight Systems capture of a few steady-state decode steps, graph nodes traced one by one.
#   scripts/nsys_capture.sh [REPORT] [-- args for scripts/nsys_steps.py]
# NSYS=/path/to/nsys overrides the nsys on the PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
report="${1:-graphstep-steps}"
shift || true
[[ "${1:-}" == "--" ]] && shift
nsys="${NSYS:-$(command -v nsys || true)}"
if [[ -z "$nsys" || ! -x "$nsys" ]]; then
  echo "nsys_capture: Nsight Systems (nsys) was not found on the PATH; install it or set NSYS=/path/to/nsys" >&2
  exit 2
fi
"$nsys" profile --capture-range=cudaProfilerApi --capture-range-end=stop --cuda-graph-trace=node \
  --trace=cuda,nvtx --force-overwrite=true -o "$report" python3 scripts/nsys_steps.py "$@"
if [[ -f "$report.nsys-rep" ]]; then
  echo "nsys_capture: report written to $(realpath "$report.nsys-rep")"
else
  echo "nsys_capture: nsys ran but wrote no $report.nsys-rep (see its output above)" >&2
  exit 1
fi
