#!/usr/bin/env bash
# Nsight Compute on the kernels whose names match a regex, while a command runs; prints
# what bounds each (throughputs, hit rates, stalls). Kernel names carry their stage
# (index_query, dsa_index, sparse_core_partial, ...), so a stage is easy to pick:
#   bash scripts/ncu_kernels.sh 'index_query|dsa_index' 4 -- python3 bench/bench_indexer.py --context 32768 --batch 1
# (REGEX, launches to profile after SKIP (default 2) warm-up ones, then the command). Report in $OUT (or ./out).
set -uo pipefail
[[ $# -ge 4 && "$3" == "--" ]] || { echo "usage: $0 REGEX COUNT -- COMMAND..."; exit 2; }
regex=$1 count=$2
shift 3
out="${OUT:-out}"
mkdir -p "$out"
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$ncu_bin" ]] || { echo "ncu not found"; exit 2; }
"$ncu_bin" --clock-control none --target-processes all --kernel-name "regex:$regex" --launch-skip "${SKIP:-2}" --launch-count "$count" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
  -f -o "$out/kernels" "$@" >"$out/ncu_run.log" 2>&1 || { tail -20 "$out/ncu_run.log"; exit 1; }
"$ncu_bin" -i "$out/kernels.ncu-rep" --page details --print-units base >"$out/ncu_details.txt"
grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|Stall|Dynamic Shared|Block Limit" \
  "$out/ncu_details.txt" | head -"${LINES_MAX:-120}"
# where the warps wait: each kernel's stall reasons (warps stalled per issued instruction, >= 0.05),
# and how busy each pipe was (% of its peak over the SMs' active cycles, >= 1%)
"$ncu_bin" -i "$out/kernels.ncu-rep" --page raw --print-units base >"$out/ncu_raw.txt"
awk '/, Context [0-9]+, Stream [0-9]+/ {print "  " substr($1, 1, 60)} /issue_stalled_.*_per_issue_active.ratio/ {
  name = $1; sub(/smsp__average_warps_issue_stalled_/, "", name); sub(/_per_issue_active.ratio/, "", name)
  if ($NF + 0 >= 0.05) printf "    stall %-22s %s\n", name, $NF }
  /sm__pipe_.*_cycles_active.avg.pct_of_peak_sustained_active/ {
  name = $1; sub(/sm__pipe_/, "", name); sub(/_cycles_active.avg.pct_of_peak_sustained_active/, "", name)
  if ($NF + 0 >= 1) printf "    pipe %-23s %s%%\n", name, $NF }' "$out/ncu_raw.txt" | head -"${LINES_MAX:-120}"
