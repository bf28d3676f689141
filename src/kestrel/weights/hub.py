"""Hugging Face Hub names as `-m` takes them: `org/repo`, and llama-server's `-hf` form
`org/repo:QUANT`, resolved to files in the local Hugging Face cache (downloaded when missing).

The rule that picks a repo's files (`choose_files`):

- `org/repo:TAG` names a GGUF file: the one whose path in the repo contains TAG, compared
  case-insensitively (Q4_K_M, q8_0, UD-Q4_K_XL). Where several do (`Q4_K` is in Q4_K_M and
  Q4_K_S), one where TAG stands alone (no letter or digit before it, no letter, digit or `_` after
  it) wins, then the first by path.
- `org/repo` with a config.json and top-level *.safetensors is a safetensors checkpoint: its
  top-level config, tokenizer and *.safetensors files (no .bin, .pt, ONNX; no consolidated.*
  beside the transformers shards).
- `org/repo` otherwise picks a GGUF file as llama-server does without a tag: Q4_K_M's, else the
  first .gguf by path.
- mmproj files (vision projectors) are never the model; a split GGUF (`-00001-of-0000N.gguf`)
  counts as one file and all its shards are fetched.

The repo's file list comes from the Hub, or from the cached snapshot when HF_HUB_OFFLINE=1 or the
Hub cannot be reached; `snapshot_download` then fetches what the cache lacks. Every failure is one
`ModelLoadError` line. Revisions: `resolve_repo` takes one; no flag passes it yet (the main
branch is used).
"""

import glob
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from kestrel.errors import ModelLoadError
from kestrel.weights.gguf import SPLIT_NAME, shard_name

# org/repo, optionally :TAG (llama-server's -hf); validate_repo_id has the final word on the repo
_SPEC = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<tag>[\w.-]+))?")
# the Hub client's connection and timeout errors derive from its HTTP library's base error, the
# first base of HfHubHTTPError (httpx's or httpx2's, as huggingface_hub's version has it)
_HTTP_ERROR = HfHubHTTPError.__bases__[0]
_NETWORK_ERRORS = (OSError, _HTTP_ERROR)
_DEFAULT_QUANT = "Q4_K_M"  # llama-server's choice when no tag is given
_SAFETENSORS_FILES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".jinja")


def parse(model: str) -> tuple[str, str | None] | None:
    """(repo id, quant tag or None) when `model` reads as a Hub name, else None. A name ending in
    .gguf is a file path that does not exist, not a repo."""
    m = _SPEC.fullmatch(model)
    if m is None or model.endswith(".gguf"):
        return None
    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return m["repo"], m["tag"]


def resolve_repo(repo_id: str, tag: str | None = None, revision: str | None = None) -> Path:
    """The local path of what `repo_id[:tag]` names (the module's rule): a .gguf file (a split
    checkpoint's first shard) or a safetensors folder, inside the cache's snapshot."""
    files, online = _repo_files(repo_id, revision)
    chosen = choose_files(repo_id, files, tag)
    folder = _download(repo_id, revision, chosen, online)
    missing = [f for f in chosen if not (folder / f).is_file()]
    if missing:  # a cached snapshot that lost a file (a deleted blob): say which
        raise ModelLoadError(f"Hugging Face repo {repo_id!r}: {folder / missing[0]} is missing")
    return folder / chosen[0] if chosen[0].endswith(".gguf") else folder


def choose_files(repo_id: str, files: list[str], tag: str | None) -> list[str]:
    """The files to fetch: a GGUF's shards (first shard first) or a safetensors checkpoint's."""
    top = [f for f in files if "/" not in f]
    if tag is None and "config.json" in top and any(f.endswith(".safetensors") for f in top):
        return _safetensors_files(top)
    sets = _gguf_sets(files)
    if not sets:
        raise ModelLoadError(
            f"Hugging Face repo {repo_id!r} has no .gguf file and no config.json with safetensors"
        )
    paths = sorted(sets)
    first = _match(paths, tag or _DEFAULT_QUANT)
    if first is None and tag is not None:
        raise ModelLoadError(
            f"Hugging Face repo {repo_id!r} has no GGUF file matching {tag!r}; "
            f"it has: {', '.join(paths)}"
        )
    return sets[first or paths[0]]


def _safetensors_files(top: list[str]) -> list[str]:
    files = [f for f in top if f.endswith(_SAFETENSORS_FILES)]
    # Mistral's repos hold their weights twice: consolidated.safetensors (mistral's format) and
    # the transformers shards that config.json describes
    if any(f.endswith(".safetensors") and not f.startswith("consolidated") for f in files):
        files = [f for f in files if not f.startswith("consolidated")]
    return ["config.json", *sorted(f for f in files if f != "config.json")]


def _gguf_sets(files: list[str]) -> dict[str, list[str]]:
    """Model GGUFs by path, a split checkpoint's at its first shard's path with all its shards."""
    sets: dict[str, list[str]] = {}
    for f in sorted(files):
        name = f.rpartition("/")[2]
        if not name.endswith(".gguf") or "mmproj" in name.lower():
            continue
        m = SPLIT_NAME.fullmatch(f)
        key = f if m is None else shard_name(m["prefix"], 1, int(m["count"]))
        sets.setdefault(key, []).append(f)
    return sets


def _match(paths: list[str], tag: str) -> str | None:
    """The first path containing `tag` (any case), one where it stands alone first."""
    tag = tag.lower()
    hits = [p for p in paths if tag in p.lower()]
    alone = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])")
    return next((p for p in hits if alone.search(p.lower())), hits[0] if hits else None)


def _repo_files(repo_id: str, revision: str | None) -> tuple[list[str], bool]:
    """The repo's files as the Hub lists them; offline, or with the Hub out of reach, those of
    its cached snapshot (what can be loaded without the network). And whether the Hub answered."""
    unreachable = None
    if not constants.HF_HUB_OFFLINE:
        try:
            return huggingface_hub.list_repo_files(repo_id, revision=revision), True
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise ModelLoadError(_hub_error(repo_id, e)) from e
        except _NETWORK_ERRORS as e:
            unreachable = e
    snapshot = _cached_snapshot(repo_id, revision)
    if snapshot is None:
        raise ModelLoadError(_not_cached(repo_id, unreachable))
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    return sorted(files), False


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cache's folder of the revision: huggingface_hub keeps a repo in
    models--org--repo/, a branch's commit in refs/<branch>, its files in snapshots/<commit>/."""
    storage = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    revision = revision or constants.DEFAULT_REVISION
    ref = storage / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _download(repo_id: str, revision: str | None, files: list[str], online: bool) -> Path:
    """The snapshot folder holding `files`, fetched where the cache lacks them (`online`: the
    Hub answered; otherwise the cache alone is asked, without waiting on the network again)."""
    patterns = [glob.escape(f) for f in files]  # names, not patterns: a '[' matches itself
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, local_files_only=not online
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelLoadError(_hub_error(repo_id, e)) from e
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(_not_cached(repo_id, e)) from e
    except _NETWORK_ERRORS as e:
        raise ModelLoadError(f"Hugging Face repo {repo_id!r}: download failed ({_line(e)})") from e
    return Path(folder)


def _not_cached(repo_id: str, unreachable: Exception | None = None) -> str:
    why = (
        "the network is off (HF_HUB_OFFLINE=1)"
        if constants.HF_HUB_OFFLINE or unreachable is None
        else f"the Hub cannot be reached ({_line(unreachable)})"
    )
    return (
        f"Hugging Face repo {repo_id!r} is not in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) and {why}"
    )


def _hub_error(repo_id: str, e: Exception) -> str:
    if isinstance(e, GatedRepoError):
        return f"Hugging Face repo {repo_id!r} is gated: accept its terms on the Hub and log in"
    if isinstance(e, RevisionNotFoundError):
        return f"Hugging Face repo {repo_id!r} has no such revision"
    return f"Hugging Face repo {repo_id!r} not found (a private repo needs `hf auth login` or HF_TOKEN)"


def _line(e: Exception) -> str:
    """The first line of an error's message (the Hub's span several), with its type."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
