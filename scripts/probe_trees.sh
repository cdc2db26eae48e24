#!/usr/bin/env bash
# Measure unmerged branches in one device call: each branch's tree is copied (on the host)
# under .probe/NAME (git-ignored) and carried; here each plan line runs in its tree, after
# that tree's own editable install, under a timeout. Logs go to $OUT/probe_NAME_N.log; the
# last lines are a table of every step's rc and seconds.
#   host:   git -C /work/main archive BRANCH | tar -x -C .probe/BRANCH   (one per branch)
#   device: source .device/bootstrap.sh && bash scripts/probe_trees.sh PLAN
# PLAN: one step a line, "NAME SECONDS COMMAND...", NAME a folder under .probe (or "main"
# for this tree); blank lines and lines starting with # are skipped. The device tool brings
# back at most 8 files: with more under $OUT (step logs, a step's own files there) they are
# packed into one, $OUT/out.tgz.
set -uo pipefail
plan=${1:?usage: probe_trees.sh PLAN}
out="${OUT:-out}"
mkdir -p "$out"
root=$PWD
summary=()
n=0
installed=""
while read -r name seconds cmd; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  n=$((n + 1))
  tree="$root/.probe/$name"
  [[ "$name" == main ]] && tree="$root"
  if [[ ! -d "$tree" ]]; then
    summary+=("$n $name rc=missing-tree 0s")
    continue
  fi
  # graphstep.kernels is kernels/ (pyproject's package-dir): a link makes the tree importable by path
  [[ -e "$tree/graphstep/kernels" ]] || ln -s ../kernels "$tree/graphstep/kernels"
  if [[ "$installed" != "$tree" ]]; then  # graphstep imports from the tree being measured
    (cd "$tree" && python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .) >/tmp/probe_install.log 2>&1 \
      || { summary+=("$n $name rc=install-failed 0s"); tail -3 /tmp/probe_install.log; continue; }
    installed="$tree"
  fi
  log="$out/probe_${name}_${n}.log"
  echo "=== $n $name: $cmd"
  start=$(date +%s)
  # the tree first on PYTHONPATH: bootstrap.sh puts the project root there, which would
  # otherwise give every tree the root's graphstep beside the tree's own kernels
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" GRAPHSTEP_WATCHDOG=$((seconds - 5)) \
    timeout -s KILL "$seconds" bash -c "$cmd") >"$log" 2>&1
  rc=$?
  took=$(($(date +%s) - start))
  tail -n "${TAIL:-12}" "$log"
  summary+=("$n $name rc=$rc ${took}s")
done <"$plan"
echo "=== summary (step tree rc seconds)"
printf '%s\n' "${summary[@]}"
files=$(find "$out" -type f | wc -l)
if [[ $files -gt 8 ]]; then  # packed only at the end: a call cut off by its time limit leaves them as they are
  archive=$(mktemp --suffix=.tgz)
  tar -czf "$archive" -C "$out" .
  rc=$?  # 1: a file changed while read (a log still written): packed all the same
  size=$(stat -c %s "$archive" 2>/dev/null || echo 0)
  if [[ $rc -le 1 && $size -gt 0 && $size -le $((16 << 20)) ]]; then
    find "$out" -mindepth 1 -delete && mv "$archive" "$out/out.tgz"
    echo "probe_trees: $files files under $out, packed into $out/out.tgz ($size bytes)"
  else
    rm -f "$archive"
    echo "probe_trees: $files files under $out not packed (tar rc $rc, $size bytes; at most 16 MiB a file comes back)" >&2
  fi
fi
