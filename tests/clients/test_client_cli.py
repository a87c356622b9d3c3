"""`llmd run` and `llmd complete` as separate processes against a real daemon (tiny model)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from daemon_fixtures import REPO, daemon_settings, running_daemon, wait_until
from llmd.clients.client import Client
from llmd.clients.cli import main as cli_main


@pytest.fixture(scope="module")
def daemon(model_factory, tmp_path_factory):
    # a long context, so that an answer can run long enough for Ctrl-C to land mid-answer however fast
    # the machine decodes (600 tokens once finished in a second, before the signal was handled)
    settings = daemon_settings(model_factory("cli-long", max_pos=8192), tmp_path_factory.mktemp("cli"))
    with running_daemon(settings) as server:
        yield server


def llmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmd.clients.cli", *args]


def finished(server) -> dict:
    with Client(server.settings.socket) as c:
        return c.stats()["finished"]


@pytest.mark.heavy
def test_complete_streams_the_daemons_completion(daemon):
    with Client(daemon.settings.socket) as c:
        expected = c.generate("def fib(n):", max_tokens=12).text()
    out = subprocess.run(llmd("complete", "def fib(n):", "--max-tokens", "12", "--socket", daemon.settings.socket),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
    piped = subprocess.run(llmd("complete", "--max-tokens", "12", "--socket", daemon.settings.socket),
                           input="def fib(n):", cwd=REPO, capture_output=True, text=True, timeout=60)
    assert piped.stdout == expected + "\n"


@pytest.mark.heavy
def test_run_answers_one_piped_message(daemon):
    messages = [{"role": "user", "content": "Hello there"}]
    with Client(daemon.settings.socket) as c:
        expected = c.chat(messages, max_tokens=10).text()
    out = subprocess.run(llmd("run", "--max-tokens", "10", "--socket", daemon.settings.socket),
                         input="Hello there", cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


def test_without_a_daemon_the_commands_say_how_to_start_one(tmp_path, capsys):
    code = cli_main(["complete", "hi", "--socket", str(tmp_path / "none.sock")])
    assert code == 1 and "llmd serve" in capsys.readouterr().err


class Pipe:
    """Collects a process's output stream on a thread."""

    def __init__(self, stream):
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for chunk in iter(lambda: stream.read1(4096), b""):
            self.text += chunk.decode("utf-8", "replace")


@pytest.mark.heavy
def test_ctrl_c_stops_the_answer_and_keeps_the_session(daemon):
    with Client(daemon.settings.socket) as c:
        alone = c.chat([{"role": "user", "content": "And then?"}], max_tokens=1)
        alone.text()
    before = finished(daemon)
    proc = subprocess.Popen(llmd("run", "--interactive", "--stats", "--ignore-eos", "--max-tokens", "3000",
                                 "--socket", daemon.settings.socket),
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            # as from a terminal: a suite started as a background job (`make test &`) runs
                            # with SIGINT ignored, which the child would inherit and never see Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, err = Pipe(proc.stdout), Pipe(proc.stderr)
    try:
        assert wait_until(lambda: "> " in err.text, 30)
        proc.stdin.write(b"Tell me a very long story.\n")
        proc.stdin.flush()
        assert wait_until(lambda: len(out.text) > 0, 30), err.text       # the answer is streaming
        proc.send_signal(signal.SIGINT)
        assert wait_until(lambda: "[stopped]" in err.text, 10), err.text
        assert proc.poll() is None                                        # the session goes on
        proc.stdin.write(b"And then?\n")
        proc.stdin.flush()
        assert wait_until(lambda: "prompt tokens" in err.text, 30), err.text
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    delta = {k: v - before.get(k, 0) for k, v in finished(daemon).items()}
    assert delta.get("cancelled") == 1 and delta.get("length") == 1
    prompt_tokens = int(err.text.split("prompt tokens")[0].rsplit("[", 1)[1])
    assert prompt_tokens > alone.final.usage["prompt_tokens"] + 3      # the first exchange is in the prompt


@pytest.mark.heavy
def test_client_modules_never_import_torch():
    code = ("import sys, llmd.clients, llmd.clients.cli, llmd.clients.lsp, llmd.clients.lsp_probe, "
            "llmd.clients.voice, llmd.clients.batch; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
