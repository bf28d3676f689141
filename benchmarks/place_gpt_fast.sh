#!/usr/bin/env bash
# Places gpt-fast (pytorch-labs/gpt-fast, BSD-3), the compiled single-stream peer of
# `kestrel bench latency --peer gpt-fast`, in DEST (default benchmarks/.peers/gpt-fast, ignored by
# git; a GPU run carries it). Its files are used unchanged; DEST/COMMIT names the commit.
# Usage: benchmarks/place_gpt_fast.sh [CHECKOUT [DEST]]
#   CHECKOUT: a gpt-fast git repository (a clone or a bare one) or a plain folder of its files;
#   without it the pinned commit is cloned from GitHub.
set -euo pipefail
commit=${GPT_FAST_COMMIT:-32971d3129541c5bfb4f715abc33d1c5f408d204}
src=${1:-}; dest=$(realpath -m "${2:-benchmarks/.peers/gpt-fast}")
files=(LICENSE model.py generate.py tokenizer.py tp.py mixtral-moe/model.py mixtral-moe/generate.py mixtral-moe/tp.py)
if [[ -z $src ]]; then
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  git clone -q https://github.com/pytorch-labs/gpt-fast "$src"
fi
rm -rf "$dest"; mkdir -p "$dest"
if git --git-dir="$src/.git" rev-parse -q --verify "$commit^{commit}" >/dev/null 2>&1; then
  git --git-dir="$src/.git" archive "$commit" "${files[@]}" | tar -x -C "$dest"
elif git --git-dir="$src" rev-parse -q --verify "$commit^{commit}" >/dev/null 2>&1; then
  git --git-dir="$src" archive "$commit" "${files[@]}" | tar -x -C "$dest"
elif [[ -f $src/model.py && -f $src/mixtral-moe/model.py ]]; then  # files, not a repository
  (cd "$src" && cp --parents "${files[@]}" "$dest")
  commit=unknown  # plain files name no commit
else
  echo "place_gpt_fast: $src has neither commit $commit nor gpt-fast's files" >&2; exit 1
fi
echo "$commit" > "$dest/COMMIT"
echo "gpt-fast $commit -> $dest"
