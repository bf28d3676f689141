#!/usr/bin/env bash
# Two source trees in one run, alternating (A B A B ...): the kestrel of git revision BASE (its
# src/, extracted with git archive) and this working tree's, each running the same command (a
# benchmark from this tree: `python3 -m kestrel bench ...`, benchmarks/moe_kernels.py, ...) with
# KESTREL_COMMIT naming the tree, so each record says which code it measured. Timings compare
# only within one run on one machine (benchmarks/README.md).
# Usage: benchmarks/ab_trees.sh BASE COMMAND...   (env: REPEATS=2)
# BASE may also be a folder holding a src/ (and a COMMIT file naming it): a base tree carried to a
# machine without the repository's history; there this tree is named by $KESTREL_COMMIT.
set -uo pipefail
base=$1; shift
if [ -d "$base/src" ]; then
  old=$base base_name=$(cat "$base/COMMIT" 2>/dev/null || basename "$base")
else
  old=$(mktemp -d)
  trap 'rm -rf "$old"' EXIT
  git archive "$base" src | tar -x -C "$old" || exit 1
  base_name=$(git rev-parse --short "$base")
fi
# this tree's name (+: its src has uncommitted changes)
if this=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD -- src || this+=+
else
  this=${KESTREL_COMMIT:-this}
fi
trees=("$old" "$base_name" . "$this")  # each tree's src and the name its records get
status=0
for _ in $(seq "${REPEATS:-2}"); do
  for i in 0 2; do
    src=${trees[i]}/src commit=${trees[i + 1]}
    echo "== $commit: $*"
    KESTREL_COMMIT=$commit PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" "$@" || status=1
  done
done
exit $status
