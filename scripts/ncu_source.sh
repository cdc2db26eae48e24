#!/usr/bin/env bash
# Where one kernel's warps stall, instruction by instruction: Nsight Compute's source counters
# (warp stall sampling per SASS instruction) for the first launch matching REGEX after SKIP
# (default 2) while COMMAND runs; prints the TOP (default 30) instructions by samples.
#   bash scripts/ncu_source.sh dsa_index -- python3 bench/bench_indexer.py --dsa-probes ring8 --context 32768 --batch 4
# Report and the full per-instruction CSV in $OUT (or ./out).
set -uo pipefail
[[ $# -ge 3 && "$2" == "--" ]] || { echo "usage: $0 REGEX -- COMMAND..."; exit 2; }
regex=$1
shift 2
out="${OUT:-out}"
mkdir -p "$out"
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$ncu_bin" ]] || { echo "ncu not found"; exit 2; }
"$ncu_bin" --clock-control none --target-processes all --kernel-name "regex:$regex" --launch-skip "${SKIP:-2}" \
  --launch-count 1 --section SourceCounters --section WarpStateStats -f -o "$out/source" "$@" >"$out/ncu_source_run.log" 2>&1 \
  || { tail -20 "$out/ncu_source_run.log"; exit 1; }
"$ncu_bin" -i "$out/source.ncu-rep" --page source --csv --print-source sass >"$out/source.csv" 2>"$out/source_err.log" \
  || { tail -5 "$out/source_err.log"; exit 1; }
python3 - "$out/source.csv" "${TOP:-30}" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], newline="")))
head = next((i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)), None)
if head is None:
    print("no header found; first lines:"); print("\n".join(",".join(r) for r in rows[:5])); sys.exit(0)
names = [c.strip() for c in rows[head]]
def col(*keys):
    return next((i for i, n in enumerate(names) if all(k.lower() in n.lower() for k in keys)), None)
src, allc, notc, execd = col("Source"), col("Stall Sampling", "All"), col("Stall Sampling", "Not"), col("Instructions Executed")
if allc is None:
    print("columns:", names); sys.exit(0)
def num(r, i):
    try: return float(r[i].replace(",", "")) if i is not None and r[i].strip() else 0.0
    except ValueError: return 0.0
body = [r for r in rows[head + 1:] if len(r) == len(names)]
total = sum(num(r, allc) for r in body) or 1.0
addr = col("Address")
# per-reason columns (each names a stall), for each listed instruction's two largest
per_reason = [i for i, n in enumerate(names) if "stall" in n.lower() and i not in (allc, notc)]
print(f"{len(body)} SASS instructions, {int(total)} stall samples; top {sys.argv[2]} "
      "(samples, %, not-issued, executed, address, SASS, its two largest reasons):")
for r in sorted(body, key=lambda r: -num(r, allc))[: int(sys.argv[2])]:
    where = r[addr].strip() if addr is not None else ""
    top2 = sorted(per_reason, key=lambda i: -num(r, i))[:2]
    why = ", ".join(f"{names[i].split('(')[0].strip()[-28:]} {int(num(r, i))}" for i in top2 if num(r, i))
    print(f"{int(num(r, allc)):7d} {100 * num(r, allc) / total:5.1f}% {int(num(r, notc)):7d} {int(num(r, execd)):9d} "
          f"{where:>6}  {r[src].strip()[:70]}  [{why}]")
# the stall reasons over the whole kernel, from the other columns that name one
reasons = [(n, sum(num(r, i) for r in body)) for i in per_reason for n in [names[i]]]
for n, v in sorted(reasons, key=lambda x: -x[1])[:12]:
    if v: print(f"  {n}: {int(v)}")
PY
"$ncu_bin" -i "$out/source.ncu-rep" --page details --print-units base 2>/dev/null | grep -E "Stall|Warp Cycles|Issued Warp" | head -20
