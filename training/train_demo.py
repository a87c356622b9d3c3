"""Build llmd's bundled demo pair from the Python standard library: tokenizer, target, distilled draft.

    python -m llmd.training.train_demo --out models                 # everything (``make models``)
    python -m llmd.training.train_demo --out models --stages target # one stage; stages resume

Stages (each resumable from ``--work``): ``data`` trains the BPE and encodes the train and held-out
token streams; ``target`` trains the Llama target; ``draft`` distills the draft from the target
(what ``llmd distill`` does); ``raw`` trains the same draft shape on the data alone, for comparison;
``eval`` measures all three and writes the model cards.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from . import bpe, corpus
from .distill import distill, with_on_policy
from .eval_demo import evaluate_and_write_cards
from .model_dir import hf_config, new_model, write_model_dir
from .train_loop import DocSampler, TrainConfig, train

SEED = 1234
HELDOUT_FRACTION = 0.05
TRAIN_PASSES = 2

# The target: Llama with grouped-query attention and tied embeddings, 12.6M parameters.
TARGET_SHAPE = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=6, num_key_value_heads=2)
# The draft: 16% of the target's per-token FLOPs (at most 1/6 is allowed).
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=5,
                   num_attention_heads=4, num_key_value_heads=2)
# Runs end at their step counts, so a rebuild repeats the same batches and learning rates whatever the
# machine's speed (the model cards record the wall times); the wall-clock budgets (--target-minutes,
# --draft-minutes) are caps for a slow machine, where a run that hits one ends early and differs.
TARGET_TRAIN = TrainConfig(seq_len=512, batch_size=8, lr=1.5e-3, warmup_steps=50, max_steps=1700, seed=SEED)
DRAFT_ON_POLICY = 8000      # corpus windows the target continues greedily for the draft's distillation
DRAFT_TRAIN = TrainConfig(seq_len=512, batch_size=8, lr=3e-3, warmup_steps=50, max_steps=1400, seed=SEED + 1)


def stage_data(work: Path, seed: int) -> None:
    """Tokenizer from the training files; token streams (uint16 .npy) for train and held-out."""
    if (work / "heldout.npy").is_file():
        return
    train_files, held_files = corpus.split(corpus.list_sources(), HELDOUT_FRACTION)
    tok = bpe.train_bpe(train_files)
    bpe.save_tokenizer(tok, work / "tokenizer")
    # Two arrangements of the training files (other chunk cuts, other fill-in-the-middle spans):
    # the target trains for more than one pass, and a second pass then sees new samples.
    train = itertools.chain.from_iterable(corpus.make_pieces(train_files, seed + 1000 * k) for k in range(TRAIN_PASSES))
    np.save(work / "train.npy", bpe.encode_pieces(tok, train))
    np.save(work / "heldout.npy", bpe.encode_pieces(tok, corpus.make_pieces(held_files, seed + 1)))
    (work / "split.json").write_text(json.dumps({"train": [f.rel for f in train_files],
                                                 "heldout": [f.rel for f in held_files]}, indent=1))


def load_tokens(work: Path, name: str) -> np.ndarray:
    return np.load(work / f"{name}.npy", allow_pickle=False)


def stage_target(work: Path, out: Path, cfg: TrainConfig) -> None:
    tok_dir = work / "tokenizer"
    vocab, eot = token_facts(tok_dir)
    config = hf_config(TARGET_SHAPE, vocab, eot, cfg.seq_len)
    model = new_model(config, cfg.seed)
    state = train(model, DocSampler(load_tokens(work, "train"), cfg.seq_len, cfg.batch_size, cfg.seed, eot),
                  cfg, work / "ckpt-target", desc="target")
    write_model_dir(model, config, tok_dir, out / "code-target")
    record(work, "target", state)


def stage_raw(work: Path, cfg: TrainConfig) -> None:
    """Same shape, seed and schedule as the distilled draft, trained on the corpus alone with plain
    cross-entropy (the issue's comparison: no target involved, so no on-policy samples either); the
    same number of steps when the draft has been trained, so the comparison is step for step."""
    draft_run = work / "run-draft.json"
    if draft_run.is_file():
        cfg = replace(cfg, max_steps=json.loads(draft_run.read_text())["step"])
    tok_dir = work / "tokenizer"
    vocab, eot = token_facts(tok_dir)
    config = hf_config(DRAFT_SHAPE, vocab, eot, cfg.seq_len)
    model = new_model(config, cfg.seed)
    state = train(model, DocSampler(load_tokens(work, "train"), cfg.seq_len, cfg.batch_size, cfg.seed, eot),
                  cfg, work / "ckpt-raw", desc="raw draft")
    write_model_dir(model, config, tok_dir, work / "code-draft-raw")
    record(work, "raw", state)


def stage_draft(work: Path, out: Path, cfg: TrainConfig) -> None:
    """KL distillation from the target, half of it on the target's own greedy continuations."""
    tokens = with_on_policy(out / "code-target", load_tokens(work, "train"), DRAFT_ON_POLICY, work / "ckpt-draft",
                            cfg.seed, cfg.seq_len)
    state = distill(out / "code-target", out / "code-draft", tokens, cfg, work / "ckpt-draft", shape=DRAFT_SHAPE)
    record(work, "draft", state)


def token_facts(tok_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return tok.get_vocab_size(), tok.token_to_id(corpus.EOT)


def record(work: Path, name: str, state: dict) -> None:
    """Training facts for the model cards: steps, wall time, final loss, configuration."""
    run = {k: state[k] for k in ("step", "elapsed_s", "loss_ema", "config")}
    (work / f"run-{name}.json").write_text(json.dumps(run, indent=2))   # one file per stage: stages may run at once


def read_runs(work: Path) -> dict:
    return {p.stem[len("run-"):]: json.loads(p.read_text()) for p in sorted(work.glob("run-*.json"))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llmd.training.train_demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("models"), help="where code-target/ and code-draft/ go")
    p.add_argument("--work", type=Path, default=Path("work-out/demo"), help="checkpoints and token caches")
    p.add_argument("--stages", default="data,target,draft,raw,eval",
                   help="comma-separated stages to run, in order; each resumes from --work")
    p.add_argument("--target-steps", type=int, default=TARGET_TRAIN.max_steps,
                   help="the target's optimizer steps (a larger count trains a stronger target)")
    p.add_argument("--draft-steps", type=int, default=DRAFT_TRAIN.max_steps, help="the draft's optimizer steps")
    p.add_argument("--target-minutes", type=float, default=90.0, help="cap on the target's wall time")
    p.add_argument("--draft-minutes", type=float, default=60.0, help="cap on the draft's wall time")
    p.add_argument("--raw-minutes", type=float, default=60.0, help="upper bound; it stops at the draft's step count")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for training and evaluation")
    p.add_argument("--card-command", default=None, help="the command line recorded in the model cards")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    t0 = time.monotonic()
    if "data" in stages:
        stage_data(args.work, SEED)
    if "target" in stages:
        stage_target(args.work, args.out, replace(TARGET_TRAIN, max_steps=args.target_steps,
                                                                 budget_s=args.target_minutes * 60))
    if "draft" in stages:
        stage_draft(args.work, args.out, replace(DRAFT_TRAIN, max_steps=args.draft_steps,
                                                              budget_s=args.draft_minutes * 60))
    if "raw" in stages:
        stage_raw(args.work, replace(DRAFT_TRAIN, max_steps=args.draft_steps, budget_s=args.raw_minutes * 60))
    if "eval" in stages:
        evaluate_and_write_cards(args.work, args.out, args.card_command or " ".join(["python -m llmd.training.train_demo", *(argv or sys.argv[1:])]),
                                 read_runs(args.work), DRAFT_ON_POLICY)
    print(f"done in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
