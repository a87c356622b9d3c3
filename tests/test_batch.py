"""`llmd batch`: line parsing exactly; then a real run against a real daemon, killed halfway and
resumed, with every id answered exactly once and bad lines recorded as errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon_fixtures import REPO, daemon_settings, running_daemon, wait_until
from llmd.clients.batch import BadLine, done_ids, parse_line
from llmd.clients.client import Client


def test_lines_parse_into_typed_items():
    item = parse_line('{"id": "a", "prompt": "x", "max_tokens": 3, "seed": 1}', 1)
    assert (item.id, item.kind, item.fields, item.sampling) == ("a", "generate", {"prompt": "x"},
                                                               {"max_tokens": 3, "seed": 1})
    item = parse_line('{"prefix": "def f(", "suffix": ")", "files": [["u.py", "u = 1"]]}', 7)
    assert (item.id, item.kind, item.fields["files"]) == ("line-7", "infill", [("u.py", "u = 1")])
    assert parse_line('{"messages": [{"role": "user", "content": "hi"}]}', 2).kind == "chat"


@pytest.mark.parametrize("line, message", [
    ("{oops", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"id": 5, "prompt": "x"}', "id must be"),
    ('{"max_tokens": 3}', "exactly one of"),
    ('{"prompt": "x", "messages": []}', "exactly one of"),
    ('{"prompt": "x", "colour": "red"}', "unknown key"),
    ('{"prefix": "x", "files": [["only-a-path"]]}', "files must be"),
])
def test_bad_lines_name_the_problem(line, message):
    with pytest.raises(BadLine, match=message):
        parse_line(line, 1)


def test_done_ids_cuts_a_partial_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": ""}\n{"id": "b", "text": ""}\n{"id": "c", "te')
    assert done_ids(out) == {"a", "b"}
    assert out.read_text() == '{"id": "a", "text": ""}\n{"id": "b", "text": ""}\n'
    assert done_ids(tmp_path / "missing.jsonl") == set()


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    settings = daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("batch"))
    with running_daemon(settings) as server:
        yield server


def write_input(path, n: int) -> dict[str, dict]:
    requests = {}
    lines = []
    for i in range(n):
        req = {"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 24}
        requests[req["id"]] = req
        lines.append(json.dumps(req))
        if i == 5:
            lines.append("this is not json")              # line 7
        if i == 9:
            lines.append(json.dumps({"id": "r3", "prompt": "again"}))   # duplicate id, line 12
        if i == 12:
            lines.append(json.dumps({"id": "zero-tokens", "prompt": "x", "max_tokens": 0}))   # refused by the daemon
    path.write_text("\n".join(lines) + "\n")
    return requests


def count(path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_a_killed_batch_resumes_with_every_line_answered_once(daemon, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests = write_input(src, 60)
    cmd = [sys.executable, "-m", "llmd.clients.cli", "batch", str(src), str(dst), "--concurrency", "2",
           "--socket", daemon.settings.socket]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: count(dst) >= 30 or proc.poll() is not None, 60)
        proc.kill()
    finally:
        proc.wait(10)
    halfway = count(dst)
    assert 0 < halfway < 63, "the first run should be cut off part way"
    with open(dst, "a") as f:
        f.write('{"id": "r5')                 # as if killed in the middle of a write
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr

    records = [json.loads(line) for line in dst.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted([*requests, "line-7", "line-12", "zero-tokens"])   # each exactly once
    by_id = {r["id"]: r for r in records}
    assert by_id["line-7"]["error"]["code"] == "bad_line"
    assert "duplicate id 'r3'" in by_id["line-12"]["error"]["message"]
    assert by_id["zero-tokens"]["error"]["code"] == "invalid_request"
    with Client(daemon.settings.socket) as c:
        for rid in ("r0", "r29", "r59"):
            expected = c.generate(requests[rid]["prompt"], max_tokens=24).text()
            assert by_id[rid]["text"] == expected and by_id[rid]["usage"]["completion_tokens"] == 24
