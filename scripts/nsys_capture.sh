#!/usr/bin/env bash
# Nsight Systems capture of a few steady-state decode steps, graph nodes traced one by one,
# then the kernel and NVTX summaries of the captured steps.
#   scripts/nsys_capture.sh [REPORT] [-- args for scripts/nsys_steps.py]
#   scripts/nsys_capture.sh --which          (print the nsys it would use, exit 2 if none)
# nsys is $NSYS, else the one on the PATH, else the newest in Nsight Compute's folder
# ($NSIGHT_COMPUTE_ROOT, default /opt/nvidia/nsight-compute: <version>/host/target-linux-x64/nsys,
# as on the H200 image). Turning the capture into a report needs libdw.so.1 and libelf.so.1:
# on the H200, ../shared/device/fetch-nsys-deps once, then `source .device/bootstrap.sh`.
# Only the steps inside nsys_steps.py's cudaProfilerApi range are recorded (each replay one
# NVTX range; with --eager-steps, each eager step one range and each stage one range inside).
# Time limits (s): NSYS_PROFILE_TIMEOUT (default 60) and NSYS_STATS_TIMEOUT (default 30).
set -uo pipefail
cd "$(dirname "$0")/.."

find_nsys() {
  if [[ -n "${NSYS:-}" ]]; then
    [[ -x "$NSYS" ]] && { echo "$NSYS"; return 0; }
    echo "nsys_capture: NSYS=$NSYS is not an executable file" >&2
    return 1
  fi
  if command -v nsys >/dev/null 2>&1; then
    command -v nsys
    return 0
  fi
  local found
  found=$(ls -d "${NSIGHT_COMPUTE_ROOT:-/opt/nvidia/nsight-compute}"/*/host/target-linux-x64/nsys 2>/dev/null \
    | sort -V | tail -1)
  [[ -n "$found" && -x "$found" ]] && { echo "$found"; return 0; }
  echo "nsys_capture: Nsight Systems (nsys) was not found: not in NSYS, not on the PATH, not in" \
    "${NSIGHT_COMPUTE_ROOT:-/opt/nvidia/nsight-compute}/*/host/target-linux-x64/; install it or set NSYS=/path/to/nsys" >&2
  return 1
}

if [[ "${1:-}" == "--which" ]]; then
  find_nsys || exit 2
  exit 0
fi
report="${1:-graphstep-steps}"
shift || true
[[ "${1:-}" == "--" ]] && shift
nsys=$(find_nsys) || exit 2
# bootstrap.sh unpacks libdw/libelf into /tmp/nsys-deps; add them here too if it was not sourced
deps=/tmp/nsys-deps/usr/lib/x86_64-linux-gnu
if [[ -d "$deps" && ":${LD_LIBRARY_PATH:-}:" != *":$deps:"* ]]; then
  export LD_LIBRARY_PATH="$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
echo "nsys_capture: $nsys ($("$nsys" --version 2>/dev/null | head -1))"
rm -f "$report.nsys-rep" "$report.sqlite" "$report.qdstrm"
started=$SECONDS
timeout -s INT -k 10 "${NSYS_PROFILE_TIMEOUT:-60}" "$nsys" profile \
  --trace=cuda,nvtx --sample=none --cpuctxsw=none --backtrace=none --cuda-graph-trace=node \
  --capture-range=cudaProfilerApi --capture-range-end=stop --force-overwrite=true -o "$report" \
  "${PYTHON:-python3}" scripts/nsys_steps.py "$@"
rc=$?
echo "nsys_capture: nsys profile exited $rc after $((SECONDS - started)) s"
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "nsys_capture: nsys profile ran past ${NSYS_PROFILE_TIMEOUT:-60} s (NSYS_PROFILE_TIMEOUT) and was stopped" >&2
fi
if [[ ! -f "$report.nsys-rep" ]]; then
  echo "nsys_capture: no $report.nsys-rep was written (see nsys's output above)" >&2
  if compgen -G "$report*.qdstrm" >/dev/null; then
    echo "nsys_capture: a .qdstrm is there but not imported: the import needs libdw.so.1 and libelf.so.1; on the" \
      "H200 run ../shared/device/fetch-nsys-deps once, then 'source .device/bootstrap.sh' (sets LD_LIBRARY_PATH, NSYS)" >&2
  else
    echo "nsys_capture: no capture either: did nsys_steps.py reach torch.cuda.profiler.start()?" >&2
  fi
  exit 1
fi
echo "nsys_capture: report written to $(realpath "$report.nsys-rep")"
started=$SECONDS
stats() {  # stats REPORT_NAME: one nsys stats table of the capture (the first call exports the .sqlite)
  timeout -k 5 "${NSYS_STATS_TIMEOUT:-30}" "$nsys" stats --report "$1" --format table "$report.nsys-rep" 2>&1 \
    | grep -v "^Generating SQLite\|^Processing \["
}
kernels=$(stats cuda_gpu_kern_sum)
echo "$kernels"
stats nvtx_sum
echo "nsys_capture: summaries in $((SECONDS - started)) s"
if [[ "$kernels" != *"Time (%)"* ]]; then
  echo "nsys_capture: nsys stats printed no kernel table (see above)" >&2
  exit 1
fi
[[ $rc -eq 0 ]] || exit 1
