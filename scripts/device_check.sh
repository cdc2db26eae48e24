#!/usr/bin/env bash
# One GPU-machine session: install, the GPU tests, then the commands a user runs, each
# under a timeout and a stack-dumping watchdog. Logs go to $OUT/all.log (or ./out).
#   source .device/bootstrap.sh && bash scripts/device_check.sh
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/install.log 2>&1 \
  || { echo "pip install failed:"; tail -5 /tmp/install.log; exit 1; }
python3 -c "import torch, cutlass, graphstep.kernels; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cutlass-dsl', cutlass.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
summary=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "=== $name"
  local start=$SECONDS
  GRAPHSTEP_WATCHDOG=$((seconds - 5)) timeout -s KILL "$seconds" "$@" >"/tmp/$name.log" 2>&1
  local rc=$?
  { echo "=== $name: $*"; cat "/tmp/$name.log"; echo "=== $name rc=$rc"; } >>"$out/all.log"
  tail -n "${TAIL:-14}" "/tmp/$name.log"
  echo "=== $name rc=$rc"
  # the last line of pytest's summary or of the command, for the table at the end
  local last
  last=$(grep -E "passed|failed|error" "/tmp/$name.log" | tail -n 1)
  [[ -n "$last" ]] || last=$(tail -n 1 "/tmp/$name.log")
  summary+=("$(printf '%-14s %4s %5ss  %s' "$name" "$rc" "$((SECONDS - start))" "${last:0:90}")")
}
if [[ $# -gt 0 ]]; then  # a subset: device_check.sh NAME... (gpu_tests gpu_lanes graph run bench bench_tp1 bench_dcp2 serve nsys nsys_eager trace group_tests
  only=" $* "            # run_group bench_group kernels indexer sparse topk pybench sanitize sanitize_all ops_tests ops)
else
  only=" gpu_lanes graph run bench serve nsys trace kernels "
fi
want() { [[ "$only" == *" $1 "* ]]; }
want gpu_tests && step gpu_tests 400 python3 -m pytest -q -m gpu tests -p no:cacheprovider
# the same tests in six processes at once (compile-bound: a CPU core each; the default: the whole
# GPU suite took 150 s so on the H200, session 21); logs $out/lane_N.log
want gpu_lanes && OUT="$out" TAIL=20 step gpu_lanes 400 bash scripts/pytest_lanes.sh --shards 6 "-m gpu tests"
want graph && TAIL=12 step graph 45 graphstep graph --batch 4 --mode fork
want run && step run 45 graphstep run --batch 1,4 --context 8192 --replays 30
want bench && step bench 150 graphstep bench --batch 1,4,16,64 --context 32768 --replays 30 --out "$out"
want bench_tp1 && step bench_tp1 200 graphstep bench --tp 1 --mla-cache fp8 --batch 1,4,16,64 --context 32768 \
  --replays 30 --out "$out/tp1"
want bench_dcp2 && step bench_dcp2 200 graphstep bench --dcp 2 --batch 1,4,16,64 --context 32768 --replays 30 \
  --out "$out/dcp2"
want serve && step serve 45 graphstep serve --batch 1,2,4,8,16 --context 8192 --steps 300
want nsys && TAIL=40 step nsys 100 bash scripts/nsys_capture.sh "$out/steps" -- --batch 4 --steps 3 --context 4096
want nsys_eager && TAIL=40 step nsys_eager 100 bash scripts/nsys_capture.sh "$out/eager" -- --batch 4 --steps 0 \
  --eager-steps 2 --context 4096
want trace && TAIL=24 step trace 90 graphstep trace --batch 4 --context 8192 --replays 20 --out "$out/trace.json"
want ops_tests && step ops_tests 240 python3 -m pytest -q -m gpu tests/test_ops_gpu.py -p no:cacheprovider
want ops && TAIL=24 step ops 150 python3 bench/bench_ops.py --batch 1,16 --json "$out/ops.json" --watchdog 145
want kernels && step kernels 120 python3 bench/bench_kernels.py --heads 16,128 --batch 1,16,64 --watchdog 115
want indexer && TAIL=20 step indexer 240 python3 bench/bench_indexer.py --json "$out/indexer.json" --watchdog 235
want sparse && TAIL=16 step sparse 240 python3 bench/bench_sparse_core.py --sweep --json "$out/sparse.json" --watchdog 235
want topk && TAIL=20 step topk 240 python3 bench/bench_indexer.py --top-k-sweep --json "$out/topk.json" --watchdog 235
want pybench && TAIL=30 step pybench 150 python3 -m pytest bench/test_step_bench.py -q -m gpu -p no:cacheprovider \
  --benchmark-only --benchmark-columns=median,iqr,rounds --benchmark-json "$out/pybench.json"
want sanitize && SANITIZE_LOGS="$out/sanitize" TAIL=12 step sanitize 330 bash scripts/sanitize.sh --quick
want sanitize_all && SANITIZE_LOGS="$out/sanitize" TAIL=12 step sanitize_all 590 bash scripts/sanitize.sh
want group_tests && step group_tests 300 python3 -m pytest -q -m gpu tests/test_dcp_group_gpu.py -p no:cacheprovider
want run_group && step run_group 120 graphstep run --dcp 2 --batch 1,4,16 --context 8192 --replays 30
want bench_group && TAIL=30 step bench_group 420 graphstep bench --dcp 2,4 --batch 1,4,16,64 --context 32768 \
  --replays 30 --out "$out/group"
echo "=== summary"
printf '%-14s %4s %6s  %s\n' step rc time "last line"
printf '%s\n' "${summary[@]}"
