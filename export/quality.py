"""The export quality gate: how much quantization changed the target, and how well the draft
predicts the quantized target, on held-out text.

All figures are teacher-forced over fixed windows of the same tokens:
- perplexity of the float reference and of the quantized target (exp of mean next-token NLL);
- top-1 agreement: the fraction of positions where both pick the same most likely next token;
- draft acceptance: the fraction of positions where the draft's most likely token equals the
  quantized target's, the greedy acceptance rate of one proposed token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

@dataclass(frozen=True)
class Quality:
    ppl_reference: float
    ppl_quantized: float
    top1_agreement: float
    draft_acceptance: float | None
    num_tokens: int
    source: str
    measured_on: str = "torch weights"     # what computed the quantized target's figures

    @property
    def ppl_increase(self) -> float:
        """Relative increase: 0.02 means 2 % higher perplexity than the float reference."""
        return self.ppl_quantized / self.ppl_reference - 1

    def to_dict(self) -> dict:
        return {"ppl_reference": self.ppl_reference, "ppl_quantized": self.ppl_quantized,
                "ppl_increase": self.ppl_increase, "top1_agreement": self.top1_agreement,
                "draft_acceptance": self.draft_acceptance, "num_tokens": self.num_tokens, "source": self.source,
                "measured_on": self.measured_on}


CALIBRATION_CHARS = 200_000
EVAL_TEXT = Path(__file__).with_name("data") / "eval.txt"
EVAL_SOURCE = "llmd's evaluation text (prose, questions and answers, code)"


def heldout_texts(eval_file: str | None = None) -> tuple[list[str], str]:
    """The user's file, else the text shipped with llmd (``export/data/eval.txt``, written for it):
    stories, explanations, chat turns and code in Python, JavaScript, SQL and shell, interleaved, so a
    chat model and a code model are both judged on what they do."""
    path = Path(eval_file) if eval_file else EVAL_TEXT
    return [path.read_text(encoding="utf-8", errors="ignore")], str(eval_file) if eval_file else EVAL_SOURCE


def calibration_texts() -> list[str]:
    """Text the int4 scale search and group size choice are tuned on, kept apart from the gate's text:
    the Python documentation's topics that ship with Python (prose with code examples); llmd's
    evaluation text where that module is absent."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return heldout_texts()[0]
    return ["\n\n".join(topics[k] for k in sorted(topics))[:CALIBRATION_CHARS]]


def token_windows(tokenizer, texts: list[str], window: int, count: int) -> torch.Tensor:
    """Up to ``count`` windows of ``window`` tokens, spread evenly over the texts (so a long text is
    sampled from beginning to end, not only its start) -> [n, window]. The ids are within the model's
    vocabulary: the caller checked the tokenizer against it (``check_vocab``)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False))
    n = min(count, len(ids) // window)
    if n == 0:
        raise ValueError(f"held-out text too short: {len(ids)} tokens, need at least {window}")
    stride = len(ids) // n
    return torch.tensor([ids[i * stride:i * stride + window] for i in range(n)], dtype=torch.long)


@dataclass(frozen=True)
class Predictions:
    """Per position of the windows: next-token NLL and most likely token (all the gate needs, so a
    reference model can be freed before the quantized one is built)."""
    nll: torch.Tensor         # [n, T-1]
    top1: torch.Tensor        # [n, T]


@torch.inference_mode()
def predict(model, windows: torch.Tensor, batch: int = 4) -> Predictions:
    nll, top1 = [], []
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        n, t = score(model.forward_dense(w), w)
        nll.append(n)
        top1.append(t)
    return Predictions(torch.cat(nll), torch.cat(top1))


def score(logits: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [b, T, vocab] of windows w [b, T] -> (next-token NLL [b, T-1], most likely token [b, T])."""
    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), w[:, 1:], reduction="none"), logits.argmax(-1)


class BackendModel:
    """``forward_dense`` through a compiled step backend (an ONNX graph, AOT packages), so the gate
    measures the artifact the engine will run, not the torch weights it was built from. Each window is
    one sequence: in one call, or with ``chunk`` in steps of that many tokens over the keys and values
    the earlier steps returned (the AOT decode package, which writes every generated token, takes at
    most ``small_m`` tokens a step)."""

    def __init__(self, backend, config, chunk: int | None = None):
        self.backend, self.chunk = backend, chunk
        self.empty = torch.zeros(config.num_layers, 0, config.num_kv_heads, config.head_dim)

    def forward_dense(self, windows: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._sequence(w.contiguous()) for w in windows])

    def _sequence(self, ids: torch.Tensor) -> torch.Tensor:
        step = self.chunk or len(ids)
        past_k = past_v = self.empty
        logits = []
        for at in range(0, len(ids), step):
            out, k, v = self.backend.forward(ids[at:at + step], torch.arange(at, min(at + step, len(ids))),
                                             past_k, past_v)
            logits.append(out)
            past_k, past_v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        return torch.cat(logits)


def compare(reference: Predictions, quantized: Predictions, draft: Predictions | None, source: str,
            measured_on: str = "torch weights") -> Quality:
    acceptance = None if draft is None else (draft.top1 == quantized.top1).float().mean().item()
    return Quality(perplexity(reference.nll), perplexity(quantized.nll),
                   (reference.top1 == quantized.top1).float().mean().item(), acceptance,
                   reference.top1.numel(), source, measured_on)


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean NLL; infinity past float's range (a model with meaningless weights)."""
    mean = nll.mean().item()
    return math.exp(mean) if mean < 700 else math.inf


def gate_failures(q: Quality, max_ppl_increase: float, min_top1_agreement: float) -> list[str]:
    """What the quality gate refuses in ``q`` (limits in percent), one sentence each, naming the flag."""
    failures = []
    if not 100 * q.ppl_increase <= max_ppl_increase:
        failures.append(f"perplexity rose {100 * q.ppl_increase:.2f} % ({q.ppl_reference:.3f} -> {q.ppl_quantized:.3f}), "
                        f"more than the {max_ppl_increase:g} % --max-ppl-increase allows")
    if not 100 * q.top1_agreement >= min_top1_agreement:
        failures.append(f"top-1 agreement with the float model is {100 * q.top1_agreement:.2f} %, below the "
                        f"{min_top1_agreement:g} % --min-top1-agreement asks")
    return failures
