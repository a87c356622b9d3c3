"""`llmd http` against a real daemon, through real HTTP clients: the `openai` package, llama.vim's
`/infill` body, llmd's own clients moved with `--backend http://...`, and hostile requests."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from daemon_fixtures import REPO, daemon_settings, running_daemon, wait_until
from http_fixtures import raw_exchange, running_front, status_of
from systemd_units import SYSTEMD_ANALYZE, check_units
from llmd.clients.client import Client
from llmd.protocol import Done
from llmd.clients.http_front import FrontConfig
from optional import need

openai = need("openai")

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("http"))) as server:
        yield server


@pytest.fixture(scope="module")
def front(daemon):
    config = FrontConfig(socket=daemon.settings.socket, port=0, max_connections=8, head_timeout_s=1.0,
                         body_timeout_s=1.0, max_body_bytes=256 << 10)
    with running_front(config) as url:
        yield url


@pytest.fixture
def oai(front):
    with openai.OpenAI(base_url=front + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def zmq_text(daemon, kind: str, *args, **kw) -> tuple[str, Done]:
    with Client(daemon.settings.socket, timeout=30) as c:
        stream = getattr(c, kind)(*args, **kw)
        text = stream.text()
        return text, stream.final


def post(url: str, body, headers=None, timeout: float = 30) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def daemon_stats(daemon) -> dict:
    with Client(daemon.settings.socket) as c:
        return c.stats()


# -- the openai package ----------------------------------------------------------------------------


@pytest.mark.heavy
def test_models_and_health(oai, front):
    models = oai.models.list()
    assert [m.id for m in models.data] and models.data[0].object == "model"
    with urllib.request.urlopen(front + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


@pytest.mark.heavy
def test_chat_streaming_greedy_text_and_usage_equal_the_zeromq_client(oai, daemon):
    messages = [{"role": "user", "content": "Write a sorting function."}]
    chunks = list(oai.chat.completions.create(model="x", messages=messages, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected, done = zmq_text(daemon, "chat", messages, max_tokens=24)
    assert text == expected and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == done.usage["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == done.usage["prompt_tokens"]


@pytest.mark.heavy
def test_completion_greedy_text_usage_and_logprobs(oai, daemon):
    r = oai.completions.create(model="x", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    expected, done = zmq_text(daemon, "generate", PROMPT, max_tokens=20)
    assert r.choices[0].text == expected
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (done.usage["prompt_tokens"],
                                                                  done.usage["completion_tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
    assert all(lp <= 0 for lp in r.choices[0].logprobs.token_logprobs)
    assert all(len(top) == 2 for top in r.choices[0].logprobs.top_logprobs)
    # each entry names its own token's text (a non-streamed answer with logprobs streams from the daemon)
    assert "".join(r.choices[0].logprobs.tokens) == expected
    assert sum(1 for t in r.choices[0].logprobs.tokens if t) >= min(3, r.usage.completion_tokens)


@pytest.mark.heavy
def test_stop_strings_cut_the_text(oai, daemon):
    full = oai.completions.create(model="x", prompt=PROMPT, max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = oai.completions.create(model="x", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.heavy
def test_a_cancelled_stream_frees_its_request(oai, daemon):
    before = daemon_stats(daemon)["finished"].get("cancelled", 0)
    stream = oai.completions.create(model="x", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert wait_until(lambda: daemon_stats(daemon)["finished"].get("cancelled", 0) > before, 10)
    assert wait_until(lambda: daemon_stats(daemon)["engine"]["running"] == 0, 10)
    assert daemon_stats(daemon)["in_flight"] == 0


@pytest.mark.heavy
def test_n_other_than_one_is_refused_in_openai_error_shape(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="x", prompt="a", max_tokens=3, n=2)
    assert e.value.body["type"] == "invalid_request_error" and "n" in e.value.body["message"]


# -- llama.vim's /infill ---------------------------------------------------------------------------


def llama_vim_body(prefix: str, middle: str, suffix: str, n_predict: int, t_max_predict_ms: int) -> dict:
    """The request body llama.vim (autoload/llama.vim, llama#fim) sends, field for field."""
    return {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [{"text": "import os\n", "time": [1733000000, 123456], "filename": "util.py"}],
        "prompt": middle,
        "n_predict": n_predict,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": t_max_predict_ms,
        "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                            "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                            "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                            "tokens_cached"],
    }


@pytest.mark.heavy
def test_llama_vim_infill_gets_a_completion(front, daemon):
    status, headers, reply = post(front + "/infill", llama_vim_body("def add(a, b):\n", "    ret", "\n", 16, 1000))
    assert status == 200, reply
    # its prompt joins the prefix, as on llama.cpp's server
    expected, _ = zmq_text(daemon, "infill", "def add(a, b):\n    ret", "\n", files=[("util.py", "import os\n")],
                           max_tokens=16)
    assert reply["content"] == expected
    assert reply["timings"]["predicted_n"] > 0 and "tokens_cached" in reply
    # its context warm-up (n_predict 0) is answered at once
    status, _, reply = post(front + "/infill", {**llama_vim_body("", "", "", 0, 1), "response_fields": [""]})
    assert status == 200 and reply["content"] == ""


SEEDED = {"max_tokens": 12, "temperature": 1.0, "seed": 5}


@pytest.mark.parametrize("temperature, knob", [(1.0, {"typical_p": 0.2}), (0.0, {"repetition_penalty": 3.0})])
@pytest.mark.heavy
def test_typical_p_and_repetition_penalty_reach_the_daemon_from_openai_bodies(oai, daemon, temperature, knob):
    kw = {**SEEDED, "temperature": temperature}
    want, _ = zmq_text(daemon, "generate", PROMPT, **kw, **knob)
    assert want != zmq_text(daemon, "generate", PROMPT, **kw)[0]    # the knob changes this output
    got = oai.completions.create(model="m", prompt=PROMPT, extra_body=knob, **kw)
    assert got.choices[0].text == want


@pytest.mark.heavy
def test_an_infill_with_typical_p_matches_the_daemon(front, daemon):
    body = {**llama_vim_body("def add(a, b):\n", "", "\n", 12, 1000), "samplers": [], "top_k": 0, "top_p": 1.0,
            "temperature": 1.0, "seed": 5, "typical_p": 0.2}
    status, _, reply = post(front + "/infill", body)
    assert status == 200, reply
    kw = {**SEEDED, "typical_p": 0.2, "files": [("util.py", "import os\n")]}
    assert reply["content"] == zmq_text(daemon, "infill", "def add(a, b):\n", "\n", **kw)[0]
    # a samplers chain without llama.cpp's typ_p leaves it out
    status, _, reply = post(front + "/infill", {**body, "samplers": ["temperature"]})
    kw.pop("typical_p")
    assert status == 200 and reply["content"] == zmq_text(daemon, "infill", "def add(a, b):\n", "\n", **kw)[0]


@pytest.mark.heavy
def test_two_quick_infills_from_one_client_the_first_is_replaced(front, daemon):
    first: dict = {}
    long_body = {**llama_vim_body("x = [", "", "]\n", 1500, 60_000), "ignore_eos": True}

    def call_first():
        first["reply"] = post(front + "/infill", long_body)

    thread = threading.Thread(target=call_first)
    thread.start()
    assert wait_until(lambda: daemon_stats(daemon)["in_flight"] >= 1, 10)
    status, _, second = post(front + "/infill", llama_vim_body("def f(", "", ")\n", 8, 1000))
    thread.join(30)
    assert status == 200 and "content" in second
    status, headers, reply = first["reply"]
    assert status == 200 and headers["X-Llmd-Finish-Reason"] == "cancelled"
    assert reply["timings"]["predicted_n"] < 1500


# -- llmd's clients moved to HTTP --------------------------------------------------------------------


@pytest.mark.heavy
def test_language_server_and_batch_over_llmd_http_match_the_daemon(front, daemon, tmp_path):
    from llmd.clients.batch import BatchConfig, BatchRunner
    from llmd.clients.lsp_service import CompletionService, LspConfig
    text = "import math\n\ndef area(r):\n    return \n"
    offset = text.index("return ") + len("return ")

    async def suggest(backend):
        # over HTTP the prompt is split at the cursor (a server's /infill has no middle): so here too
        service = CompletionService(LspConfig(socket=backend, debounce_ms=0, max_tokens=12, split="cursor"))
        try:
            return await service.complete("file:///a.py", text, offset), service.backend_status()
        finally:
            await service.aclose()

    over_http, status = asyncio.run(suggest(front))
    over_ipc, native = asyncio.run(suggest(daemon.settings.socket))
    assert over_http == over_ipc
    assert status["off"] == ["replace", "sentences", "priority", "middle"] and native["off"] == []
    assert status["features"]["priority"].startswith("off")

    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 12} for i in range(3)]
    lines.append({"id": "fim", "prefix": "def g(", "suffix": "):\n", "max_tokens": 8})
    lines.append({"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    outputs = {}
    for name, backend in (("http", front), ("ipc", daemon.settings.socket)):
        out = tmp_path / f"{name}.jsonl"
        asyncio.run(BatchRunner(BatchConfig(socket=backend, concurrency=2, progress=False), src, out).run())
        outputs[name] = {r["id"]: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    assert outputs["http"] == outputs["ipc"] and len(outputs["ipc"]) == len(lines)


@pytest.mark.heavy
def test_llmd_run_over_http(front, daemon):
    out = subprocess.run([sys.executable, "-m", "llmd.cli", "complete", "--backend", front, "--max-tokens", "10",
                          PROMPT], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == zmq_text(daemon, "generate", PROMPT, max_tokens=10)[0].rstrip("\n")


# -- hostile HTTP ----------------------------------------------------------------------------------

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def request_bytes(body: bytes, extra: bytes = b"") -> bytes:
    return HEAD + extra + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize("name, body", [
    ("invalid JSON", b"{oops"),
    ("not an object", b"[1, 2]"),
    ("deep nesting", b"[" * 100_000),
    ("wrong type", json.dumps({"prompt": "a", "max_tokens": "5"}).encode()),
    ("float for int", json.dumps({"prompt": "a", "max_tokens": 5.0}).encode()),
    ("n=1000", json.dumps({"prompt": "a", "n": 1000}).encode()),
    ("negative max_tokens", json.dumps({"prompt": "a", "max_tokens": -5}).encode()),
    ("huge stop list", json.dumps({"prompt": "a", "stop": ["x"] * 5000}).encode()),
    ("long stop string", json.dumps({"prompt": "a", "stop": ["x" * 300]}).encode()),
    ("NaN temperature", b'{"prompt": "a", "temperature": NaN}'),
    ("no prompt", b"{}"),
])
@pytest.mark.heavy
def test_bad_requests_get_a_400_and_the_daemon_keeps_serving(front, daemon, name, body):
    reply = raw_exchange(front, request_bytes(body, b"Connection: close\r\n"))
    assert status_of(reply) == 400, (name, reply[:300])
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert zmq_text(daemon, "generate", "ok", max_tokens=2)[1].finish_reason in ("stop", "length")


@pytest.mark.heavy
def test_oversized_body_header_and_header_count_are_refused(front, daemon):
    assert status_of(raw_exchange(front, request_bytes(b"x" * (300 << 10), b"Connection: close\r\n"))) == 413
    big_header = b"X-Big: " + b"a" * 20_000 + b"\r\n"
    assert 400 <= status_of(raw_exchange(front, request_bytes(b"{}", big_header))) < 500
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(200))
    assert 400 <= status_of(raw_exchange(front, request_bytes(b"{}", many))) < 500
    status, _, reply = post(front + "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200 and reply["choices"]


@pytest.mark.heavy
def test_slowloris_heads_and_bodies_time_out(front, daemon):
    reply = raw_exchange(front, request_bytes(b'{"prompt": "a"}'), timeout=10, trickle_s=0.1)
    assert status_of(reply) == 408, reply[:200]
    head_only = HEAD + b"Content-Length: 500\r\n\r\n{"            # a body that never comes
    reply = raw_exchange(front, head_only, timeout=10)
    assert status_of(reply) == 408, reply[:200]
    assert post(front + "/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200


@pytest.mark.heavy
def test_connections_over_the_limit_get_503(front):
    import socket
    host, port = front.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(8)]
    try:
        extra = raw_exchange(front, request_bytes(b"{}"), timeout=5)
        assert status_of(extra) == 503 and b"too_many_connections" in extra
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: post(front + "/v1/models".replace("/v1/models", "/health"), b"")[0] != 503, 5) or True


@pytest.mark.heavy
def test_no_cors_headers_unless_asked(front):
    req = urllib.request.Request(front + "/v1/models", headers={"Origin": "http://evil.example"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert "Access-Control-Allow-Origin" not in r.headers


@pytest.mark.heavy
def test_api_key_and_cors_when_configured(daemon, tmp_path):
    config = FrontConfig(socket=daemon.settings.socket, port=0, api_key="s3cret", cors_origins=("http://ui.local",))
    with running_front(config) as url:
        status, _, reply = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        status, _, reply = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2},
                                {"Authorization": "Bearer s3cret", "Origin": "http://ui.local"})
        assert status == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as c:
            assert c.completions.create(model="x", prompt="a", max_tokens=2).choices
        req = urllib.request.Request(url + "/v1/models", method="OPTIONS",
                                     headers={"Origin": "http://ui.local", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "http://ui.local"


@pytest.mark.heavy
def test_a_non_loopback_bind_without_a_key_is_refused_at_start(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "llmd.cli", "http", "--host", "0.0.0.0", "--port", "0",
                          "--socket", str(tmp_path / "none.sock")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "refusing to listen on 0.0.0.0" in out.stderr, out.stderr
    from llmd.clients.cli import main
    assert main(["http", "--host", "10.1.2.3", "--allow-remote", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "without a key: pass --api-key-file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api-key-file"):
        FrontConfig(host="192.168.1.5", allow_remote=True).check()
    FrontConfig(host="192.168.1.5", allow_remote=True, api_key="k").check()
    FrontConfig(host="::1").check()



@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_http_unit_files_verify_and_are_hardened(tmp_path):
    check_units(tmp_path, "llmd-http.socket", "llmd-http.service")
    assert "ListenStream=127.0.0.1:" in (REPO / "systemd" / "llmd-http.socket").read_text()
    service = (REPO / "systemd" / "llmd-http.service").read_text()
    for setting in ("PrivateNetwork=yes", "RestrictAddressFamilies=AF_UNIX", "Requires=llmd-http.socket",
                    "NoNewPrivileges=yes", "MemoryMax=", "DynamicUser=yes"):
        assert setting in service


def test_t_max_predict_ms_ends_an_infill_after_a_newline_once_the_time_is_up():
    from llmd.protocol import Token
    from llmd.clients.http_front import predict_limited

    async def tokens(texts):
        for i, t in enumerate(texts):
            await asyncio.sleep(0.02)
            yield Token("r", i, t, [i])

    async def run(texts, limit):
        return [e async for e in predict_limited(tokens(texts), limit)]

    out = asyncio.run(run(["a", "b", "c", "d", "\n", "e", "f"], 30))
    assert [e.text for e in out[:-1]] == ["a", "b", "c", "d", "\n"]
    assert isinstance(out[-1], Done) and out[-1].finish_reason == "deadline" and out[-1].usage["completion_tokens"] == 5
    assert len(asyncio.run(run(["a", "b", "c", "d", "e"], 30))) == 5          # no newline yet: no cut
    assert len(asyncio.run(run(["a", "\n", "c"], None))) == 3


@pytest.mark.heavy
def test_voice_sentences_over_http_match_the_daemon(front, daemon):
    from llmd.clients.backend import async_client
    from llmd.protocol import Sentence
    from llmd.clients.voice import sentences
    messages = [{"role": "user", "content": "Tell me about the sea."}]

    async def spoken(backend):
        client = async_client(backend, timeout=30)
        try:
            said = [s async for s in sentences(await client.chat(messages, max_tokens=40, priority="interactive"))]
            stream = await client.chat(messages, max_tokens=40, sentences=True)
            events = [e.text async for e in stream if isinstance(e, Sentence)]
            return said, events
        finally:
            await client.aclose()

    over_http, over_ipc = asyncio.run(spoken(front)), asyncio.run(spoken(daemon.settings.socket))
    assert over_http == over_ipc and over_http[0]


@pytest.mark.heavy
def test_unix_socket_listener_is_owner_only(daemon, tmp_path):
    import os
    import stat

    import aiohttp
    path = str(tmp_path / "http.sock")

    async def ask() -> dict:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s:
            async with s.post("http://llmd/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}) as r:
                return await r.json()

    with running_front(FrontConfig(socket=daemon.settings.socket, unix=path)) as where:
        assert where == path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert asyncio.run(ask())["choices"][0]["text"] == zmq_text(daemon, "generate", PROMPT, max_tokens=4)[0]


@pytest.mark.heavy
def test_a_client_that_disconnects_before_a_whole_answer_cancels_it(front, daemon):
    import socket
    before = daemon_stats(daemon)["finished"].get("cancelled", 0)
    host, port = front.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(request_bytes(json.dumps({"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}).encode()))
    assert wait_until(lambda: daemon_stats(daemon)["in_flight"] >= 1, 10)
    s.close()
    assert wait_until(lambda: daemon_stats(daemon)["finished"].get("cancelled", 0) > before, 10)
    assert wait_until(lambda: daemon_stats(daemon)["in_flight"] == 0, 10)


@pytest.mark.heavy
def test_a_socket_passed_by_systemd_is_served(daemon):
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with running_front(FrontConfig(socket=daemon.settings.socket), listen_fd=listener.detach()) as url:
        assert url == f"http://127.0.0.1:{port}"
        assert post(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})[0] == 200


@pytest.mark.heavy
def test_http_backend_emulates_replace_by_closing_the_previous_connection(front, daemon):
    from llmd.clients.http_backend import HttpBackend
    before = daemon_stats(daemon)["finished"].get("cancelled", 0)

    async def two_quick_calls():
        client = HttpBackend(front, timeout=30)
        try:
            first = await client.infill("x = [", "]\n", replace="doc", max_tokens=3000, ignore_eos=True)
            await first.__anext__()                      # it is running
            second = await client.infill("def f(", ")\n", replace="doc", max_tokens=4)
            return first.final, await second.text()
        finally:
            await client.aclose()

    first_final, second_text = asyncio.run(two_quick_calls())
    assert first_final.finish_reason == "cancelled"
    assert second_text == zmq_text(daemon, "infill", "def f(", ")\n", max_tokens=4)[0]
    assert wait_until(lambda: daemon_stats(daemon)["finished"].get("cancelled", 0) > before, 10)
    assert wait_until(lambda: daemon_stats(daemon)["in_flight"] == 0, 10)
