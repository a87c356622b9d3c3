"""Greedy decoding through a step backend (ONNX, AOT, TensorRT) over llmd's paged pool, compared with the
torch engine's greedy tokens: shared by the export tests of each backend."""
import torch

from llmd import LLM, SamplingParams
from llmd.runtime.attention import SeqSpan
from llmd.runtime.backends.paged import run_step
from llmd.runtime.model_runner import StepBatch
from llmd.runtime.models.config import ModelConfig

BLOCK = 4


def greedy_steps(backend, cfg, prompt, n, chunk=5):
    """Greedy decoding through run_step with a scattered block table and a chunked prompt."""
    blocks = list(range(40, 0, -3))                            # not in order: paging must hold
    slots = (torch.tensor(blocks)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    pool = (cfg.num_layers, 41 * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    k_pool, v_pool = torch.zeros(pool), torch.zeros(pool)
    tokens, done = list(prompt), 0
    out = []
    while len(out) < n:
        new = tokens[done:done + chunk] if done < len(prompt) else tokens[done:]
        c, t = done, len(new)
        batch = StepBatch(torch.tensor(new), torch.arange(c, c + t), slots[c:c + t],
                          [SeqSpan(0, t, c + t, blocks)], torch.tensor([t - 1]), [1])
        logits = run_step(backend, k_pool, v_pool, batch, BLOCK)
        done += t
        if done >= len(prompt):
            tok = int(logits[0].argmax())
            out.append(tok)
            tokens.append(tok)
    return out


PROMPTS = [[5, 17, 99, 3, 42, 8, 7, 120, 33, 2, 64], [1, 2, 3], [200, 150, 100, 50, 25, 12, 6]]


def same_greedy_count(backend, source, reference, n: int = 32) -> int:
    """Of PROMPTS, how many get the same n greedy tokens from ``backend`` (a step backend of the model
    at ``source``) as from LLM(reference)."""
    cfg = ModelConfig.from_dir(source)
    ref = LLM(str(reference), kv_memory="16MiB").generate(PROMPTS, SamplingParams(max_tokens=n, ignore_eos=True))
    return sum(greedy_steps(backend, cfg, p, n) == r.token_ids for p, r in zip(PROMPTS, ref))
