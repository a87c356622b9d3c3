"""Models by name: a fake Ollama store of real GGUF blobs is listed and served in place (nothing copied),
and `llmd pull` runs the real huggingface_hub client against a local server with a Hub's file layout:
a pinned sha256 checked, a dropped connection resumed, a wrong sha256 refused and removed, a 404 explained."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llmd import LLM, SamplingParams
from llmd.bench.to_gguf import convert
from llmd.cli import main
from llmd import model_catalog
from llmd.runtime.formats.ollama_store import OllamaName, parse_name
from llmd.runtime.model_names import ModelNotFound, models_dir, resolve_model

from modelfactory import make_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GEN = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Three real GGUF files of different models (float and Q8_0 blocks)."""
    root = tmp_path_factory.mktemp("ggufs")
    return [convert(make_model_dir(root / f"src{i}", seed=i, layers=1), root / f"m{i}.gguf", quant)
            for i, quant in enumerate(("auto", {"*": "q8_0"}, "auto"))]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """llmd's cache, Ollama's store and the Hub's cache all under tmp_path; no socket may connect."""
    for var, sub in (("LLMD_MODELS", "llmd-models"), ("OLLAMA_MODELS", "ollama"), ("HF_HUB_CACHE", "hub")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path


def no_network(monkeypatch):
    def refuse(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network use at run time: {address}")
        return real(self, address)
    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)


def add_to_store(store: Path, name: str, gguf: Path) -> Path:
    """Write ``gguf`` into an Ollama store as ``name``'s model layer (with a template layer beside it)."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = store / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    template = store / "blobs" / ("sha256-" + "ab" * 32)
    template.write_text("{{ .Prompt }}")
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
              {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "ab" * 32, "size": 13}]
    manifest = parse_name(name).manifest(store)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def store(isolated, ggufs):
    root = isolated / "ollama"
    names = ("coder:1.5b", "someone/chat:q8", "tiny")
    return {name: add_to_store(root, name, g) for name, g in zip(names, ggufs)}


def snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")} \
        if root.exists() else {}


# ---- names -----------------------------------------------------------------------------------------

def test_name_forms_map_to_their_manifest_paths():
    assert parse_name("qwen2.5-coder:1.5b") == OllamaName("registry.ollama.ai", "library", "qwen2.5-coder", "1.5b")
    assert parse_name("llama3.2") == OllamaName("registry.ollama.ai", "library", "llama3.2", "latest")
    assert parse_name("someone/chat:q8") == OllamaName("registry.ollama.ai", "someone", "chat", "q8")
    assert parse_name("example.com:5000/team/m:v1") == OllamaName("example.com:5000", "team", "m", "v1")
    assert parse_name("example.com:5000/team/m:v1").manifest(Path("/s")) == \
        Path("/s/manifests/example.com:5000/team/m/v1")
    for bad in ("../x", "a/../b", "a/b/c/d", "x:", ":x", "", "x:../y"):
        assert parse_name(bad) is None, bad


@pytest.mark.heavy
def test_list_shows_the_three_models_of_the_store(store, capsys, monkeypatch):
    no_network(monkeypatch)
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["name"]: r["path"] for r in rows} == {"coder:1.5b": str(store["coder:1.5b"]),
                                                    "tiny:latest": str(store["tiny"]),
                                                    "someone/chat:q8": str(store["someone/chat:q8"])}
    kinds = {r["name"]: r["kind"] for r in rows}
    assert kinds["someone/chat:q8"] == "llama Q8_0" and kinds["coder:1.5b"].startswith("llama")
    assert {r["source"] for r in rows} == {"ollama"}
    assert main(["list"]) == 0
    assert "coder:1.5b" in capsys.readouterr().out


def test_a_model_is_served_by_name_from_the_blob_in_place(store, isolated, monkeypatch):
    no_network(monkeypatch)
    before = snapshot(isolated)
    for name in ("coder:1.5b", "tiny", "tiny:latest", "registry.ollama.ai/library/tiny:latest", "someone/chat:q8"):
        key = name if name in store else ("tiny" if "tiny" in name else name)
        assert resolve_model(name) == str(store[key]), name
    by_name = LLM("coder:1.5b", kv_memory="16MiB").generate(["def f"], GEN)[0]
    by_path = LLM(str(store["coder:1.5b"]), kv_memory="16MiB").generate(["def f"], GEN)[0]
    assert by_name.error is None and len(by_name.token_ids) == 6
    assert by_name.token_ids == by_path.token_ids
    assert snapshot(isolated) == before                 # nothing copied, written or touched
    assert not models_dir().exists()


@pytest.mark.heavy
def test_the_daemon_serves_a_model_by_name(store, isolated, tmp_path_factory):
    from daemon_fixtures import daemon_settings, running_daemon
    from llmd.clients.client import Client
    before = snapshot(isolated)
    settings = daemon_settings("tiny", tmp_path_factory.mktemp("sock"), dtype="auto", draft="none")
    with running_daemon(settings) as server, Client(server.settings.socket) as c:
        events = list(c.generate(token_ids=[1, 2, 3], max_tokens=5))
    served = [t for e in events for t in getattr(e, "token_ids", ()) or ()]
    local = LLM(str(store["tiny"]), kv_memory="16MiB", draft="none").generate([[1, 2, 3]],
                                                                           SamplingParams(max_tokens=5))[0]
    assert served == local.token_ids and len(served) == 5
    assert snapshot(isolated) == before


@pytest.mark.heavy
def test_generate_takes_a_name(store, capsys):
    assert main(["generate", "someone/chat:q8", "def f", "--max-tokens", "4", "--kv-memory", "16MiB"]) == 0
    assert capsys.readouterr().out.strip()


def test_an_existing_path_wins_over_a_name(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny").mkdir()
    assert resolve_model("tiny") == "tiny"
    assert resolve_model("coder:1.5b") == str(store["coder:1.5b"])


def test_an_unknown_name_says_what_to_do(store):
    with pytest.raises(ModelNotFound) as e:
        LLM("nope:1b", kv_memory="16MiB")
    assert "llmd pull nope:1b" in str(e.value) and "llmd list" in str(e.value)
    for path in ("/no/such/dir", "./nope", "nope.gguf", "dir/nope.gguf"):     # to the loader's own error
        assert resolve_model(path) == path


@pytest.mark.heavy
def test_rm_leaves_ollamas_store_alone(store, capsys):
    assert main(["rm", "coder:1.5b"]) == 2
    assert "ollama rm coder:1.5b" in capsys.readouterr().err
    assert store["coder:1.5b"].is_file()


# ---- pull against a local Hub ----------------------------------------------------------------------

class FakeHub(BaseHTTPRequestHandler):
    """``/{owner}/{repo}/resolve/{revision}/{file}``: HEAD and GET with a Hub's headers and Range support.
    ``drop`` holds files whose next GET ends the connection half way through the body."""
    files: dict = {}
    drop: set = set()
    log: list = []

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def answer(self, body: bool) -> None:
        parts = self.path.split("?")[0].split("/")
        key = "/".join(parts[1:3]) + "/" + "/".join(parts[5:]) if len(parts) > 5 else ""
        FakeHub.log.append((self.command, key or self.path, self.headers.get("Range")))
        if len(parts) < 6 or parts[3] != "resolve" or key not in FakeHub.files:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Error-Message", "Entry not found")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data, etag = FakeHub.files[key]
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Linked-Etag", f'"{etag}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body:
            return
        if key in FakeHub.drop:
            FakeHub.drop.discard(key)
            self.wfile.write(data[start:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True             # the socket closes with the body half sent
            return
        self.wfile.write(data[start:])

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def hub(hub_server, isolated, ggufs, monkeypatch):
    """The local Hub with ``owner/models/m.gguf`` (one of the real GGUF files) and HF_ENDPOINT set to it."""
    monkeypatch.setenv("HF_ENDPOINT", hub_server)
    data = ggufs[2].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    FakeHub.files, FakeHub.drop, FakeHub.log = {"owner/models/m.gguf": (data, sha)}, set(), []
    return data, sha


@pytest.mark.heavy
def test_pull_checks_the_sha256_and_the_name_resolves_after(hub, capsys):
    data, sha = hub
    assert main(["pull", "owner/models/m.gguf", "--sha256", sha, "--name", "mine:1b", "--quiet"]) == 0
    path = Path(resolve_model("mine:1b"))
    assert path.read_bytes() == data and path.is_relative_to(models_dir())
    assert resolve_model("owner/models/m.gguf") == str(path)
    assert not any(p.is_file() for p in (models_dir() / ".pulling").rglob("*"))
    record = json.loads((path.parent / "llmd-model.json").read_text())
    assert record["revision"] == COMMIT and record["sha256"] == sha
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["source"], r["path"]) for r in rows] == [("mine:1b", "llmd", str(path))]
    assert LLM("mine:1b", kv_memory="16MiB").generate(["def f"], GEN)[0].error is None
    gets = [entry for entry in FakeHub.log if entry[0] == "GET"]
    assert main(["pull", "owner/models/m.gguf", "--sha256", sha, "--name", "mine:1b", "--quiet"]) == 0
    assert [entry for entry in FakeHub.log if entry[0] == "GET"] == gets          # already there: no download
    assert main(["rm", "mine:1b"]) == 0
    assert not path.exists()
    with pytest.raises(ModelNotFound):
        resolve_model("mine:1b")


@pytest.mark.heavy
def test_a_catalogue_name_pulls_its_pinned_file(hub, monkeypatch):
    data, sha = hub
    entry = model_catalog.CatalogEntry("tiny-coder:1b", "owner/models", "m.gguf", revision=COMMIT, sha256=sha)
    monkeypatch.setitem(model_catalog.CATALOG, entry.name, entry)
    assert main(["pull", "tiny-coder:1b", "--quiet"]) == 0
    assert Path(resolve_model("tiny-coder:1b")).read_bytes() == data
    unpinned = model_catalog.CatalogEntry("tiny-coder:2b", "owner/models", "m.gguf")     # the Hub's sha256
    monkeypatch.setitem(model_catalog.CATALOG, unpinned.name, unpinned)
    assert main(["pull", "tiny-coder:2b", "--quiet"]) == 0


@pytest.mark.heavy
def test_an_interrupted_download_resumes(hub, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)     # it resumes after the last whole chunk
    data, sha = hub
    FakeHub.drop.add("owner/models/m.gguf")
    assert main(["pull", "owner/models/m.gguf", "--sha256", sha, "--quiet"]) == 0
    ranges = [r for method, key, r in FakeHub.log if method == "GET" and key == "owner/models/m.gguf"]
    resumed_at = int(ranges[1].removeprefix("bytes=").removesuffix("-"))
    assert ranges[0] is None and 0 < resumed_at <= len(data) // 2 and len(ranges) == 2    # the rest, not all again
    assert Path(resolve_model("m")).read_bytes() == data


@pytest.mark.heavy
def test_a_wrong_sha256_is_refused_and_the_download_removed(hub, capsys):
    assert main(["pull", "owner/models/m.gguf", "--sha256", "0" * 64, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and "removed" in err
    assert not [p for p in models_dir().rglob("*") if p.is_file()]
    with pytest.raises(ModelNotFound):
        resolve_model("m")


@pytest.mark.heavy
def test_a_404_gives_a_clear_error(hub, capsys):
    assert main(["pull", "owner/models/absent.gguf", "--quiet"]) == 2
    assert "not found on the Hub (404)" in capsys.readouterr().err
    assert main(["pull", "not-a-name"]) == 2
    assert "llmd pull --list" in capsys.readouterr().err


@pytest.mark.heavy
def test_the_hub_cache_is_listed_and_resolved(hub, hub_server, isolated, capsys, monkeypatch):
    from huggingface_hub import hf_hub_download
    data, _ = hub
    cached = hf_hub_download("owner/models", "m.gguf", cache_dir=os.environ["HF_HUB_CACHE"], endpoint=hub_server)
    no_network(monkeypatch)
    assert resolve_model("owner/models/m.gguf") == cached
    assert main(["list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["source"], r["path"]) for r in rows] == [("owner/models/m.gguf", "hub", cached)]
    assert resolve_model(f"owner/models/m.gguf@{COMMIT}") == cached
    shutil.rmtree(os.environ["HF_HUB_CACHE"])


@pytest.mark.heavy
def test_llmds_cache_comes_before_ollamas_store(hub, store):
    data, sha = hub
    assert main(["pull", "owner/models/m.gguf", "--sha256", sha, "--name", "coder:1.5b", "--quiet"]) == 0
    assert Path(resolve_model("coder:1.5b")).is_relative_to(models_dir())
    assert main(["rm", "coder:1.5b"]) == 0
    assert resolve_model("coder:1.5b") == str(store["coder:1.5b"])


@pytest.mark.heavy
def test_a_loose_file_in_llmds_cache_is_listed_resolved_and_removed(isolated, ggufs, capsys):
    models_dir().mkdir(parents=True)
    loose = Path(shutil.copy(ggufs[0], models_dir() / "Some-Model.Q8_0.gguf"))
    assert resolve_model("Some-Model.Q8_0.gguf") == str(loose)
    assert main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "Some-Model.Q8_0.gguf"
    assert main(["rm", "Some-Model.Q8_0.gguf", "--dry-run"]) == 0 and loose.is_file()
    assert main(["rm", "Some-Model.Q8_0.gguf"]) == 0 and not loose.exists()


def test_the_catalogue_is_well_formed():
    for name, e in model_catalog.CATALOG.items():
        assert parse_name(name) is not None and e.name == name
        assert e.file.endswith(".gguf") and e.repo.count("/") == 1
        assert e.sha256 is None or (len(e.sha256) == 64 and set(e.sha256) <= set("0123456789abcdef")), name
        assert (e.sha256 is None) == (e.source == ""), name
