"""`make demo`: the main jobs end to end, on real pretrained models (`make models-real` fetches both,
sha256-checked; each is served from its GGUF file as `--model FILE.gguf`).

1. A real answer: SmolLM2-135M-Instruct answers a chat question through the daemon, streamed, with the
   sentence events a voice bridge speaks from.
2. Real code: Qwen2.5-Coder-0.5B-Instruct through the daemon, with prompt lookup (n-gram speculation):
   - fill-in-the-middle on real code, the editor's request, trimmed as the editor shows it;
   - a code edit whose answer copies its input, speculated by prompt lookup; then the same request in
     this process without speculation: the greedy text must be identical, the speed is shown.
   Then the daemon's stats, and SIGTERM.

The bundled toy models (models/code-target, models/code-draft) are for the tests only.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmd import LLM, SamplingParams
from llmd.clients import Client, DaemonUnavailable, Done, Sentence, Token
from llmd.clients.lsp_trim import trim_suggestion
from llmd.models_real import QWEN_CODER, SMOLLM2, cached_file

QUESTION = "What is the capital of France? Answer in one sentence."
# fill-in-the-middle: the cursor is on the line after `mid = ...`, indented
CURSOR_LINE = "        "
FIM_PREFIX = '''def binary_search(items, target):
    """The index of target in the sorted list items, or -1."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
''' + CURSOR_LINE
FIM_SUFFIX = '''
        elif items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
'''
EDIT_CODE = '''def word_counts(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?").lower()
                if word:
                    counts[word] = counts.get(word, 0) + 1
    return counts
'''
EDIT = [{"role": "user", "content": "Add type hints to this function. Answer with the code only.\n\n```python\n"
         f"{EDIT_CODE}```"}]
EDIT_TOKENS = 96


@contextlib.contextmanager
def serving(*model_args: str, kv_memory: str = "256MiB"):
    """`llmd serve` on a private ipc:// socket; yields a connected Client once it is ready, then SIGTERM."""
    sock = Path(tempfile.mkdtemp(prefix="llmd-demo-")) / "llmd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "llmd.daemon", "serve", *model_args, "--socket", str(sock),
                             "--kv-memory", kv_memory, "--log-level", "warning"])
    try:
        with Client(f"ipc://{sock}", timeout=120) as c:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if c.health().get("state") == "ready":
                        break
                except DaemonUnavailable:
                    pass                        # the socket appears once the process has started
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the daemon did not become ready")
                time.sleep(0.2)
            yield c
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        print(f"daemon stopped on SIGTERM with exit code {code}")


def real_chat(gguf: Path) -> str:
    """Ask the real model QUESTION through the daemon; print the streamed answer and its sentence
    events; return the answer."""
    print(f"== a real model: SmolLM2-135M-Instruct from {gguf.name}, through the daemon ==")
    answer, sentences = "", []
    with serving("--model", str(gguf), kv_memory="128MiB") as c:
        print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
        for ev in c.chat([{"role": "user", "content": QUESTION}], max_tokens=48, sentences=True):
            if isinstance(ev, Token):
                answer += ev.text
                print(ev.text, end="", flush=True)
            elif isinstance(ev, Sentence):
                sentences.append(ev)
            elif isinstance(ev, Done):
                print(f"\n[done: {ev.finish_reason}, {ev.timings}]")
        for ev in sentences:
            print(f"[sentence {ev.seq}] {ev.text.strip()}")
    return answer


def infill(c: Client) -> str:
    """The editor's request on FIM_PREFIX/FIM_SUFFIX; prints the file with the suggestion in bold and
    returns the suggestion, trimmed as the editor shows it."""
    t0 = time.perf_counter()
    raw = "".join(ev.text for ev in c.infill(FIM_PREFIX, FIM_SUFFIX, max_tokens=24) if isinstance(ev, Token))
    shown = trim_suggestion(raw, CURSOR_LINE, "", FIM_SUFFIX)
    ms = 1000 * (time.perf_counter() - t0)
    print(f"fill-in-the-middle ({ms:.0f} ms):\n{FIM_PREFIX}\033[1m{shown}\033[0m{FIM_SUFFIX}")
    return shown


def speculated_edit(c: Client) -> tuple[str, dict, dict]:
    """EDIT through the daemon, greedy, with prompt lookup: (text, timings, speculative)."""
    text, done = "", None
    for ev in c.chat(EDIT, max_tokens=EDIT_TOKENS):
        if isinstance(ev, Token):
            text += ev.text
        elif isinstance(ev, Done):
            done = ev
    return text, done.timings, done.speculative


def plain_edit(gguf: Path):
    """EDIT in this process without speculation: the Completion."""
    llm = LLM(str(gguf), draft="none", kv_memory="256MiB")
    return llm.chat(EDIT, SamplingParams(max_tokens=EDIT_TOKENS))


def real_code(gguf: Path) -> None:
    print(f"\n== real code: Qwen2.5-Coder-0.5B-Instruct from {gguf.name}, through the daemon ==")
    with serving("--model", str(gguf), "--draft", "ngram") as c:
        infill(c)
        print("\na code edit, greedy, speculated by prompt lookup:")
        text, timings, spec = speculated_edit(c)
        print(text)
        s = c.stats()
        eng = s.get("engine", s)
        print(f"stats: prefix hit rate {eng.get('prefix_hit_rate', 0):.2f}, kv usage {eng.get('kv_usage', 0):.2f}")
    plain = plain_edit(gguf)
    decode_s = (timings.get("decode_ms") or 0) / 1000
    n = len(plain.token_ids)
    print(f"[prompt lookup] {n} tokens in {decode_s:.2f} s of decode, acceptance {spec.get('acceptance')}")
    print(f"[no speculation] {n} tokens in {plain.metrics['decode_s']:.2f} s of decode")
    print("greedy text identical with prompt lookup:", plain.text == text)
    if plain.text != text:
        raise SystemExit("prompt lookup changed greedy output")


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    chat, code = cached_file(SMOLLM2), cached_file(QWEN_CODER)
    if chat is None or code is None:
        print("llmd demo: the real models are not in the cache; `make models-real` fetches them (about 93 MB "
              "and 491 MB, sha256-checked)", file=sys.stderr)
        return 1
    started = time.perf_counter()
    real_chat(chat)
    real_code(code)
    print(f"\ndemo done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
