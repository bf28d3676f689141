#!/usr/bin/env bash
# Two source trees in one run, alternating (A B A B ...): the kestrel of git revision BASE (its
# src/, extracted with git archive) and this working tree's, each running the same command (a
# benchmark from this tree: `python3 -m kestrel bench ...`, benchmarks/moe_kernels.py, ...) with
# KESTREL_COMMIT naming the tree, so each record says which code it measured. Timings compare
# only within one run on one machine (benchmarks/README.md).
# Usage: benchmarks/ab_trees.sh BASE COMMAND...   (env: REPEATS=2)
set -uo pipefail
base=$1; shift
old=$(mktemp -d)
trap 'rm -rf "$old"' EXIT
git archive "$base" src | tar -x -C "$old" || exit 1
# each tree's src and the name its records get (+: this tree's src has uncommitted changes)
trees=("$old" "$(git rev-parse --short "$base")"
       . "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo +)")
status=0
for _ in $(seq "${REPEATS:-2}"); do
  for i in 0 2; do
    src=${trees[i]}/src commit=${trees[i + 1]}
    echo "== $commit: $*"
    KESTREL_COMMIT=$commit PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" "$@" || status=1
  done
done
exit $status
