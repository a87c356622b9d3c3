"""int4 plain rounding against the activation-aware scale search, without writing engines.

    python -m llmd.bench.int4_search MODEL GROUP:plain|awq:asym|sym[,...] [WINDOWS]

The float model is rounded in memory for each configuration (``quantize_model`` after, for ``awq``,
``apply_awq`` calibrated on the same calibration text the export uses) and measured as the export's
gate measures: WINDOWS (default 16) windows of 128 tokens of llmd's evaluation text, perplexity change
and top-1 agreement against the float model.
"""
import argparse
import copy
import sys
import time

import torch

from llmd.export import quality
from llmd.export.awq import apply_awq
from llmd.runtime.formats.gguf_import import resolve_model_path
from llmd.runtime.formats.quantized import QuantSpec, quantize_model
from llmd.runtime.models.loader import load_model
from llmd.runtime.tokenizer import Tokenizer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="float model directory (Hugging Face layout) or GGUF file (its float32 import)")
    p.add_argument("configs", help="comma-separated GROUP:plain|awq:asym|sym, e.g. 32:plain:asym,32:awq:asym")
    p.add_argument("windows", nargs="?", type=int, default=16, help="windows of 128 tokens measured (default 16)")
    a = p.parse_args(argv)
    model_dir, configs, windows = resolve_model_path(a.model), a.configs.split(","), a.windows
    for c in configs:
        parts = c.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("plain", "awq") or parts[2] not in ("asym", "sym"):
            p.error(f"bad configuration {c!r}: expected GROUP:plain|awq:asym|sym")
    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, "float32")
    model.requires_grad_(False)
    win = quality.token_windows(tok, quality.heldout_texts()[0], 128, windows)
    cal = quality.token_windows(tok, quality.calibration_texts(), 128, 16)
    ref = quality.predict(model, win)
    for c in configs:
        g, method, sym = c.split(":")
        m = copy.deepcopy(model)
        t = time.perf_counter()
        with torch.no_grad():
            if method == "awq":
                apply_awq(m, cal, int(g), sym == "sym")
            quantize_model(m, QuantSpec("int4", int(g), sym == "sym"))
        q = quality.compare(ref, quality.predict(m, win), None, "", "")
        print(f"{c:16s} ppl {q.ppl_reference:.3f}->{q.ppl_quantized:.3f} ({100 * q.ppl_increase:+.2f} %) "
              f"top1 {100 * q.top1_agreement:.2f} % {time.perf_counter() - t:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
