#!/usr/bin/env bash
# Nsight Compute on SparseCore's kernels (one eager launch per config and batch), the
# summary of what bounds each: bash scripts/ncu_sparse_core.sh [CONFIGS] [BATCHES] [BENCH ARGS...]
# (e.g. --probes no_math,no_loads --probe-batch 64: the producer or the consumers alone)
set -uo pipefail
configs="${1:-tp8-bf16,tp8-fp8,tp1-fp8}" batches="${2:-1,64}"
shift $(($# < 2 ? $# : 2))
out="${OUT:-out}"
mkdir -p "$out"
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$ncu_bin" ]] || { echo "ncu not found"; exit 2; }
"$ncu_bin" --profile-from-start off --clock-control none --target-processes all \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum \
  -f -o "$out/sparse_core" python3 bench/bench_sparse_core.py --profile --configs "$configs" \
  --batch "$batches" "$@" >"$out/ncu_run.log" 2>&1 || { tail -20 "$out/ncu_run.log"; exit 1; }
"$ncu_bin" -i "$out/sparse_core.ncu-rep" --page details --print-units base >"$out/ncu_details.txt"
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc Active|Stall|Shared Memory Configuration Size|Dynamic Shared|dram__bytes_read|lts__t_sectors" \
  "$out/ncu_details.txt" | head -150
