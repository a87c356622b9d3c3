"""`llmd export`: quantize (and compile) a target and an optional draft into an engine directory.

Phases, each with its own progress bar:
    load      the models opened (a Hugging Face directory or a GGUF file), the held-out windows
    quantize  a decoder layer at a time (llmd.export.stream): each float layer read, the reference's
              and the calibration text's hidden states advanced through it, then the layer rounded
              per --quant and written; the reference's predictions are kept
    compile   backend artifacts (ONNX graph, TensorRT engine, AOT package)
    validate  the target is measured against the reference through what the engine will run (the
              ONNX graph on onnxruntime, the AOT packages; else the written weights read back a
              layer at a time): the quality gate
The manifest is written last, and only when the gate passes: without it the directory is refused.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from llmd.runtime.backends.base import create_backend
from llmd.runtime.config import KV_DTYPES
from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_import import resolve_model_path
from llmd.runtime.model_names import resolve_model
from llmd.runtime.formats.quantized import QuantizationError, QuantSpec, auto_group_size
from llmd.runtime.models.config import ModelConfig

from . import quality
from .aot import build_aot_package
from .group_size import choose_group_size, dividing
from .manifest import write_manifest
from .onnx import MAX_STEP_TOKENS, export_onnx, graph_quantization
from .stream import WrittenModel, finish_part, open_source, quantize_part
from .tensorrt import build_engine, require_tensorrt
from .whole_dir import write_whole

MAX_PPL_INCREASE = 5.0      # percent: the quality gate's default limit on the perplexity rise
MIN_TOP1_AGREEMENT = 90.0   # percent: its default floor on top-1 agreement with the float model


@dataclass(frozen=True)
class ExportOptions:
    target: str
    out: str
    draft: Optional[str] = None
    quant: str = "int8"
    group_size: Optional[int] = None      # int4: None chooses it (llmd.export.group_size)
    scale_search: bool = True             # int4: activation-aware scales and clipping (llmd.export.awq)
    symmetric: bool = False
    head: str = "auto"
    embed: str = "auto"
    kv_dtype: str = "auto"
    backend: str = "torch"
    aot: bool = False
    eval_file: Optional[str] = None
    eval_windows: int = 8
    eval_tokens: int = 128
    max_ppl_increase: float = MAX_PPL_INCREASE         # percent
    min_top1_agreement: float = MIN_TOP1_AGREEMENT     # percent
    accept_loss: bool = False
    force: bool = False
    shape_buckets: dict = field(default_factory=lambda: {"batch": [1, 2, 4, 8, 16, 32, 64],
                                                         "tokens": [1, 16, 64, 256, 512]})

    def __post_init__(self):
        if self.eval_windows < 1:
            raise ValueError(f"--eval-windows must be at least 1, got {self.eval_windows}")
        if self.eval_tokens < 2:
            raise ValueError(f"--eval-tokens must be at least 2 (a window predicts its tokens after the first), "
                             f"got {self.eval_tokens}")
        if not math.isfinite(self.max_ppl_increase):
            raise ValueError(f"--max-ppl-increase must be a finite percentage, got {self.max_ppl_increase}")
        if not 0 <= self.min_top1_agreement <= 100:
            raise ValueError(f"--min-top1-agreement must be a percentage from 0 to 100, got {self.min_top1_agreement}")


CALIBRATION_WINDOWS = 16   # windows of calibration text for the int4 group size and scale search
GATE_EXIT = 3     # the exit status of an export the quality gate refused


class QualityGateFailed(Exception):
    pass


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="quantize and compile a model (and draft) into an engine directory",
                       description=__doc__.split("\n\n")[0],
                       epilog="llama.cpp's quality for the same format, on the quality gate's own windows and "
                              "float reference: llmd bench OUT --against llamacpp-quality")
    a = p.add_argument
    a("--target", required=True, help="target model directory (Hugging Face layout) or GGUF file")
    a("--draft", help="draft model directory, exported with the same quantization")
    a("--quant", default="int8", choices=("none", "int8", "int4", "w8a8"), help="weight quantization (default int8)")
    a("--group-size", type=int, choices=(32, 64, 128),
      help="int4 group size (default: the largest of 128, 64, 32 that divides every input width and, "
           "measured on calibration text, keeps within half the quality gate's limits)")
    a("--no-scale-search", dest="scale_search", action="store_false",
      help="int4: plain rounding, without the activation-aware scale and clipping search on calibration text "
           "(torch backend; the onnxruntime graph is built from the unchanged weights)")
    a("--symmetric", action="store_true", help="int4 without zero points")
    a("--head", default="auto", choices=("auto", "float", "int8", "int8g", "w8a8", "int4"),
      help="output head (and tied embedding): float, int8 weight-only (one scale per row), int8g (int8 with "
           "a scale per 64 input columns), int8 with per-token int8 input (w8a8), or int4 (group size as "
           "--group-size); auto: float for --quant none, else int8g (default; the quality gate shows its cost)")
    a("--embed", default="auto", choices=("auto", "float", "int8"),
      help="untied embedding storage: auto (default: float for --quant none, else int8), float or int8")
    a("--kv-dtype", default="auto", choices=KV_DTYPES, help="KV cache dtype recorded for the runtime")
    a("--backend", default="torch", choices=("torch", "onnxruntime", "tensorrt"),
      help="what runs the engine: torch (llmd's model code and CPU kernels; default), onnxruntime (an ONNX "
           "graph: on the CPU, or a GPU with llmd[gpu]), tensorrt (an NVIDIA GPU plan)")
    a("--aot", action="store_true", help="torch: also build an AOTInductor package so serve starts warm")
    a("--eval-file", help="held-out text for the quality gate (default: llmd's own evaluation text, prose, "
      "chat turns and code interleaved)")
    a("--eval-windows", type=int, default=8, help="windows of held-out text measured (default 8)")
    a("--eval-tokens", type=int, default=128, help="tokens per window (default 128)")
    a("--max-ppl-increase", type=float, default=MAX_PPL_INCREASE,
      help=f"quality gate: refuse the engine when perplexity rises by more than this many percent "
           f"(default {MAX_PPL_INCREASE:g})")
    a("--min-top1-agreement", type=float, default=MIN_TOP1_AGREEMENT,
      help=f"quality gate: refuse the engine when fewer than this percentage of next-token choices agree with "
           f"the float model's (default {MIN_TOP1_AGREEMENT:g})")
    a("--accept-loss", action="store_true",
      help="write the engine whatever the quality gate measures (the figures are still printed and recorded)")
    a("--force", action="store_true", help="replace an existing engine directory (one with a manifest.json); "
      "it is replaced only once the new engine is complete")
    a("--out", required=True, help="engine directory to write")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    keys = ExportOptions.__dataclass_fields__
    signal.signal(signal.SIGTERM, _interrupted)     # a kill cleans up as Ctrl-C does
    try:
        args.target, args.draft = resolve_model(args.target), args.draft and resolve_model(args.draft)
        opts = ExportOptions(**{k: v for k, v in vars(args).items() if k in keys})
        summary = export_engine(opts, TqdmProgress())
    except QualityGateFailed as e:
        print(f"llmd export: quality gate failed: {e}", file=sys.stderr)
        return GATE_EXIT
    except KeyboardInterrupt:
        print(f"llmd export: interrupted; {args.out} was not written or changed", file=sys.stderr)
        return 130
    except (LLMDError, OSError, ValueError) as e:
        print(f"llmd export: {e}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _interrupted(signum, frame):
    raise KeyboardInterrupt


class TqdmProgress:
    """One bar per phase: ``phase(name, total)`` opens it, ``advance(n)`` moves it."""

    def __init__(self):
        self.bar = None

    def phase(self, name: str, total: int) -> None:
        from tqdm import tqdm
        self.close()
        self.bar = tqdm(total=total, desc=f"{name:9s}", unit="step", leave=True, file=sys.stderr)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class NoProgress(TqdmProgress):
    def phase(self, name: str, total: int) -> None:
        pass


def export_engine(opts: ExportOptions, progress: TqdmProgress | None = None) -> dict:
    """Run the four phases; returns the summary (also stored in the manifest)."""

    progress = progress or NoProgress()
    check_backend(opts)
    if opts.backend != "torch" or opts.aot:      # graphs are built from a Hugging Face directory
        opts = replace(opts, target=resolve_model_path(opts.target),
                       draft=opts.draft and resolve_model_path(opts.draft))
    final = Path(opts.out)
    parts = {"target": Path(opts.target)} | ({"draft": Path(opts.draft)} if opts.draft else {})
    check_out(final, opts.force, list(parts.values()))
    sources = {name: open_source(p) for name, p in parts.items()}
    configs = [s.config for s in sources.values()]
    group = opts.group_size or (auto_group_size(configs) if opts.quant == "int4" else 128)
    spec = QuantSpec(opts.quant, group, opts.symmetric, opts.head, opts.embed, opts.kv_dtype)
    # a failure, a failed quality gate or Ctrl-C leaves the destination as it was
    summary = write_whole(final, lambda out: _export_into(out, opts, spec, sources, progress))
    return {"out": str(final), "quantization": spec.to_dict(), "backend": opts.backend} | summary


def _export_into(out: Path, opts: ExportOptions, spec, sources: dict, progress) -> dict:
    """Each model is read, rounded and written a decoder layer at a time (llmd.export.stream): the
    float reference and the calibration text advance through each float layer as it comes up, so
    no model is ever whole in float."""
    times: dict[str, float] = {}
    target = sources["target"]
    cfg = target.config

    t = time.perf_counter()
    progress.phase("load", 2)
    tokenizer = target.tokenizer()
    if opts.eval_tokens > cfg.max_position_embeddings:
        raise ValueError(f"--eval-tokens {opts.eval_tokens} is longer than the target's context window "
                         f"({cfg.max_position_embeddings} positions)")
    if opts.eval_tokens > MAX_STEP_TOKENS and (opts.backend != "torch" or opts.aot):
        raise ValueError(f"--eval-tokens {opts.eval_tokens} is longer than a compiled graph takes in one call "
                         f"({MAX_STEP_TOKENS}); choose at most that")
    texts, source = quality.heldout_texts(opts.eval_file)
    windows = quality.token_windows(tokenizer, texts, opts.eval_tokens, opts.eval_windows)
    progress.advance()
    calibration = None
    if spec.method == "int4":
        calibration = quality.token_windows(tokenizer, quality.calibration_texts(), opts.eval_tokens,
                                            CALIBRATION_WINDOWS)
    progress.advance()
    times["load"] = time.perf_counter() - t

    t = time.perf_counter()
    progress.phase("quantize", sum(s.config.num_layers + 1 for s in sources.values()))
    groups = [spec.group_size]
    if spec.method == "int4" and opts.group_size is None:
        groups = dividing(*(s.config for s in sources.values()))
    search = spec.method == "int4" and opts.scale_search and opts.backend == "torch"
    done = quantize_part(target, spec, out / "target", groups=groups, scale_search=search, eval_windows=windows,
                         calibration=calibration, progress=progress)
    reference = done["reference"]
    tried = {}
    if len(groups) > 1:
        for g in groups:
            q = quality.compare(done["calibration_reference"], done["measured"][g], None, "", "")
            tried[g] = (100 * q.ppl_increase, 100 * q.top1_agreement)
        spec = replace(spec, group_size=choose_group_size(tried, opts.max_ppl_increase / 2,
                                                          100 - (100 - opts.min_top1_agreement) / 2))
    elif spec.method == "int4":
        spec = replace(spec, group_size=groups[0])
    finish_part(out / "target", done, spec.group_size, cfg, spec)
    if "draft" in sources:
        done = quantize_part(sources["draft"], spec, out / "draft", groups=[spec.group_size], scale_search=search,
                             eval_windows=None, calibration=calibration, progress=progress)
        finish_part(out / "draft", done, spec.group_size, sources["draft"].config, spec)
    calibrated = None
    if spec.method == "int4":
        calibrated = {"group_size": spec.group_size, "chosen": opts.group_size is None, "scale_search": search,
                      "tried": {str(g): {"ppl_increase_pct": p, "top1_pct": t} for g, (p, t) in tried.items()}}
    times["quantize"] = time.perf_counter() - t

    t = time.perf_counter()
    progress.phase("compile", 1)
    artifacts = compile_backend(opts, out, spec)
    progress.advance()
    times["compile"] = time.perf_counter() - t

    t = time.perf_counter()
    progress.phase("validate", sum(s.config.num_layers for s in sources.values()))
    quant_pred, measured_on = target_predictions(out, artifacts, cfg, spec, windows, progress)
    draft_pred = WrittenModel(out / "draft", spec).predict(windows, progress) if "draft" in sources else None
    measured = quality.compare(reference, quant_pred, draft_pred, source, measured_on)
    times["validate"] = time.perf_counter() - t
    progress.close()

    failures = quality.gate_failures(measured, opts.max_ppl_increase, opts.min_top1_agreement)
    if failures and not opts.accept_loss:
        raise QualityGateFailed(f"{'; '.join(failures)} (measured on {measured.source}, {measured.measured_on})"
                                f". The engine was not written ({opts.out} is as it was). Pass "
                                "--accept-loss to write it anyway, or loosen the limit named above.")
    gate = {"max_ppl_increase": opts.max_ppl_increase, "min_top1_agreement": opts.min_top1_agreement,
            "passed": not failures, "accepted_loss": failures,
            "eval_file": opts.eval_file and str(Path(opts.eval_file).resolve()), "eval_windows": opts.eval_windows, "eval_tokens": opts.eval_tokens}
    summary = {"quality": measured.to_dict() | {"gate": gate}, "times_s": times, "quantization": spec.to_dict(),
               **({"int4_calibration": calibrated} if calibrated else {}),
               "sizes": {name: {"source_bytes": source_bytes(s.path),
                                "engine_bytes": dir_bytes(out / name, "*.safetensors")} for name, s in sources.items()}}
    write_manifest(out, {
        "backend": opts.backend, "quantization": spec.to_dict(), "shape_buckets": opts.shape_buckets,
        "models": {name: {"dir": name, "source": s.hashes()} for name, s in sources.items()},
        "tokenizer": {"dir": "target", "files": sorted(p.name for p in (out / "target").glob("tokenizer*"))},
        "artifacts": artifacts, **summary})
    return summary | ({"graph_quantization": artifacts["onnx_quantization"]} if "onnx_quantization" in artifacts else {})


def target_predictions(out: Path, artifacts: dict, cfg: ModelConfig, spec, windows, progress=None):
    """The target's predictions on ``windows`` through what the engine in ``out`` runs (``gate_target``),
    and its name: what the quality gate measures, and what a comparison with another engine reads."""
    runs, measured_on = gate_target(out, artifacts, cfg)
    if runs is not None:
        return quality.predict(runs, windows), measured_on
    return WrittenModel(out / "target", spec).predict(windows, progress), measured_on


def gate_target(out: Path, artifacts: dict, cfg: ModelConfig):
    """What the quality gate measures the target through, and its name: the compiled graph the engine
    will run (the ONNX graph on onnxruntime; the AOT decode package, which writes every generated
    token), else None: the written weights, read back a layer at a time (stream.WrittenModel).
    TensorRT engines are GPU-only and built from the float graph, so the gate stays on the weights."""

    if "onnx" in artifacts and "tensorrt" not in artifacts:
        backend = create_backend("onnxruntime", out, {"artifacts": artifacts}, device="cpu")
        return quality.BackendModel(backend, cfg), "onnxruntime graph"
    if "aot" in artifacts:
        backend = create_backend("aot", out, {"artifacts": artifacts}, device="cpu")
        return (quality.BackendModel(backend, cfg, chunk=backend.small_m),
                f"aot decode package ({backend.small_m} tokens a step)")
    return None, "torch weights"


def check_out(out: Path, force: bool, sources: list[Path]) -> None:
    """Refuse a destination that is (or holds, or sits in) a model being exported, and one that is not
    empty unless --force is given for an engine directory."""
    here = out.resolve()
    for src in sources:
        s = src.resolve()
        if here == s or s.is_relative_to(here) or here.is_relative_to(s):
            raise ValueError(f"--out {out} would overwrite or sit inside the model being exported ({src}); "
                             "choose another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ValueError(f"{out} exists and is not empty; pass --force to replace it")
        if not (out / "manifest.json").is_file():
            raise ValueError(f"{out} is not an llmd engine directory (no manifest.json), so --force will not "
                             "delete it; remove it yourself or choose another --out")


def check_backend(opts: ExportOptions) -> None:
    """Fail before any work when the backend cannot be built here, or could not serve the engine."""
    if opts.backend != "torch" and opts.kv_dtype != "auto":
        raise QuantizationError(f"the {opts.backend} backend keeps keys and values in the model's dtype; "
                                f"use --kv-dtype auto with it (got {opts.kv_dtype})")
    if opts.backend == "tensorrt":
        require_tensorrt()
        if opts.quant != "none":
            raise QuantizationError("the tensorrt backend builds FP16 engines from the float graph; "
                                    "use --quant none with it")
    if opts.backend == "onnxruntime":
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as e:
            raise ValueError(f"the onnxruntime backend needs llmd[onnx] ({e})") from None


def compile_backend(opts: ExportOptions, out: Path, spec) -> dict:
    """Backend artifacts: paths relative to the engine directory, and (``onnx_quantization``) how the
    ONNX graph's products are quantized."""
    artifacts = {}
    if opts.backend == "onnxruntime":
        artifacts["onnx"] = export_onnx(Path(opts.target), out, spec)
        artifacts["onnx_quantization"] = graph_quantization(spec)
    if opts.backend == "tensorrt":

        cfg = ModelConfig.from_dir(opts.target)
        artifacts["onnx"] = export_onnx(Path(opts.target), out, spec, portable=True)
        shapes = {"num_layers": cfg.num_layers, "max_context": min(cfg.max_position_embeddings, 8192)}
        artifacts["tensorrt"] = build_engine(out, artifacts["onnx"], opts.shape_buckets, cfg.num_layers,
                                             cfg.num_kv_heads, cfg.head_dim, shapes["max_context"])
        artifacts["tensorrt_shapes"] = shapes
    if opts.aot and opts.backend == "torch":
        artifacts["aot"] = build_aot_package(Path(opts.target), out, spec)
    return artifacts


def dir_bytes(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob(pattern))


def source_bytes(path: Path) -> int:
    """A source's weight bytes: a GGUF file's size, or a directory's safetensors."""
    return path.stat().st_size if path.is_file() else dir_bytes(path, "*.safetensors")


def format_summary(s: dict) -> str:
    q = s["quality"]
    rows = [("engine directory", s["out"]),
            ("quantization", f"{s['quantization']['method']} (head {s['quantization']['head']}), backend {s['backend']}")]
    if c := s.get("int4_calibration"):
        tried = ", ".join(f"{g}: {t['ppl_increase_pct']:+.2f} %, top-1 {t['top1_pct']:.1f} %" for g, t in c["tried"].items())
        rows.append(("int4 groups", f"{c['group_size']}" + (f" (chosen on calibration text; {tried})" if c["chosen"] else "")
                     + (", scale search on" if c["scale_search"] else ", plain rounding")))
    if s.get("graph_quantization"):
        rows.append(("onnx graph", s["graph_quantization"]))
    for name, sz in s["sizes"].items():
        rows.append((f"{name} size", f"{sz['source_bytes'] / 2**20:.1f} MiB -> {sz['engine_bytes'] / 2**20:.1f} MiB"))
    rows.append(("time", ", ".join(f"{k} {v:.1f} s" for k, v in s["times_s"].items())))
    rows.append(("perplexity", f"{q['ppl_reference']:.3f} -> {q['ppl_quantized']:.3f} ({100 * q['ppl_increase']:+.2f} %)"))
    rows.append(("top-1 agreement", f"{100 * q['top1_agreement']:.2f} % of {q['num_tokens']} tokens ({q['source']})"))
    rows.append(("measured on", q.get("measured_on", "torch weights")))
    if gate := q.get("gate"):
        rows.append(("quality gate", "passed" if gate["passed"] else
                     "FAILED, written because --accept-loss was given: " + "; ".join(gate["accepted_loss"])))
    if q["draft_acceptance"] is not None:
        rows.append(("draft acceptance", f"{100 * q['draft_acceptance']:.2f} % (greedy, one token)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
