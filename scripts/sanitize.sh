#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, synccheck and initcheck over one eager step and one
# captured replay of every mode of each case (scripts/sanitize_case.py: TP 8, TP 1 wide, DCP 2,
# the fp8 formats), then a table (case x tool -> errors) and, under each failing run, where
# its reports point: the SANITIZE_SITES (default 6) most printed kernel+offset sites with their
# source lines (counts of the reports printed, which compute-sanitizer caps; kernels of one
# name, e.g. two SparseCore variants, share a row), and for racecheck every distinct hazard
# pair, known ones marked. Exit 0 only if every run finished and
# reported 0 errors, or racecheck hazards that scripts/sanitize_known.txt lists as the tool's
# (shown as "N(known)", each with its reason; --strict: those fail too).
#   scripts/sanitize.sh [--quick] [--strict] [--cases tp8,dcp2] [--tools memcheck,racecheck] [--jobs N] [-- case args]
# --quick: the tp8 and tp8-range cases only. --jobs: runs at once (default 4: the tools of a case side by side
# on the one GPU). Logs: $SANITIZE_LOGS (default /tmp/sanitize), one per run. Each run is
# stopped after SANITIZE_TIMEOUT seconds (default 240). compute-sanitizer is
# $COMPUTE_SANITIZER, else the one on the PATH, else /usr/local/cuda/bin/compute-sanitizer.
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
cases=""
tools="memcheck racecheck synccheck initcheck"
jobs=4
strict=0
case_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) cases="tp8 tp8-range" ;;
    --strict) strict=1 ;;
    --cases) cases="${2//,/ }"; shift ;;
    --tools) tools="${2//,/ }"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --) shift; case_args=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "sanitize: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "sanitize: --jobs $jobs: expected a positive integer" >&2; exit 2; }
[[ "${SANITIZE_SITES:-6}" =~ ^[1-9][0-9]*$ ]] \
  || { echo "sanitize: SANITIZE_SITES=$SANITIZE_SITES: expected a positive integer" >&2; exit 2; }
known=$("$python" scripts/sanitize_case.py --list) \
  || { echo "sanitize: '$python scripts/sanitize_case.py --list' failed (set PYTHON to one with torch)" >&2; exit 2; }
cases="${cases:-$known}"
for case_name in $cases; do
  [[ " $known " == *" $case_name "* ]] || { echo "sanitize: unknown case $case_name (cases: $known)" >&2; exit 2; }
done
sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
for candidate in "$sanitizer" /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
  [[ -n "$candidate" && -x "$candidate" ]] && { sanitizer="$candidate"; break; }
done
if [[ -z "$sanitizer" || ! -x "$sanitizer" ]]; then
  echo "sanitize: compute-sanitizer was not found (COMPUTE_SANITIZER, the PATH, /usr/local/cuda*/bin)" >&2
  exit 2
fi
logs="${SANITIZE_LOGS:-/tmp/sanitize}"
mkdir -p "$logs"
# The kernels compiled with line info, so each finding names its source line: it adds debug
# sections only, no instruction changes (tests/test_kernels_compile.py checks a TopK variant;
# bench/RESULTS.md session 27 the TP 1 SparseCore partials).
export CUTE_DSL_LINEINFO="${CUTE_DSL_LINEINFO:-1}"
echo "sanitize: $sanitizer; cases: $cases; tools: $tools; $jobs at once; logs in $logs"

flags() {  # the tool's flags: memcheck skips API errors (the CUDA binding's symbol probes are not kernel errors)
  case "$1" in
    memcheck) echo "--tool memcheck --report-api-errors no" ;;
    *) echo "--tool $1" ;;
  esac
}

run() {  # run CASE TOOL: one sanitizer run, its log and exit status in $logs
  local log="$logs/$1.$2.log" started=$SECONDS
  # shellcheck disable=SC2046
  timeout -k 10 "${SANITIZE_TIMEOUT:-240}" "$sanitizer" $(flags "$2") --error-exitcode 97 \
    "$python" scripts/sanitize_case.py "$1" ${case_args[@]+"${case_args[@]}"} >"$log" 2>&1
  local rc=$?
  echo "$rc" >"$logs/$1.$2.rc"
  local summary
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
  echo "sanitize: $1 $2: ${summary:-no summary line} (rc $rc, $((SECONDS - started)) s)"
}

started=$SECONDS
for case_name in $cases; do
  for tool in $tools; do
    rm -f "$logs/$case_name.$tool.rc"
    while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n; done
    run "$case_name" "$tool" &
  done
done
wait

errors_of() {  # errors_of LOG: the error count of its summary line, empty if none
  local line
  line=$(grep -E "ERROR SUMMARY: [0-9]+ error" "$1" | tail -1)
  [[ -n "$line" ]] && { sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/' <<<"$line"; return; }
  line=$(grep -E "RACECHECK SUMMARY: .*\(([0-9]+) error" "$1" | tail -1)
  [[ -n "$line" ]] && sed -E 's/.*\(([0-9]+) error.*/\1/' <<<"$line"
}

where_of() {  # where_of LOG: the run's most reported code sites, "count kernel+offset [file:line]"
  grep -oE "at [^ ]+\+0x[0-9a-f]+( in [^ ]+:[0-9]+)?" "$1" \
    | sed -E 's/^at //; s/ in / /; s/^kernel_cutlass_([a-z0-9_]+)_graphstep[^+]*/\1/; s#[^ ]*/(kernels/[^ /]+:[0-9]+)$#\1#' \
    | sort | uniq -c | sort -rn | head -"${SANITIZE_SITES:-6}"
}

pairs_of() {  # pairs_of LOG: racecheck's hazard pairs, "kernel first_site second_site" ("?": no line info)
  grep -E "Race reported between (Read|Write) access at|^=+ +and (Read|Write) access at" "$1" \
    | sed -E 's/( between .*) (and (Read|Write) access at)/\1\n\2/' \
    | sed -E 's/.*(between|and) (Read|Write) access at ([^ ]+)\+0x[0-9a-f]+( in ([^ ]+:[0-9]+))?.*/\1 \3 \5/' \
    | sed -E 's/ kernel_cutlass_([a-z0-9_]+)_graphstep[^ ]*/ \1/; s# [^ ]*/([^ /]+:[0-9]+)$# \1#' \
    | awk '$1 == "between" { kernel = $2; first = ($3 == "" ? "?" : $3); next }
           $1 == "and" { print kernel, first, ($3 == "" ? "?" : $3); next }
           { kernel = "?"; first = "?"; print "? ? ?" }' \
    | sort -u
}

known_pairs() {  # known_pairs TOOL: "kernel first second" of scripts/sanitize_known.txt's entries for TOOL
  grep -vE '^\s*(#|$)' scripts/sanitize_known.txt | awk -v tool="$1" '$1 == tool { print $2, $3, $4 }' \
    | sed -E 's/@[A-Za-z0-9_]+//g'
}

unknown_of() {  # unknown_of LOG TOOL: the run's hazard pairs not listed as known; "-" if it has none to match
  local pairs
  [[ "$2" == racecheck ]] && pairs=$(pairs_of "$1")
  [[ -n "${pairs:-}" ]] || { echo "-"; return; }
  # a report the tool counted but did not print (its print limit) could be any pair
  local printed counted
  printed=$(grep -c "Race reported between" "$1")
  counted=$(errors_of "$1")
  [[ "$printed" == "$counted" ]] || echo "? $printed of $counted reports printed ?"
  grep -vxF -f <(known_pairs "$2"; echo "no known pair") <<<"$pairs" || true  # none left: every pair known
}

failed=0
matched=0
declare -A unknowns  # CASE.TOOL -> unknown_of's answer, for the table and the pair list alike
printf '\n%-10s' "case"
for tool in $tools; do printf ' %-12s' "$tool"; done
printf '\n'
for case_name in $cases; do
  printf '%-10s' "$case_name"
  for tool in $tools; do
    log="$logs/$case_name.$tool.log"
    rc=$(cat "$logs/$case_name.$tool.rc" 2>/dev/null || echo "?")
    errors=$(errors_of "$log")
    if [[ "$rc" == 124 || "$rc" == 137 ]]; then
      cell="timeout"; failed=1
    elif [[ -z "$errors" ]]; then
      cell="no-summary"; failed=1
    elif [[ "$errors" != 0 ]] && unknowns[$case_name.$tool]=$(unknown_of "$log" "$tool") \
      && [[ $strict == 0 && -z "${unknowns[$case_name.$tool]}" ]]; then
      cell="$errors(known)"; matched=1  # every hazard pair listed in scripts/sanitize_known.txt
      # the tool's exit code (97) hides the case's own: the case must have printed its last line
      grep -q "^sanitize_case $case_name: done in" "$log" || { cell="$cell,unfinished"; failed=1; }
    elif [[ "$errors" != 0 ]]; then
      cell="$errors"; failed=1
    elif [[ "$rc" != 0 ]]; then
      cell="0,rc=$rc"; failed=1  # clean, but the case itself failed (see its log)
    else
      cell="0"
    fi
    printf ' %-12s' "$cell"
  done
  printf '\n'
done
for case_name in $cases; do  # where each failing run's reports point (source lines: the kernels have line info)
  for tool in $tools; do
    log="$logs/$case_name.$tool.log"
    errors=$(errors_of "$log")
    [[ -n "$errors" && "$errors" != 0 ]] || continue
    echo "sanitize: $case_name $tool: where (reports, kernel+offset, source line):"
    sites=$(where_of "$log")
    echo "${sites:-(no kernel+offset in the log)}" | sed 's/^/  /'
    if [[ "$tool" == racecheck ]]; then  # every distinct pair, however few its reports (the sites above are the top ones)
      pairs=$(pairs_of "$log")
      [[ -n "$pairs" ]] || continue
      echo "sanitize: $case_name racecheck: every hazard pair (kernel, first site, second site):"
      while read -r pair; do
        grep -qxF "$pair" <<<"${unknowns[$case_name.$tool]:-}" && echo "  $pair" || echo "  $pair (known)"
      done <<<"$pairs"
    fi
  done
done
if [[ $matched -ne 0 ]]; then  # the reasons of the known reports the table counted
  echo "sanitize: 'N(known)': every hazard of the run is one scripts/sanitize_known.txt lists as the tool's:"
  grep -vE '^\s*(#|$)' scripts/sanitize_known.txt | sed 's/^/  /'
fi
echo "sanitize: $((SECONDS - started)) s; cells: errors reported, 'timeout', 'no-summary' (the tool printed none)," \
  "'0,rc=N' (no errors but the case failed), 'N(known)' (scripts/sanitize_known.txt; ',unfinished': the case" \
  "did not finish); logs in $logs"
if [[ $failed -ne 0 ]]; then
  echo "sanitize: FAILED (see the logs of the cells above that are not 0)" >&2
  exit 1
fi
echo "sanitize: every run clean"
