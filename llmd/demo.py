"""`make demo`: the main job end to end, on a real pretrained model and on the bundled models.

0. A real answer: SmolLM2-135M-Instruct (fetched by `make models-real`, a GGUF file served as
   `--model FILE.gguf`) answers a chat question through the daemon, streamed, with the sentence
   events a voice bridge speaks from.
1. Offline: the target alone, then with the distilled draft (speculative decoding), on the same
   completion prompt; greedy text must be identical, the speed and acceptance are shown.
2. Daemon: `llmd serve` on a private ipc:// socket, a fill-in-the-middle request (the editor's
   request) and a streamed completion through the Python client, then its stats, then SIGTERM.
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
from llmd.models_real import SMOLLM2, cached_file

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = ROOT / "models" / "code-target", ROOT / "models" / "code-draft"
PROMPT = "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
PREFIX = "def mean(values):\n    \"\"\"Return the arithmetic mean of values.\"\"\"\n    total = "
SUFFIX = "\n    return total / len(values)\n"
QUESTION = "What is the capital of France?"


def offline() -> None:
    params = SamplingParams(max_tokens=48)
    print("== offline: target alone, then with the draft ==")
    plain = LLM(str(TARGET), draft="none", kv_memory="128MiB").generate([PROMPT], params)[0]
    # a fixed depth: the adaptive controller would spend this short run measuring costs before it speculates
    spec = LLM(str(TARGET), draft=str(DRAFT), kv_memory="128MiB", num_speculative_tokens=4,
               adaptive_speculation=False).generate([PROMPT], params)[0]
    print(PROMPT + plain.text)
    for name, out in (("plain", plain), ("speculative, depth 4", spec)):
        m = out.metrics
        acc = f", acceptance {m['spec_acceptance']:.2f}" if m.get("spec_acceptance") is not None else ""
        print(f"[{name}] {m['output_tokens']} tokens, ttft {1000 * m['ttft_s']:.1f} ms, "
              f"{m['tokens_per_s'] or 0:.0f} tok/s{acc}")
    print("greedy text identical with speculation:", plain.text == spec.text)
    if plain.text != spec.text:
        raise SystemExit("speculative decoding changed greedy output")


@contextlib.contextmanager
def serving(*model_args: str, kv_memory: str = "128MiB"):
    """`llmd serve` on a private ipc:// socket; yields a connected Client once it is ready, then SIGTERM."""
    sock = Path(tempfile.mkdtemp(prefix="llmd-demo-")) / "llmd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "llmd.daemon", "serve", *model_args, "--socket", str(sock),
                             "--kv-memory", kv_memory, "--log-level", "warning"])
    try:
        with Client(f"ipc://{sock}", timeout=60) as c:
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
    with serving("--model", str(gguf)) as c:
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


def daemon() -> None:
    print("\n== daemon: llmd serve on a private socket ==")
    with serving("--model", str(TARGET), "--draft", str(DRAFT)) as c:
        t0 = time.perf_counter()
        middle = "".join(ev.text for ev in c.infill(PREFIX, SUFFIX, max_tokens=16) if isinstance(ev, Token))
        print(f"infill ({1000 * (time.perf_counter() - t0):.0f} ms):\n{PREFIX}\033[1m{middle}\033[0m{SUFFIX}")
        for ev in c.generate(PROMPT, max_tokens=32):
            if isinstance(ev, Token):
                print(ev.text, end="", flush=True)
            elif isinstance(ev, Done):
                print(f"\n[done: {ev.finish_reason}, {ev.timings}, speculative {ev.speculative}]")
        s = c.stats()
        eng = s.get("engine", s)
        print(f"stats: prefix hit rate {eng.get('prefix_hit_rate', 0):.2f}, kv usage {eng.get('kv_usage', 0):.2f}, "
              f"acceptance {eng.get('spec_acceptance_rate')}")


def main() -> int:
    if not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file():
        print(f"llmd demo: the bundled models are missing under {ROOT / 'models'}; run `make models` to train them",
              file=sys.stderr)
        return 1
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    gguf = cached_file(SMOLLM2)
    if gguf is None:
        print("llmd demo: SmolLM2-135M-Instruct is not in the cache; `make models-real` fetches it (about 93 MB). "
              "Going on with the bundled models.\n", file=sys.stderr)
    else:
        real_chat(gguf)
        print()
    offline()
    daemon()
    return 0


if __name__ == "__main__":
    sys.exit(main())
