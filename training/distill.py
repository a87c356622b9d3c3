"""``llmd distill``: train a small draft model to predict what a target model predicts.

The draft learns the target's whole next-token distribution (KL(target || draft) at every position),
not just the corpus' next token, so its guesses agree with the target's greedy choices more often
than a draft trained on the same text alone; that agreement is what speculative decoding spends.

    llmd distill --target models/code-target --out my-draft [--corpus DIR] [--minutes 20] [--on-policy 3000]

With ``--on-policy N`` half the data is the target's own greedy continuations of N corpus windows
(speculation is judged on text the target writes).

Runs resume from ``<out>.ckpt/`` (or ``--work``). A draft must share the target's tokenizer: an
``--init`` model or an existing ``--out`` directory with a different one is refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from llmd.export.whole_dir import write_whole
from llmd.runtime.errors import LLMDError, ModelLoadError
from llmd.runtime.llm import LLM
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.llama import LlamaForCausalLM
from llmd.runtime.models.loader import load_model
from llmd.runtime.request import SamplingParams

from . import bpe, corpus
from .model_dir import write_model_dir
from .train_loop import PAD, DocSampler, TrainConfig, init_weights, train

DEFAULT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=2)
MAX_FLOPS_RATIO = 1 / 6
ON_POLICY_PROMPT, ON_POLICY_GEN = 128, 64     # an on-policy sample: a corpus window, then the target's tokens


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """A model's tokenizer.json, or a clear error when it is missing."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: file is missing; a draft and its target need tokenizer.json")
    return Tokenizer.from_file(str(path))


def tokenizer_signature(model_dir: Path) -> dict:
    """What decides token ids: the vocabulary with added tokens, and the BPE merges."""
    tok = load_tokenizer(model_dir)
    model = json.loads(tok.to_str()).get("model", {})
    return {"vocab": tok.get_vocab(with_added_tokens=True), "merges": model.get("merges"),
            "type": model.get("type")}


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Raise ModelLoadError naming the first difference when the two tokenizers would disagree."""
    a, b = tokenizer_signature(target_dir), tokenizer_signature(draft_dir)
    if a == b:
        return
    if a["type"] != b["type"]:
        why = f"tokenizer types differ ({a['type']} vs {b['type']})"
    elif len(a["vocab"]) != len(b["vocab"]):
        why = f"vocabulary sizes differ ({len(a['vocab'])} vs {len(b['vocab'])})"
    elif a["vocab"] != b["vocab"]:
        tok = next(t for t in sorted(a["vocab"]) if a["vocab"][t] != b["vocab"].get(t))
        why = f"token {tok!r} has id {a['vocab'][tok]} in the target but {b['vocab'].get(tok)} in the draft"
    else:
        why = "BPE merges differ"
    raise ModelLoadError(f"draft {draft_dir} and target {target_dir} use different tokenizers: {why}; "
                         "a draft must use its target's tokenizer")


def end_of_text_id(model_dir: Path) -> int:
    """The id of ``<|endoftext|>`` in a model's tokenizer: distillation ends every sample with it."""
    end_id = load_tokenizer(model_dir).token_to_id(corpus.EOT)
    if end_id is None:
        raise ModelLoadError(f"{Path(model_dir) / 'tokenizer.json'} has no {corpus.EOT} token: distillation ends "
                             "each training sample with it")
    return end_id


def preflight(target_dir: Path, out: Path, init: Path | None) -> None:
    """Fail before any work when the target (or an --init draft) is unreadable, when the target's
    tokenizer has no end-of-text token, or when a draft that already sits in ``out`` or ``init`` has
    another tokenizer."""
    for d in (target_dir, init):
        if d is not None:
            ModelConfig.from_dir(d)
    out, target_dir = Path(out), Path(target_dir)
    if out.resolve() in (target_dir.resolve(), *target_dir.resolve().parents):
        raise ValueError(f"--out {out} would replace the target model ({target_dir}) or a directory holding it")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not any((out / f).is_file() for f in ("config.json", "tokenizer.json")))):
        raise ValueError(f"--out {out} exists and is not a model directory; the draft replaces --out when it is "
                         "written, so choose a new or empty directory (or an earlier draft)")
    end_of_text_id(target_dir)
    for other in (init, out if (out / "tokenizer.json").is_file() else None):
        if other is not None:
            check_same_tokenizer(target_dir, other)


def draft_config(target_cfg: dict, shape: dict, seq_len: int) -> dict:
    keep = ("vocab_size", "bos_token_id", "eos_token_id", "rms_norm_eps", "rope_theta")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
            **{k: target_cfg[k] for k in keep if k in target_cfg}, "max_position_embeddings": seq_len,
            "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32"}


def kl_loss(target: LlamaForCausalLM):
    """KL(target || draft) per position, averaged over positions that hold a token (not PAD); the
    target runs without gradients."""
    def loss(draft: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
        inputs, real = batch[:, :-1].clamp(min=0), (batch[:, 1:] != PAD).flatten()
        with torch.no_grad():
            t_logp = F.log_softmax(target.forward_dense(inputs).float(), dim=-1).flatten(0, 1)[real]
        d_logp = F.log_softmax(draft.forward_dense(inputs).float(), dim=-1).flatten(0, 1)[real]
        return F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
    return loss


def distill(target_dir: Path, out: Path, tokens: np.ndarray, cfg: TrainConfig, work: Path,
            shape: dict | None = None, init: Path | None = None, session_steps: int | None = None) -> dict:
    """Distill a draft of ``shape`` (or starting from ``init``) into ``out``; returns the loop state."""
    target_dir, out = Path(target_dir), Path(out)
    preflight(target_dir, out, init)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target = load_model(target_dir)
    target.requires_grad_(False)
    if cfg.seq_len > target.config.max_position_embeddings:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the target's context "
                         f"{target.config.max_position_embeddings}")
    if init is not None:
        config = json.loads((Path(init) / "config.json").read_text())
        draft = load_model(init)
        draft.requires_grad_(True)
    else:
        config = draft_config(target_cfg, shape or DEFAULT_SHAPE, cfg.seq_len)
        draft = LlamaForCausalLM(ModelConfig.from_dict(config))
        init_weights(draft, cfg.seed)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ModelLoadError(f"draft vocabulary {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}")
    ratio = draft.config.flops_per_token() / target.config.flops_per_token()
    if ratio > MAX_FLOPS_RATIO:
        print(f"warning: the draft costs {ratio:.2f} of the target's FLOPs per token; "
              f"speculation pays best under {MAX_FLOPS_RATIO:.2f}")
    sampler = DocSampler(tokens, cfg.seq_len, cfg.batch_size, cfg.seed, end_of_text_id(target_dir))
    state = train(draft, sampler, cfg, work, loss_fn=kl_loss(target), desc="distill", session_steps=session_steps)
    write_whole(out, lambda d: write_model_dir(draft, config, target_dir, d))   # tokenizer files: the target's
    return state


def corpus_tokens(target_dir: Path, root: Path | None, work: Path, seed: int) -> np.ndarray:
    """The training split of a directory of .py files (default: the stdlib), in the target's tokens.
    Cached in the work directory so a resumed run reads the same stream."""
    cache = work / "tokens.npy"
    if cache.is_file():
        return np.load(cache, allow_pickle=False)
    files = corpus.split(corpus.list_sources(root))[0]
    if not files:
        raise ValueError(f"no .py files found under {root or corpus.stdlib_root()}")
    tok = load_tokenizer(target_dir)
    # fill-in-the-middle samples only for a target that has the control tokens for them
    fim = all(tok.token_to_id(t) is not None for t in (corpus.FIM_PREFIX, corpus.FIM_SUFFIX, corpus.FIM_MIDDLE))
    tokens = bpe.encode_pieces(tok, corpus.make_pieces(files, seed, fim_rate=0.5 if fim else 0.0))
    work.mkdir(parents=True, exist_ok=True)
    np.save(cache, tokens)
    return tokens


def on_policy_tokens(target_dir: Path, tokens: np.ndarray, n: int, work: Path, seed: int, seq_len: int,
                     batch: int = 64) -> np.ndarray:
    """The target's own greedy continuations of ``n`` windows of the corpus, each written as
    ``window + continuation + <|endoftext|>`` (cached in ``work``).

    Speculation accepts a proposal when it is the target's greedy choice on text the target itself
    writes; KL on corpus text alone spends the draft's small capacity on text the target would not
    produce. Windows holding a control token are skipped (they are fill-in-the-middle samples)."""
    from tqdm import tqdm

    cache = work / f"onpolicy-{n}.npy"
    if cache.is_file():
        return np.load(cache, allow_pickle=False)
    end_id = end_of_text_id(target_dir)
    tok = load_tokenizer(target_dir)
    control = np.array(sorted(tok.get_added_tokens_decoder()), dtype=np.int64)
    ctx = min(seq_len, ModelConfig.from_dir(target_dir).max_position_embeddings)
    prompt_len = min(ON_POLICY_PROMPT, 2 * ctx // 3)           # a short context keeps a third for the answer
    gen = min(ON_POLICY_GEN, ctx - prompt_len - 1)
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for _ in range(100 * n):
        if len(prompts) == n or len(tokens) <= prompt_len:
            break
        start = int(rng.integers(0, len(tokens) - prompt_len))
        window = np.asarray(tokens[start:start + prompt_len], dtype=np.int64)
        if not np.isin(window, control).any():
            prompts.append(window.tolist())
    if len(prompts) < n:
        raise ValueError(f"the corpus holds too few plain {prompt_len}-token windows for {n} on-policy samples")
    llm = LLM(str(target_dir), dtype="float32", kv_memory="1GiB", max_batch_tokens=2048)
    params = SamplingParams(max_tokens=gen, temperature=0.0)
    out: list[int] = []
    with tqdm(total=n, desc="target continuations", dynamic_ncols=True, mininterval=2) as bar:
        for i in range(0, n, batch):
            for prompt, done in zip(prompts[i:i + batch], llm.generate(prompts[i:i + batch], params)):
                ids = done.token_ids
                out += prompt + ids + ([] if ids and ids[-1] == end_id else [end_id])
            bar.update(len(prompts[i:i + batch]))
    stream = np.array(out, dtype=tokens.dtype)
    work.mkdir(parents=True, exist_ok=True)
    np.save(cache, stream)
    return stream


def with_on_policy(target_dir: Path, tokens: np.ndarray, n: int, work: Path, seed: int, seq_len: int) -> np.ndarray:
    """Half on-policy samples, half corpus text (a seeded stretch of the same length), so the draft
    keeps following the target on text it did not write."""
    onp = on_policy_tokens(target_dir, tokens, n, work, seed, seq_len)
    start = int(np.random.default_rng(seed + 1).integers(0, max(1, len(tokens) - len(onp))))
    return np.concatenate([onp, np.asarray(tokens[start:start + len(onp)], dtype=onp.dtype)])


# ---- command line ------------------------------------------------------------------------------
def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("distill", help="train a draft model from a target (KL distillation)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model directory (Hugging Face layout)")
    p.add_argument("--out", type=Path, required=True,
                   help="where the draft model directory is written (new, empty, or an earlier draft it replaces)")
    p.add_argument("--corpus", type=Path, default=None, help="directory of .py files (default: the stdlib)")
    p.add_argument("--work", type=Path, default=None, help="checkpoint directory (default: <out>.ckpt)")
    p.add_argument("--init", type=Path, default=None, help="start from this draft model instead of random")
    p.add_argument("--on-policy", type=int, default=0, metavar="N",
                   help="also train on the target's greedy continuations of N corpus windows (half the data; "
                        "generated once with llmd, cached in the work directory). Raises acceptance, which is "
                        "agreement on text the target writes: the bundled draft (8,000 windows) accepts 0.63 of "
                        "proposals, the same shape trained without the target 0.38")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget")
    p.add_argument("--steps", type=int, default=3000, help="at most this many optimizer steps")
    p.add_argument("--session-steps", type=int, default=None,
                   help="stop this invocation after this many steps (checkpointed; rerun to continue)")
    shape = "the draft's {} (default %(default)s; ignored with --init, which brings its own shape)"
    p.add_argument("--hidden-size", type=int, default=DEFAULT_SHAPE["hidden_size"], help=shape.format("hidden size"))
    p.add_argument("--intermediate-size", type=int, default=DEFAULT_SHAPE["intermediate_size"],
                   help=shape.format("MLP width"))
    p.add_argument("--layers", type=int, default=DEFAULT_SHAPE["num_hidden_layers"], help=shape.format("layer count"))
    p.add_argument("--heads", type=int, default=DEFAULT_SHAPE["num_attention_heads"],
                   help=shape.format("attention heads"))
    p.add_argument("--kv-heads", type=int, default=DEFAULT_SHAPE["num_key_value_heads"],
                   help=shape.format("key/value heads (grouped-query attention)"))
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training window (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per optimizer step (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate of the cosine schedule (default %(default)s; lower, e.g. 1e-3, "
                        "when continuing with --init)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initial weights, the batch order and the on-policy windows (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("llmd distill: interrupted; the same command resumes from the last checkpoint", file=sys.stderr)
        return 130
    except (LLMDError, OSError, ValueError) as e:
        print(f"llmd distill: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.on_policy < 0:
        raise ValueError(f"--on-policy takes a number of samples >= 0, got {args.on_policy}")
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work or args.out.with_name(args.out.name + ".ckpt")
    shape = dict(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    cfg = TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, max_steps=args.steps,
                      warmup_steps=min(30, max(1, args.steps // 10)), budget_s=args.minutes * 60, seed=args.seed)
    preflight(args.target, args.out, args.init)
    tokens = corpus_tokens(args.target, args.corpus, work, args.seed)
    if args.on_policy:
        tokens = with_on_policy(args.target, tokens, args.on_policy, work, args.seed, args.seq_len)
    state = distill(args.target, args.out, tokens, cfg, work, shape=shape, init=args.init,
                    session_steps=args.session_steps)
    kl = "n/a" if state["loss_ema"] is None else f"{state['loss_ema']:.3f}"
    print(f"draft written to {args.out}: {state['step']} steps, {state['elapsed_s']:.0f} s, KL {kl}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m llmd.training.distill")
    sub = parser.add_subparsers(dest="command", required=True)
    add_distill_parser(sub)
    a = parser.parse_args(["distill", *__import__("sys").argv[1:]])
    raise SystemExit(a.func(a))
