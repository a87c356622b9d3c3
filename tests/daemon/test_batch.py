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
    ('{"id": "line-3", "prompt": "x"}', "reserved for lines without an id"),
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


@pytest.mark.heavy
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


def run_cli(src, dst, socket, *extra, timeout=120):
    cmd = [sys.executable, "-m", "llmd.clients.cli", "batch", str(src), str(dst), "--socket", socket, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.heavy
def test_lines_the_client_cannot_send_are_error_lines_and_the_run_goes_on(daemon, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join([
        json.dumps({"id": "ok", "prompt": "def f(x):", "max_tokens": 4}).encode(),
        json.dumps({"id": "huge-seed", "prompt": "x", "seed": 10 ** 30}).encode(),
        json.dumps({"id": "too-big", "prompt": "x" * (2 << 20)}).encode(),
        b'{"id": "latin-1", "prompt": "caf\xe9"}',
        json.dumps({"id": "ok2", "prompt": "def g(x):", "max_tokens": 4}).encode()]) + b"\n")
    done = run_cli(src, dst, daemon.settings.socket)
    assert done.returncode == 0, done.stderr
    by_id = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert set(by_id) == {"ok", "huge-seed", "too-big", "line-4", "ok2"}
    assert by_id["ok"]["finish_reason"] and by_id["ok2"]["finish_reason"]
    assert by_id["huge-seed"]["error"]["code"] == "invalid_request"
    assert "max_message_bytes" in by_id["too-big"]["error"]["message"]
    assert "not UTF-8" in by_id["line-4"]["error"]["message"]


@pytest.mark.heavy
def test_a_second_run_on_the_same_output_is_refused(daemon, tmp_path):
    import fcntl
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "x", "max_tokens": 2}) + "\n")
    with open(dst, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        refused = run_cli(src, dst, daemon.settings.socket)
    assert refused.returncode == 2 and "being written by another llmd batch run" in refused.stderr
    assert dst.read_text() == ""
    bad = run_cli(src, dst, daemon.settings.socket, "--concurrency", "0")
    assert bad.returncode == 2 and "--concurrency must be at least 1" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.heavy
def test_a_daemon_draining_for_a_restart_stops_the_run_without_writing_its_refusals(tiny_model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 24}) + "\n"
                           for i in range(60)))
    settings = daemon_settings(tiny_model_dir, tmp_path / "d", drain_grace_s=5.0)
    cmd = [sys.executable, "-m", "llmd.clients.cli", "batch", str(src), str(dst), "--concurrency", "2",
           "--socket", settings.socket]
    with running_daemon(settings) as server:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_until(lambda: count(dst) >= 5 or proc.poll() is not None, 60)
        server.request_stop()                 # draining: running requests end, new ones are refused
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "rerun the same command to resume" in err
    first = [json.loads(line) for line in dst.read_text().splitlines()]
    assert first and all("error" not in r for r in first)
    with running_daemon(settings):
        rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    records = [json.loads(line) for line in dst.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"r{i}" for i in range(60))
    assert all("error" not in r for r in records)
