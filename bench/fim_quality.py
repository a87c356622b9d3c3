"""Fill-in-the-middle quality: held-out functions with a statement removed, completed by the model.

    .venv/bin/python bench/fim_quality.py --model ENGINE_DIR --limit 100 --out /tmp/fim.jsonl

The cases are functions of the held-out stdlib split (``training.corpus.split``: no llmd model trained
on them; test folders and generated tables left out), chosen deterministically: candidates are sorted
by a hash of ``file:line``, at most ``--per-file`` per file. In each, one simple statement of the body
(up to four lines, not the docstring; also chosen by hash) is removed, the cursor left after its
first line's indentation (where an editor's auto-indent puts it). The prompt is the language
server's (``build_fim``): the text before and after the cursor cut to ``--prefix-tokens`` /
``--suffix-tokens`` at line boundaries.

Every variant completes each case greedily (up to ``--max-tokens``, stopping at a blank line), with
the prefix cache emptied before each case, so nothing is reused between cases. With ``--gguf`` the
same prompt token ids go to llama.cpp's server on that file instead (``/completion``, no prompt
cache): the layouts' cost on the file's own weights, for when llmd's run does not fit the time. The raw completion is trimmed as the editor
would show it (``trim_suggestion``), then scored:

* exact match: the trimmed completion equals the removed statement, line by line, trailing
  whitespace aside;
* parses: the whole file with the completion in place of the statement passes ``ast.parse``.

Variants (``--variants``, the first is the reference the others are compared with):
``psm`` (prefix, suffix, middle: the whole prompt as the model was trained), ``spm`` (suffix first:
what a keystroke changes comes last, so the rest stays cached), and ``psm-s64`` / ``spm-s64`` (the
suffix cut to 64 tokens), ``psm-line`` (the language server's default: the prefix ends at the start
of the cursor's line and the line up to the cursor, here its indentation, starts the middle). ``psm-shift`` (llmd only) is what shifted reuse costs: the case's
document as it was before its last keystroke (the character before the cursor) is computed first,
then the case's prompt takes the keys and values after the edit at their new positions;
``psm-shift-line``: the same from before the line above the cursor and the cursor line's indentation
were typed (within the engine's staleness bound, ``--shift-max-stale``; past it the engine computes
the text again, as the daemon would). Variants of one case share its
exact prefix cache (never approximate blocks); the shifted variant runs first. Results go to ``--out`` (JSON lines, one per case and variant) as they come,
and a rerun with the same ``--out`` skips what is there, so a long run can be stopped and resumed.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llmd import LLM, SamplingParams
from llmd.bench.bench_editor import default_file
from llmd.bench.llama_server import LlamaServer, binary
from llmd.clients.lsp_prompt import FimBudget, FimPrompt, build_fim
from llmd.clients.lsp_trim import trim_suggestion
from llmd.runtime.config import EngineConfig
from llmd.runtime.formats.gguf_import import resolve_model_path
from llmd.runtime.tokenizer import Tokenizer
from llmd.training.corpus import list_sources, read_source, split

SKIP_PARTS = {"test", "tests", "idle_test", "encodings", "pydoc_data", "data"}
SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr, ast.Raise, ast.Assert, ast.Delete,
          ast.Import, ast.ImportFrom, ast.Pass, ast.Break, ast.Continue, ast.Global, ast.Nonlocal)
STOP = ("\n\n",)     # a removed statement holds no blank line: what follows one is never shown as it
VARIANTS = {"psm": ("psm", None, "cursor"), "spm": ("spm", None, "cursor"), "psm-s64": ("psm", 64, "cursor"),
            "spm-s64": ("spm", 64, "cursor"), "psm-line": ("psm", None, "line"),
            "psm-shift": ("psm", None, "cursor"), "psm-shift-line": ("psm", None, "cursor")}


@dataclass(frozen=True)
class Case:
    id: str            # file:line of the removed statement
    text: str          # the whole file
    start: int         # character offsets of the removed lines
    end: int

    @property
    def middle(self) -> str:
        return self.text[self.start:self.end]

    @property
    def document(self) -> str:
        """The file as the editor holds it: the statement removed, the cursor at ``start``."""
        return self.text[:self.start] + self.text[self.end:]


def stable_hash(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def library_files() -> list:
    """Held-out library files, less the one the editor benchmark types through."""
    typed = default_file().resolve()
    held = split(list_sources())[1]
    return [f for f in held if not SKIP_PARTS.intersection(Path(f.rel).parts[:-1]) and f.path.resolve() != typed]


def file_cases(rel: str, text: str) -> list[Case]:
    """One candidate per function of ``text``: a simple statement of its body removed whole."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = line_starts(text)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.end_lineno - fn.lineno > 80:
            continue
        body = fn.body[1:] if is_docstring(fn.body[0]) else fn.body
        stmts = [s for b in body for s in ast.walk(b) if isinstance(s, SIMPLE) and s.end_lineno - s.lineno < 4
                 and not is_docstring(s)]
        stmts = [s for s in stmts if own_lines(text, starts, s)]
        if len(body) < 2 or not stmts:
            continue
        s = stmts[stable_hash(f"{rel}:{fn.lineno}") % len(stmts)]
        # the cursor after the first line's indentation, where an editor's auto-indent leaves it
        out.append(Case(f"{rel}:{s.lineno}", text, starts[s.lineno - 1] + s.col_offset, starts[s.end_lineno]))
    return out


def is_docstring(node) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def line_starts(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def own_lines(text: str, starts: list[int], s) -> bool:
    """The statement fills its lines alone (nothing before it on its first line, nothing after it,
    a comment aside, on its last)."""
    first = text[starts[s.lineno - 1]:starts[s.lineno]]
    last = text[starts[s.end_lineno - 1]:starts[s.end_lineno]].rstrip("\n")
    rest = last.encode()[s.end_col_offset:].decode(errors="ignore").strip()
    return s.col_offset == len(first) - len(first.lstrip()) and (not rest or rest.startswith("#"))


def select(limit: int, per_file: int) -> list[Case]:
    candidates = []
    for f in library_files():
        cases = sorted(file_cases(f.rel, read_source(f)), key=lambda c: stable_hash(c.id))
        candidates += cases[:per_file]
    return sorted(candidates, key=lambda c: stable_hash(c.id))[:limit]


def score(case: Case, raw: str) -> dict:
    before, after = case.text[:case.start], case.text[case.end:]
    shown = trim_suggestion(raw, before[before.rfind("\n") + 1:], "", after)
    exact = [ln.rstrip() for ln in shown.strip("\n").split("\n")] == \
        [ln.rstrip() for ln in case.middle.strip("\n").split("\n")]
    try:
        ast.parse(before + shown + "\n" + after)
        parses = True
    except (SyntaxError, ValueError):
        parses = False
    return {"exact": exact, "parses": parses, "shown": shown}


def typed_before(case: Case, variant: str) -> tuple[str, int]:
    """The case's document before its last keystroke (``psm-shift``: the character before the cursor)
    or before the line above the cursor and the cursor line's indentation were typed
    (``psm-shift-line``), and the cursor there."""
    doc = case.document
    if variant == "psm-shift":
        back = case.start - 1
    else:
        line = doc.rfind("\n", 0, case.start)                  # end of the line above the cursor
        back = doc.rfind("\n", 0, max(0, line)) + 1            # its start
    back = max(0, back)
    return doc[:back] + doc[case.start:], back


def prompts(tokenizer, cases: list[Case], variant: str, budget: FimBudget) -> list[tuple[list[int], FimPrompt]]:
    """Each case's prompt token ids, and the language server's prompt they come from (whose
    ``completion`` turns the model's text into the text after the cursor)."""
    layout, suffix_tokens, split = VARIANTS[variant]
    if suffix_tokens is not None:
        budget = FimBudget(budget.prefix_tokens, suffix_tokens, 0, budget.chars_per_token)
    out = []
    for c in cases:
        p = build_fim(c.document, c.start, (), budget, split)
        out.append((tokenizer.build_infill(p.prefix, p.suffix, (), layout, p.middle), p))
    return out


class LlmdCompleter:
    """llmd's engine in this process; the prefix cache is emptied before each case."""

    def __init__(self, args):
        self.llm = LLM(args.model, threads=args.threads, kv_memory=args.kv_memory,
                       shift_max_stale=args.shift_max_stale)
        self.tokenizer = self.llm.tokenizer
        self.params = SamplingParams(max_tokens=args.max_tokens, stop=STOP)
        self.last: dict = {}

    def new_case(self) -> None:
        self.llm.engine.block_manager.reset_prefix_cache()

    def __call__(self, prompt: list[int], before: list[int] | None = None) -> str:
        """``before``: a prompt computed first under the same reuse key (shifted reuse)."""
        key = None
        if before is not None:
            key = f"case{id(prompt)}"
            self.llm.generate([before], SamplingParams(max_tokens=1, prompt_only=True), reuse_key=key)
        out = self.llm.generate([prompt], self.params, reuse_key=key)[0]
        self.last = {"shifted_tokens": out.metrics.get("shifted_tokens", 0),
                     "computed_tokens": out.metrics["prompt_tokens"] - out.metrics["cached_tokens"]}
        return out.text

    def close(self) -> None:
        pass


class LlamaCompleter:
    """llama.cpp's server on --gguf, fed the same token ids on ``/completion``, greedy, no prompt cache
    (the layouts' cost on the file's own weights, much faster on this machine than llmd's int4 run)."""

    def __init__(self, args):
        self.tokenizer = Tokenizer.from_dir(resolve_model_path(args.model))
        self.server = LlamaServer()
        self.url = self.server.start(binary(), args.gguf, args.threads, ["-c", "8192", "-np", "1"])
        self.max_tokens = args.max_tokens

    last: dict = {}

    def new_case(self) -> None:
        pass

    def __call__(self, prompt: list[int], before: list[int] | None = None) -> str:
        if before is not None:
            raise ValueError("shifted reuse is llmd's: run psm-shift without --gguf")
        body = {"prompt": prompt, "n_predict": self.max_tokens, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "stop": list(STOP)}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["content"]

    def close(self) -> None:
        self.server.stop()


def run(args) -> dict:
    cases = select(args.limit, args.per_file)
    out = Path(args.out)
    done = {(r["id"], r["variant"]) for r in map(json.loads, out.read_text().splitlines())} if out.exists() else set()
    complete = LlamaCompleter(args) if args.gguf else LlmdCompleter(args)
    budget = FimBudget(args.prefix_tokens, args.suffix_tokens, 0, args.chars_per_token)
    print(f"{len(cases)} cases from {len({c.id.split(':')[0] for c in cases})} files; variants {args.variants}",
          file=sys.stderr)
    try:
        for i, case in enumerate(cases):          # case by case, every variant: a stopped run stays paired
            complete.new_case()
            # shifted variants first: the exact ones after them may take the prefix their first prompt
            # computed exactly, while a shifted one after an exact one would find its whole prompt cached
            todo = sorted((v for v in args.variants if (case.id, v) not in done), key=lambda v: not v.startswith("psm-shift"))
            for variant in todo:
                prompt, fim = prompts(complete.tokenizer, [case], variant, budget)[0]
                before = None
                if variant.startswith("psm-shift"):
                    text, cursor = typed_before(case, variant)
                    p = build_fim(text, cursor, (), budget)
                    before = complete.tokenizer.build_infill(p.prefix, p.suffix, (), "psm")
                t = time.perf_counter()
                raw = fim.completion(complete(prompt, before))
                row = {"id": case.id, "variant": variant, "prompt_tokens": len(prompt), "raw": raw,
                       "ms": round(1000 * (time.perf_counter() - t), 1), **complete.last, **score(case, raw)}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"[{variant}] {i + 1}/{len(cases)} {case.id} exact={row['exact']} parses={row['parses']} "
                      f"({row['ms']:.0f} ms)", file=sys.stderr)
    finally:
        complete.close()
    return summarize(out, cases, args.variants)


def summarize(out: Path, cases: list[Case], variants: list[str]) -> dict:
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r["id"] in {c.id for c in cases}]
    paired = set.intersection(*({r["id"] for r in rows if r["variant"] == v} for v in variants))
    rows = [r for r in rows if r["id"] in paired]          # only cases every variant completed
    table = {}
    for v in variants:
        mine = {r["id"]: r for r in rows if r["variant"] == v}
        n = len(mine)
        table[v] = {"n": n, "exact_pct": 100 * sum(r["exact"] for r in mine.values()) / n if n else None,
                    "parses_pct": 100 * sum(r["parses"] for r in mine.values()) / n if n else None,
                    "shifted": sum(1 for r in mine.values() if r.get("shifted_tokens")),
                    "same_text": sum(1 for i, r in mine.items() if rows and r["raw"] == next(
                        x["raw"] for x in rows if x["id"] == i and x["variant"] == variants[0]))}
    return table


def main() -> int:
    # a plain kill should still stop the servers started here (their context managers' exits)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="engine directory, model directory or GGUF file (with "
                   "--gguf: where the prompts' tokenizer comes from, e.g. the same GGUF file)")
    p.add_argument("--gguf", help="complete with llama.cpp's server on this GGUF file instead of llmd (the same "
                   "prompt token ids, built with --model's tokenizer)")
    p.add_argument("--limit", type=int, default=100, help="cases (default 100)")
    p.add_argument("--per-file", type=int, default=6, help="most cases from one file (default 6)")
    p.add_argument("--variants", default="psm,spm", help="comma-separated, the first is the reference "
                   f"(choices: {', '.join(VARIANTS)}; default psm,spm)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="prefix budget (default 1024)")
    p.add_argument("--suffix-tokens", type=int, default=256, help="suffix budget (default 256, the language "
                   "server's)")
    p.add_argument("--chars-per-token", type=float, default=3.0, help="budget characters per token (default 3)")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens per completion (default 48)")
    p.add_argument("--threads", type=int, default=2, help="engine threads (default 2)")
    p.add_argument("--shift-max-stale", type=int, default=EngineConfig.shift_max_stale,
                   help=f"llmd's staleness bound for the psm-shift variants (default {EngineConfig.shift_max_stale})")
    p.add_argument("--kv-memory", default="256MiB", help="KV cache size (default 256MiB)")
    p.add_argument("--out", required=True, help="results, JSON lines; kept rows are not run again")
    p.add_argument("--list", action="store_true", help="print the chosen cases and exit")
    p.add_argument("--report", action="store_true", help="only print the table of what --out holds (the cases "
                   "every variant completed)")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or args.limit < 1:
        p.error(f"unknown variant(s) {unknown}" if unknown else "--limit must be >= 1")
    if args.list:
        for c in select(args.limit, args.per_file):
            print(c.id, repr(c.middle))
        return 0
    table = summarize(Path(args.out), select(args.limit, args.per_file), args.variants) if args.report else run(args)
    ref = table[args.variants[0]]
    for v, row in table.items():
        gap = "" if v == args.variants[0] or not row["n"] else (
            f"  (exact {row['exact_pct'] - ref['exact_pct']:+.1f} points, parses "
            f"{row['parses_pct'] - ref['parses_pct']:+.1f} points against {args.variants[0]})")
        print(f"{v}: n {row['n']}, exact match {row['exact_pct']:.1f} %, parses {row['parses_pct']:.1f} %{gap}; "
              f"shifted {row['shifted']}, same completion as {args.variants[0]} {row['same_text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
