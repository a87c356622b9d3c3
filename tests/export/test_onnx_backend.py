"""The ONNX step graph on onnxruntime over llmd's paged pool: same greedy tokens as the torch
path for --quant none, close logits, int8 through MatMulInteger and int4 through MatMulNBits."""
import pytest
import torch

from optional import need  # noqa: E402

ort = need("onnxruntime")
need("onnxscript")
pytestmark = pytest.mark.heavy          # every test exports an ONNX graph

from llmd import LLM, SamplingParams  # noqa: E402
from llmd.export.cli import ExportOptions, export_engine  # noqa: E402
from llmd.runtime.formats.manifest import read_manifest  # noqa: E402
from llmd.runtime.backends.base import create_backend  # noqa: E402
from llmd.runtime.errors import EngineDirError  # noqa: E402
from llmd.runtime.models.config import ModelConfig  # noqa: E402
from onnx_exports import backend_of, exported, source  # noqa: E402,F401 (fixtures)
from step_greedy import PROMPTS, same_greedy_count  # noqa: E402


def test_quant_none_onnx_gives_the_torch_greedy_tokens(source, exported):
    backend = backend_of(exported("none"))
    assert same_greedy_count(backend, source, source) == len(PROMPTS)


def test_onnx_step_logits_match_torch_forward_dense(source, exported):
    from llmd.runtime.models.loader import load_model
    backend = backend_of(exported("none"))
    model = load_model(source)
    ids = torch.tensor([5, 17, 99, 3, 42, 8])
    with torch.no_grad():
        ref = model.forward_dense(ids[None])[0]
    c = model.config
    empty = torch.zeros(c.num_layers, 0, c.num_kv_heads, c.head_dim)
    logits, k, v = backend.forward(ids, torch.arange(6), empty, empty)    # P = 0: a fresh prompt
    assert k.shape == (c.num_layers, 6, c.num_kv_heads, c.head_dim)
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4)
    # the same last row from a past of 4 and 2 new tokens
    logits2, _, _ = backend.forward(ids[4:], torch.arange(4, 6), k[:, :4].contiguous(), v[:, :4].contiguous())
    assert torch.allclose(logits2, ref[4:], atol=1e-4, rtol=1e-4)


def test_llm_serves_an_onnx_engine_directory_with_the_same_greedy_tokens(source, exported):
    engine = exported("none")
    prompts = [[30, 31, 32, 33], list(range(40, 75))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(source), kv_memory="4MiB").generate(prompts, params)]
    llm = LLM(str(engine), kv_memory="4MiB", max_batch_tokens=16)
    assert llm.engine.runner.backend is not None and llm.engine.runner.backend.name == "onnxruntime"
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    # --device picks the provider: cpu insists on the CPU; cuda without onnxruntime-gpu is refused
    on_cpu = LLM(str(engine), kv_memory="4MiB", device="cpu")
    assert on_cpu.engine.runner.backend.session.get_providers() == ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(EngineDirError, match="no CUDA provider"):
            LLM(str(engine), kv_memory="4MiB", device="cuda")


def test_the_quality_gate_measures_the_onnx_graph_that_ships(source, tmp_path):
    """The gate's quantized figures are those of the graph onnxruntime runs (which quantizes activations
    too), not of llmd's torch modules built from the same weights."""
    import math

    from llmd.runtime.formats.engine_dir import load_model_dir
    from llmd.export.quality import heldout_texts, predict, token_windows
    from llmd.runtime.formats.quantized import QuantSpec
    from llmd.runtime.tokenizer import Tokenizer
    out = tmp_path / "int8"
    q = export_engine(ExportOptions(str(source), str(out), quant="int8", backend="onnxruntime",
                                    eval_windows=2, eval_tokens=32))["quality"]
    assert q["measured_on"] == "onnxruntime graph"
    assert read_manifest(out)["quality"]["measured_on"] == "onnxruntime graph"
    # and the manifest says how the graph was quantized, which is not llmd's int8 (one scale per row)
    assert "blocks of 32 (MatMulNBits)" in read_manifest(out)["artifacts"]["onnx_quantization"]
    windows = token_windows(Tokenizer.from_dir(source), heldout_texts()[0], 32, 2)
    backend = create_backend("onnxruntime", out, read_manifest(out), device="cpu")
    cfg = ModelConfig.from_dir(source)
    empty = torch.zeros(cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim)
    logits = torch.stack([backend.forward(w, torch.arange(32), empty, empty)[0] for w in windows])
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), windows[:, 1:])
    assert math.isclose(q["ppl_quantized"], math.exp(nll.item()), rel_tol=1e-5)
    torch_weights, _ = load_model_dir(out / "target", QuantSpec.from_dict(read_manifest(out)["quantization"]))
    torch_ppl = math.exp(predict(torch_weights, windows).nll.mean().item())
    assert not math.isclose(q["ppl_quantized"], torch_ppl, rel_tol=1e-5)   # the check tells the two apart


def test_the_gate_steps_a_backend_through_a_window_as_the_engine_would(source, exported):
    """BackendModel in steps of 3 tokens over the keys and values of the earlier steps (the AOT decode
    package's way) gives the logits of one call over the whole window."""
    from llmd.export.quality import BackendModel
    backend = backend_of(exported("none"))
    cfg = ModelConfig.from_dir(source)
    windows = torch.tensor([[(5 * i * i + 7) % 300 + 1 for i in range(20)], list(range(40, 60))])
    whole = BackendModel(backend, cfg).forward_dense(windows)
    stepped = BackendModel(backend, cfg, chunk=3).forward_dense(windows)
    assert whole.shape == stepped.shape == (2, 20, cfg.vocab_size)
    assert torch.allclose(whole, stepped, atol=1e-4, rtol=1e-4)


@pytest.mark.slow     # 200 prompts of 32 tokens through one-sequence-per-call onnxruntime steps

def test_onnxruntime_int8_keeps_greedy_tokens_of_held_out_prompts_on_the_demo_target(tmp_path):
    """The bundled target exported for onnxruntime with --quant int8 (8-bit weight blocks, float
    activations): 32 greedy tokens identical to the float model's for >= 90 % of 200 held-out prompts,
    as the torch int8 engine is held to."""
    from pathlib import Path

    from heldout import completion_prompts
    target = Path(__file__).resolve().parents[2] / "models" / "code-target"
    out = tmp_path / "ort-int8"
    export_engine(ExportOptions(str(target), str(out), quant="int8", backend="onnxruntime",
                                eval_windows=2, eval_tokens=64))
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = completion_prompts(200)
    ref = [o.token_ids for o in LLM(str(target), kv_memory="16MiB").generate(prompts, params)]
    got = [o.token_ids for o in LLM(str(out), kv_memory="16MiB").generate(prompts, params)]
    assert sum(a == b for a, b in zip(got, ref)) >= 0.9 * len(prompts)
