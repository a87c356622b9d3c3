"""Tool calls on a real model through `llmd serve --http`: twenty requests that ask for a light to be
switched on, with ``tool_choice: required``, each checked for exactly one parsed call to an offered
function whose arguments the function's schema accepts; and which function and room it chose.

    python -m llmd.bench.tool_call_check --model FILE.gguf
"""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .structured_schemas import valid

ROOMS = ["kitchen", "hall", "bedroom", "bathroom", "garage"]
LIGHT = {"type": "object", "properties": {"room": {"enum": ROOMS},
                                          "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
         "required": ["room"], "additionalProperties": False}
ROOM = {"type": "object", "properties": {"room": {"enum": ROOMS}}, "required": ["room"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "turn_on", "description": "Switch a light on", "parameters": LIGHT}},
         {"type": "function", "function": {"name": "turn_off", "description": "Switch a light off", "parameters": ROOM}},
         {"type": "function", "function": {"name": "get_temperature", "description": "Read a room's thermometer",
                                           "parameters": ROOM}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["Switch the {room} light on.", "Turn on the light in the {room}, please.", "It's dark in the {room}.",
        "Can you light up the {room}?", "{room} light on at 40 percent."]


def prompts() -> list[tuple[str, str]]:
    """Twenty (request, room) pairs: each phrasing with four of the rooms."""
    return [(ask.format(room=room), room) for ask in ASKS for room in ROOMS[:4]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving_http(model: str, threads: int):
    """`llmd serve --http` on a private socket and a free loopback port; yields the base URL."""
    port, sock = _free_port(), Path(tempfile.mkdtemp(prefix="llmd-tools-")) / "llmd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "llmd.daemon", "serve", "--model", model, "--socket", str(sock),
                             "--http", f"127.0.0.1:{port}", "--threads", str(threads), "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the daemon's HTTP front did not become ready")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def check(client, ask: str) -> tuple[bool, str]:
    """(one valid call to an offered function, what came back)."""
    r = client.chat.completions.create(model="llmd", messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                       tool_choice="required", max_tokens=96, temperature=0)
    calls = r.choices[0].message.tool_calls or []
    if len(calls) != 1:
        return False, f"{len(calls)} calls: {r.choices[0].message.content!r}"
    name, arguments = calls[0].function.name, calls[0].function.arguments
    try:
        ok = name in SCHEMAS and valid(json.loads(arguments), SCHEMAS[name])
    except ValueError:
        ok = False
    return ok, f"{name}({arguments})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory or GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="the daemon's threads")
    args = ap.parse_args(argv)
    import openai
    valid_calls = switched_on = right_room = 0
    with serving_http(args.model, args.threads) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
        for ask, room in prompts():
            ok, what = check(client, ask)
            valid_calls += ok
            switched_on += ok and what.startswith("turn_on(")
            right_room += ok and f'"{room}"' in what
            print(f"{'ok ' if ok else 'BAD'} {ask!r} -> {what}")
    n = len(prompts())
    print(f"valid calls: {valid_calls}/{n}; turn_on: {switched_on}/{n}; the room asked for: {right_room}/{n}")
    return 0 if valid_calls == n else 1


if __name__ == "__main__":
    sys.exit(main())
