"""`make demo`: the main job end to end on the bundled models.

1. Offline: the target alone, then with the distilled draft (speculative decoding), on the same
   completion prompt; greedy text must be identical, the speed and acceptance are shown.
2. Daemon: `llmd serve` on a private ipc:// socket, a fill-in-the-middle request (the editor's
   request) and a streamed completion through the Python client, then its stats, then SIGTERM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmd import LLM, SamplingParams
from llmd.clients import Client, DaemonUnavailable, Done, Token

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = ROOT / "models" / "code-target", ROOT / "models" / "code-draft"
PROMPT = "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"
PREFIX = "def mean(values):\n    \"\"\"Return the arithmetic mean of values.\"\"\"\n    total = "
SUFFIX = "\n    return total / len(values)\n"


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


def daemon() -> None:
    print("\n== daemon: llmd serve on a private socket ==")
    sock = Path(tempfile.mkdtemp(prefix="llmd-demo-")) / "llmd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "llmd.daemon", "serve", "--model", str(TARGET),
                             "--draft", str(DRAFT), "--socket", str(sock), "--kv-memory", "128MiB",
                             "--log-level", "warning"])
    try:
        with Client(f"ipc://{sock}", timeout=60) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if c.health().get("state") == "ready":
                        break
                except DaemonUnavailable:
                    pass                        # the socket appears once the process has started
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the daemon did not become ready")
                time.sleep(0.2)
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
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        print(f"daemon stopped on SIGTERM with exit code {code}")


def main() -> int:
    if not (TARGET / "config.json").is_file() or not (DRAFT / "config.json").is_file():
        print(f"llmd demo: the bundled models are missing under {ROOT / 'models'}; run `make models` to train them",
              file=sys.stderr)
        return 1
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    offline()
    daemon()
    return 0


if __name__ == "__main__":
    sys.exit(main())
