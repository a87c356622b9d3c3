"""Measure the demo pair on held-out stdlib files and write the figures into the model cards.

Three measurements, all on files the models never trained on:

- held-out loss: mean next-token cross-entropy (nats) on windows of the held-out token stream, which
  mixes plain files and fill-in-the-middle samples as training did.
- greedy acceptance: for a completion prompt, the target's greedy continuation g is decoded once. A
  draft proposing 4 tokens at position i has its proposals accepted up to the first one that differs
  from g, and decoding continues at i + accepted + 1 (the target's own token). Because a draft's
  proposal only matters while it agrees with g, the draft's greedy choices along g (one forward pass
  over prompt + g) decide every round exactly as a real speculative loop would.
- fill-in-the-middle: 1 to 3 lines are cut out of a held-out function (only where the rest alone does
  not parse); the target writes the middle from prefix and suffix, and we check that
  prefix + middle + suffix parses. The same check with an
  empty suffix shows what the suffix contributes.

Greedy decoding uses the same weights through transformers' KV cache, which is much faster here
than re-running the dense forward; the loss and the draft passes use llmd's own model.
"""
from __future__ import annotations

import ast
import json
import platform
import random
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmd.clients.lsp_trim import trim_suggestion
from llmd.runtime.models.loader import load_model

from . import corpus
from .distill import ON_POLICY_GEN, ON_POLICY_PROMPT
from .train_loop import DocSampler

PROPOSE = 4
PROMPT_TOKENS, CONTINUE_TOKENS = 128, 32
FIM_MAX_NEW = 64


# ---- held-out loss -----------------------------------------------------------------------------
@torch.no_grad()
def heldout_loss(model, tokens: np.ndarray, windows: int = 64, seq_len: int = 512, seed: int = 0) -> float:
    width = seq_len + 1
    starts = np.random.default_rng(seed).choice(len(tokens) // width, size=windows, replace=False) * width
    total = 0.0
    for s in starts:
        row = torch.from_numpy(tokens[s:s + width].astype(np.int64))[None]
        logits = model.forward_dense(row[:, :-1])
        total += F.cross_entropy(logits[0].float(), row[0, 1:]).item()
    return total / windows


# ---- greedy decoding with a KV cache (transformers, same weights) --------------------------------
@torch.no_grad()
def greedy(hf_model, ids: torch.Tensor, max_new: int, stop_id: int | None = None) -> torch.Tensor:
    """[B, T] -> [B, max_new] greedy tokens; rows stop growing meaningfully after stop_id."""
    out = hf_model(input_ids=ids, use_cache=True)
    past, new = out.past_key_values, []
    nxt = out.logits[:, -1].argmax(-1)
    for _ in range(max_new):
        new.append(nxt)
        if stop_id is not None and ids.shape[0] == 1 and nxt.item() == stop_id:
            break
        out = hf_model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    return torch.stack(new, dim=1)


def completion_prompts(files, encode, n: int, seed: int) -> torch.Tensor:
    """n prompts of PROMPT_TOKENS tokens from random places in held-out files (plain text, no FIM)."""
    rng = random.Random(seed)
    streams = [ids for ids in (encode(corpus.read_source(f)) for f in files)
               if len(ids) > PROMPT_TOKENS + CONTINUE_TOKENS]
    rows = []
    for _ in range(n):
        ids = rng.choice(streams)
        s = rng.randrange(len(ids) - PROMPT_TOKENS - CONTINUE_TOKENS)
        rows.append(ids[s:s + PROMPT_TOKENS])
    return torch.tensor(rows)


@torch.no_grad()
def acceptance(draft, prompts: torch.Tensor, continuation: torch.Tensor) -> dict:
    """Accepted / proposed draft tokens, 4 proposed per round, along the target's greedy path."""
    seq = torch.cat([prompts, continuation], dim=1)
    guess = draft.forward_dense(seq).argmax(-1)[:, PROMPT_TOKENS - 1:-1]    # draft's pick for g[j]
    agree = (guess == continuation).tolist()
    accepted = proposed = rounds = 0
    for row in agree:
        i = 0
        while i + PROPOSE <= len(row):
            k = 0
            while k < PROPOSE and row[i + k]:
                k += 1
            accepted, proposed, rounds = accepted + k, proposed + PROPOSE, rounds + 1
            i += k + 1
    return {"accepted": accepted, "proposed": proposed, "rate": accepted / proposed,
            "tokens_per_target_pass": (accepted + rounds) / rounds}


# ---- fill-in-the-middle --------------------------------------------------------------------------
def fim_cases(files, n: int, seed: int, max_chars: int = 1200) -> list[tuple[str, str, str]]:
    """(prefix, middle, suffix): middle is 1 to 3 whole lines of a held-out function's body, chosen so
    that prefix + suffix alone does not parse (an empty middle never passes the check)."""
    rng = random.Random(seed)
    pool = []
    for f in files:
        text = corpus.read_source(f)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                src = ast.get_source_segment(text, node, padded=True)
                if src and len(src) <= max_chars and src.count("\n") >= 3:
                    pool.append(textwrap.dedent(src))
    rng.shuffle(pool)
    cases = []
    for src in pool:
        lines = src.splitlines(keepends=True)
        a = rng.randrange(1, len(lines))
        b = min(len(lines), a + rng.randint(1, 3))
        pre, mid, suf = "".join(lines[:a]), "".join(lines[a:b]), "".join(lines[b:])
        if mid.strip() and len(mid) <= 160 and parses(src) and not parses(pre + suf):
            cases.append((pre, mid, suf))
        if len(cases) == n:
            break
    return cases


def parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


def fim_prompt(tok, pre: str, suf: str) -> list[int]:
    """``<|fim_prefix|>`` prefix ``<|fim_suffix|>`` suffix ``<|fim_middle|>``, as in training."""
    ids = {t: tok.token_to_id(t) for t in (corpus.FIM_PREFIX, corpus.FIM_SUFFIX, corpus.FIM_MIDDLE)}
    return ([ids[corpus.FIM_PREFIX]] + tok.encode(pre).ids + [ids[corpus.FIM_SUFFIX]] + tok.encode(suf).ids
            + [ids[corpus.FIM_MIDDLE]])


def fim_check(hf_model, tok, cases, with_suffix: bool, editor: bool = False) -> dict:
    """Fraction of cases where prefix + generated middle + suffix parses, and exact middles.

    ``editor``: as llmd's editor plugin sees it: the cursor on a fresh empty line where the lines were
    (the suffix starts with that line's newline), and the raw middle trimmed as the plugin trims
    ghost text (``clients/lsp_trim.py``) before the check."""
    eot = tok.token_to_id(corpus.EOT)
    ok = exact = 0
    for pre, mid, suf in cases:
        after = "\n" + suf if editor else suf
        prompt = fim_prompt(tok, pre, after if with_suffix else "")
        out = greedy(hf_model, torch.tensor([prompt]), FIM_MAX_NEW, stop_id=eot)[0].tolist()
        if eot in out:
            out = out[:out.index(eot)]
        middle = tok.decode(out, skip_special_tokens=True)
        if editor:
            middle = trim_suggestion(middle, "", "", after)
        ok += parses(pre + middle + after)
        exact += middle.strip() == mid.strip()
    return {"cases": len(cases), "parses": ok / len(cases), "exact": exact / len(cases)}


def fim_middle_loss(hf_model, tok, cases, with_suffix: bool) -> dict:
    """Mean loss (nats per token) of the true middle and of the `<|endoftext|>` that ends it, given the
    prefix and the suffix or an empty suffix: how much the model draws from the suffix, which the
    parse check only shows once its middles are good enough to parse."""
    eot = tok.token_to_id(corpus.EOT)
    total = n = end = 0.0
    with torch.no_grad():
        for pre, mid, suf in cases:
            prompt = fim_prompt(tok, pre, suf if with_suffix else "")
            answer = tok.encode(mid).ids + [eot]
            logp = hf_model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            nll = -logp.gather(1, torch.tensor(answer)[:, None])[:, 0]
            total, n, end = total + nll[:-1].sum().item(), n + len(answer) - 1, end + nll[-1].item()
    return {"middle": total / n, "end": end / len(cases)}


# ---- the whole evaluation --------------------------------------------------------------------------
def evaluate(work: Path, out: Path, seed: int = 0) -> dict:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(out / "code-target" / "tokenizer.json"))
    tok.encode_special_tokens = True
    split = json.loads((work / "split.json").read_text())
    root = corpus.stdlib_root()
    held = [corpus.SourceFile(rel, root / rel) for rel in split["heldout"]]
    heldout = np.load(work / "heldout.npy", allow_pickle=False)
    models = {"target": out / "code-target", "draft": out / "code-draft", "raw draft": work / "code-draft-raw"}
    results: dict = {"loss": {}, "acceptance": {}}
    t0 = time.monotonic()
    loaded = {name: load_model(d) for name, d in models.items() if (d / "model.safetensors").is_file()}
    for name, m in loaded.items():
        results["loss"][name] = heldout_loss(m, heldout)
    hf = AutoModelForCausalLM.from_pretrained(str(models["target"]), dtype=torch.float32).eval()
    prompts = completion_prompts(held, lambda s: tok.encode(s, add_special_tokens=False).ids, 200, seed)
    probe = prompts[:2]
    results["hf_max_logit_diff"] = (hf(input_ids=probe).logits - loaded["target"].forward_dense(probe)).abs().max().item()
    cont = torch.cat([greedy(hf, prompts[i:i + 50], CONTINUE_TOKENS) for i in range(0, len(prompts), 50)])
    for name in ("draft", "raw draft"):
        if name in loaded:
            results["acceptance"][name] = acceptance(loaded[name], prompts, cont)
    cases = fim_cases(held, 100, seed)
    results["fim"] = {"with_suffix": fim_check(hf, tok, cases, True),
                      "without_suffix": fim_check(hf, tok, cases, False),
                      "editor_with_suffix": fim_check(hf, tok, cases, True, editor=True),
                      "editor_without_suffix": fim_check(hf, tok, cases, False, editor=True),
                      "loss_with_suffix": fim_middle_loss(hf, tok, cases, True),
                      "loss_without_suffix": fim_middle_loss(hf, tok, cases, False)}
    results["flops_ratio"] = loaded["draft"].config.flops_per_token() / loaded["target"].config.flops_per_token()
    results["params"] = {n: m.config.num_parameters() for n, m in loaded.items()}
    results["window_fill"] = DocSampler(np.load(work / "train.npy", mmap_mode="r"), 512, 8, 0,
                                         tok.token_to_id(corpus.EOT)).fill()
    results["eval_s"] = time.monotonic() - t0
    return results


def evaluate_and_write_cards(work: Path, out: Path, command: str, runs: dict, on_policy: int) -> dict:
    """Measure the three models and write both model cards; ``runs`` are the training runs' records and
    ``on_policy`` the number of windows the draft's distillation drew from the target."""
    results = evaluate(work, out)
    (work / "eval.json").write_text(json.dumps(results, indent=2))
    for name in ("code-target", "code-draft"):
        (out / name / "MODEL_CARD.md").write_text(model_card(name, out, work, results, runs, command, on_policy))
    print(json.dumps(results, indent=2))
    return results


# ---- model cards -------------------------------------------------------------------------------
def _run_line(name: str, run: dict | None) -> str:
    if not run:
        return f"| {name} | not run | | | |"
    c = run["config"]
    tokens = run["step"] * c["batch_size"] * c["seq_len"]
    return (f"| {name} | {run['step']} | {tokens / 1e6:.2f}M | {run['elapsed_s'] / 60:.1f} min | "
            f"{run['loss_ema']:.3f} | {c['lr']:g} | {c['seed']} |")


def model_card(name: str, out: Path, work: Path, results: dict, runs: dict, command: str, on_policy: int) -> str:
    split = json.loads((work / "split.json").read_text())
    n_train = len(np.load(work / "train.npy", mmap_mode="r"))
    n_held = len(np.load(work / "heldout.npy", mmap_mode="r"))
    role = ("the **target** of llmd's bundled demo pair" if name == "code-target" else
            "the **draft** of llmd's bundled demo pair, distilled from `code-target` with `llmd distill`")
    acc, fim, loss = results["acceptance"], results["fim"], results["loss"]
    fill = results.get("window_fill", 1.0)
    acc_rows = "\n".join(f"| {n} | {a['rate']:.3f} | {a['accepted']} / {a['proposed']} | "
                          f"{a['tokens_per_target_pass']:.2f} |" for n, a in acc.items())
    loss_rows = "\n".join(f"| {n} | {v:.3f} | {results['params'].get(n, 0) / 1e6:.2f}M |" for n, v in loss.items())
    return f"""# {name}

This is {role}. It is a small Llama (`LlamaForCausalLM`, Hugging Face layout,
{json.loads((out / name / "config.json").read_text())["torch_dtype"]} safetensors) trained from scratch on the Python standard library's own sources, so every machine can rebuild it
without a download. It completes Python code and fills in the middle; it does not chat.

## Data

- Source: every `.py` file under `sysconfig.get_paths()["stdlib"]` (Python {platform.python_version()}),
  excluding `site-packages`, `dist-packages` and `__pycache__`; bytes that are not UTF-8 are dropped.
- Split by file: a file is held out when the first 8 bytes of sha256(relative path), read as a
  fraction of 2^64, are below 0.05. {len(split["train"])} training files, {len(split["heldout"])} held-out files.
- Samples: each file is cut into line-aligned chunks of 300 to 1,700 characters (a limit drawn per
  chunk); about half are rearranged for fill-in-the-middle as `<|fim_prefix|>` prefix `<|fim_suffix|>`
  suffix `<|fim_middle|>` middle: half of those cut at two random character positions, half taking 1 to
  4 whole lines as the middle. Every sample ends with `<|endoftext|>`. The training stream holds the
  training files twice, cut and rearranged with two seeds (1234, 2234), so a second pass sees new
  samples. {n_train / 1e6:.2f}M training tokens, {n_held / 1e6:.3f}M held-out tokens (seed 1235).
- Tokenizer: byte-level BPE trained with `tokenizers` on the training files, 8,192 ids; ids 0-6 are
  `<|endoftext|>`, `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`, `<|fim_pad|>`, `<|file_sep|>`,
  `<|repo_name|>`. Text that spells a control token is encoded as ordinary text.

## How it was made

```
{command}
```

Training: AdamW (betas 0.9/0.95, weight decay 0.1), bfloat16 autocast on CPU, batches of 8 windows of
513 tokens, cosine learning rate over the run's steps, 2 CPU threads; each run ends at its step count
(a wall-clock cap, 90 minutes for the target and 60 for the draft, ends a run early only on a slow
machine), so a rebuild repeats the same batches and learning rates. Each window is packed with
whole samples (first fit, in a seeded order that changes every epoch) and padded, untrained, to its
length ({fill:.1%} of positions hold tokens), so a fill-in-the-middle sample is always trained with
its prefix and suffix in view. The draft minimises KL(target || draft) over the full vocabulary at every position,
on a stream that is half the target's own greedy continuations of {on_policy:,} corpus windows
({ON_POLICY_GEN} tokens after {ON_POLICY_PROMPT}; speculation is judged on text the target writes) and half training text; the raw draft has the
draft's shape and is trained on the training stream with plain cross-entropy, for comparison only (it is
not committed). The draft stage is `llmd distill` called on the data stage's stream; as a command of its
own (which reads one arrangement of the training files instead of two, and warms up over 30 steps instead of 50) it is
{_distill_command(runs.get("draft"), on_policy)}.

| run | steps | window positions | wall time | final train loss (EMA) | peak lr | seed |
|---|---|---|---|---|---|---|
{_run_line("target (cross-entropy)", runs.get("target"))}
{_run_line("draft (KL to target)", runs.get("draft"))}
{_run_line("raw draft (cross-entropy)", runs.get("raw"))}

The draft costs {results["flops_ratio"]:.3f} of the target's matmul FLOPs per token (limit 1/6).

## Evaluation (held-out files only)

Held-out next-token loss (nats per token, 64 windows of 512 tokens of the held-out stream, which mixes
plain and fill-in-the-middle samples like training):

| model | loss | parameters |
|---|---|---|
{loss_rows}

Greedy acceptance: 200 completion prompts of {PROMPT_TOKENS} tokens from held-out files; the target
decodes {CONTINUE_TOKENS} tokens greedily, the draft proposes {PROPOSE} tokens per round and a proposal
is accepted up to the first token the target's greedy choice rejects.

| draft | accepted fraction | accepted / proposed | tokens per target pass |
|---|---|---|---|
{acc_rows}

Fill-in-the-middle: {fim["with_suffix"]["cases"]} held-out functions with 1 to 3 whole body lines removed,
chosen so that the function does not parse without them; the target generates greedily (at most {FIM_MAX_NEW} tokens, until `<|endoftext|>`), and
`ast.parse(prefix + middle + suffix)` is checked.

| prompt | parses | middle exactly right |
|---|---|---|
| prefix and suffix | {fim["with_suffix"]["parses"]:.2f} | {fim["with_suffix"]["exact"]:.2f} |
| prefix only (empty suffix) | {fim["without_suffix"]["parses"]:.2f} | {fim["without_suffix"]["exact"]:.2f} |
{_editor_rows(fim)}{_fim_loss_lines(fim)}
`transformers`' `AutoModelForCausalLM.from_pretrained` loads this directory; its logits differ from
llmd's by at most {results["hf_max_logit_diff"]:.1e}. Evaluation took {results["eval_s"]:.0f} s.

## Limits

A demo model: {results["params"].get("target", 0) / 1e6:.1f}M parameters trained for
{runs.get("target", {}).get("elapsed_s", 0) / 60:.0f} minutes on two CPU cores over {_tokens(runs.get("target"))} window
positions of a {n_train / 1e6:.1f}M-token stream. It writes standard-library-flavoured Python that is often wrong and
repetitive. {_fim_verdict(fim)}{_loss_note(loss, runs)} A larger `--target-steps` (and a machine with more
cores) should improve every figure above. Use your own models for real work.
"""


def _editor_rows(fim: dict) -> str:
    """The check as llmd's editor plugin shows completions (cursor on a fresh line, ghost text trimmed)."""
    if "editor_with_suffix" not in fim:
        return ""
    a, b = fim["editor_with_suffix"], fim["editor_without_suffix"]
    return (f"| editor view, prefix and suffix (trimmed as ghost text) | {a['parses']:.2f} | {a['exact']:.2f} |\n"
            f"| editor view, prefix only | {b['parses']:.2f} | {b['exact']:.2f} |\n")


def _fim_loss_lines(fim: dict) -> str:
    """The true middle's loss with and without the suffix: whether the model reads the suffix at all."""
    if "loss_with_suffix" not in fim:
        return ""
    a, b = fim["loss_with_suffix"], fim["loss_without_suffix"]
    return (f"\nThe same cases scored instead of generated: the true middle's loss is {a['middle']:.3f} nats per "
            f"token given the suffix and {b['middle']:.3f} given an empty one (the suffix "
            f"{'lowers' if a['middle'] <= b['middle'] else 'raises'} it by {abs(b['middle'] - a['middle']):.3f}); the `<|endoftext|>` that ends it costs {a['end']:.2f} and {b['end']:.2f}.\n")


def _distill_command(run: dict | None, on_policy: int) -> str:
    """The stand-alone `llmd distill` command for the draft stage's configuration."""
    c = run["config"] if run else {"max_steps": "N", "seed": "S", "budget_s": None}
    minutes = f"{c['budget_s'] / 60:g}" if c["budget_s"] else "M"
    return (f"`llmd distill --target models/code-target --out models/code-draft --on-policy {on_policy} "
            f"--steps {c['max_steps']} --seed {c['seed']} --minutes {minutes} --threads 2`")


def _tokens(run: dict | None) -> str:
    if not run:
        return "none"
    c = run["config"]
    return f"{run['step'] * c['batch_size'] * c['seq_len'] / 1e6:.2f}M"


def _loss_note(loss: dict, runs: dict) -> str:
    if loss.get("raw draft", float("inf")) >= loss.get("target", float("-inf")):
        return ""
    return (f" The target is undertrained: the raw draft, which saw {_tokens(runs.get('raw'))} tokens to the "
            f"target's {_tokens(runs.get('target'))}, reaches a lower held-out loss; what the distilled draft "
            "learned is agreement with this target, which is what speculative decoding needs.")


def _fim_verdict(fim: dict) -> str:
    rate = fim["with_suffix"]["parses"]
    gain = rate - fim["without_suffix"]["parses"]
    reads = ""
    if "loss_with_suffix" in fim:
        drop = fim["loss_without_suffix"]["middle"] - fim["loss_with_suffix"]["middle"]
        reads = (f" Given the suffix, the true middle's loss changes by {-drop:+.2f} nats per token: "
                 + ("the model hardly reads the suffix." if drop < 0.1 else "the model does read the suffix."))
    if rate < 0.2:
        return ("Fill-in-the-middle is not learned at this budget: the prompt format is right (the control "
                "tokens are in place and trained on), but the generated middles rarely make the function parse."
                + reads)
    return f"Fill-in-the-middle works in {rate:.0%} of the checked cases, {gain:+.0%} against an empty suffix." + reads
