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
git archive "$base" src | tar -x -C "$old" || exit 1
new_commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo +)
status=0
for _ in $(seq "${REPEATS:-2}"); do
  for tree in "$old" .; do
    commit=$([[ $tree == . ]] && echo "$new_commit" || git rev-parse --short "$base")
    echo "== $commit: $*"
    KESTREL_COMMIT=$commit PYTHONPATH="$tree/src${PYTHONPATH:+:$PYTHONPATH}" "$@" || status=1
  done
done
rm -rf "$old"
exit $status
