"""`llmd export` end to end: engine directory round trip through LLM, greedy parity with the float
model, the quality gate, and refusal of tampered, incomplete or version-mismatched directories."""
import json
import shutil
from pathlib import Path

import pytest

from llmd import LLM, SamplingParams
from llmd.cli import main
from llmd.export.cli import GATE_EXIT, ExportOptions, export_engine
from llmd.runtime.formats.engine_dir import load_engine_draft
from llmd.runtime.formats.manifest import read_manifest
from llmd.export.quality import heldout_texts
from llmd.runtime.config import EngineConfig
from llmd.runtime.errors import EngineDirError
from heldout import completion_prompts

pytestmark = pytest.mark.heavy          # exports

REPO = Path(__file__).resolve().parents[2]
FAST = dict(eval_windows=2, eval_tokens=64)


@pytest.fixture(scope="module")
def source(model_factory):
    return model_factory("export-src", hidden=64, intermediate=128, layers=2)


@pytest.fixture(scope="module")
def draft_source(model_factory):
    return model_factory("export-draft", hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def int8_engine(source, draft_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("eng") / "int8"
    # the weight-only int8 head: this fixture checks the engine directory and the weight-only path;
    # the default (w8a8) head is held to greedy parity on the demo target below
    export_engine(ExportOptions(str(source), str(out), draft=str(draft_source), quant="int8", head="int8", **FAST))
    return out


def prompts(tokenizer, n=10, length=24):
    ids = tokenizer.encode("".join(completion_prompts(2 * n)), add_special_tokens=False)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def greedy(path, prompt_list, tokens=32):
    llm = LLM(str(path), kv_memory="16MiB")
    return [c.token_ids for c in llm.generate(prompt_list, SamplingParams(max_tokens=tokens, ignore_eos=True))]


def test_quant_none_engine_gives_exactly_the_float_greedy_tokens(source, tmp_path):
    out = tmp_path / "none"
    export_engine(ExportOptions(str(source), str(out), quant="none", **FAST))
    ps = prompts(LLM(str(source), kv_memory="16MiB").tokenizer)
    assert greedy(out, ps) == greedy(source, ps)


def test_int8_engine_keeps_greedy_tokens_for_most_prompts(source, int8_engine):
    ps = prompts(LLM(str(source), kv_memory="16MiB").tokenizer)
    same = sum(a == b for a, b in zip(greedy(int8_engine, ps), greedy(source, ps)))
    assert same >= 0.9 * len(ps)


def test_default_int8_engine_keeps_greedy_tokens_of_held_out_prompts_on_the_demo_target(tmp_path):
    """The issue's criterion on real held-out data: the bundled target, prompts from held-out stdlib
    functions, the default int8 export (int8g head), 32 greedy tokens identical for >= 90 % of 200
    (measured: 184; with a w8a8 head 167, with one scale per head row 177, a float head 192)."""
    target = Path(__file__).resolve().parents[2] / "models" / "code-target"
    out = tmp_path / "demo-int8"
    export_engine(ExportOptions(str(target), str(out), quant="int8", **FAST))
    assert read_manifest(out)["quantization"]["head"] == "int8g"
    ps = completion_prompts(200)
    same = sum(a == b for a, b in zip(greedy(out, ps), greedy(target, ps)))
    assert same >= 0.9 * len(ps)


def test_manifest_records_the_export(int8_engine, source):
    m = json.loads((int8_engine / "manifest.json").read_text())
    assert m["format_version"] == 1 and m["backend"] == "torch"
    assert m["quantization"]["method"] == "int8" and m["quantization"]["head"] == "int8"
    assert set(m["models"]) == {"target", "draft"}
    assert "model.safetensors" in m["models"]["target"]["source"]["sha256"]
    assert "target/weights.safetensors" in m["files"] and "target/tokenizer.json" in m["files"]
    q = m["quality"]
    assert q["top1_agreement"] > 0.9 and 0 <= q["draft_acceptance"] <= 1
    # int8 weights with a tied int8 head: about a quarter of the float32 bytes
    assert m["sizes"]["target"]["engine_bytes"] < 0.4 * m["sizes"]["target"]["source_bytes"]


def test_draft_is_loadable_from_the_engine_directory(int8_engine):
    model, cfg, tok = load_engine_draft(int8_engine, EngineConfig(model=str(int8_engine)))
    assert cfg.hidden_size == 32 and cfg.num_layers == 1


def copy_engine(engine, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(engine, dst)
    return dst


def refused(path, match):
    with pytest.raises(EngineDirError, match=match):
        LLM(str(path), kv_memory="16MiB")


def test_flipped_byte_in_weights_is_refused(int8_engine, tmp_path):
    eng = copy_engine(int8_engine, tmp_path)
    w = eng / "target" / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 1
    w.write_bytes(bytes(data))
    refused(eng, "sha256 does not match")


def test_edited_tokenizer_is_refused(int8_engine, tmp_path):
    eng = copy_engine(int8_engine, tmp_path)
    tok = eng / "target" / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace("2048", "4096"))
    refused(eng, "tokenizer_config.json")


def test_missing_file_is_refused_as_incomplete(int8_engine, tmp_path):
    eng = copy_engine(int8_engine, tmp_path)
    (eng / "draft" / "weights.safetensors").unlink()
    refused(eng, "incomplete engine directory, missing draft/weights.safetensors")


def test_other_format_version_is_refused(int8_engine, tmp_path):
    eng = copy_engine(int8_engine, tmp_path)
    m = json.loads((eng / "manifest.json").read_text())
    m["format_version"] = 2
    (eng / "manifest.json").write_text(json.dumps(m))
    refused(eng, "format version 2.*reads version 1")


def test_manifest_that_lies_about_quantization_is_refused(int8_engine, tmp_path):
    eng = copy_engine(int8_engine, tmp_path)
    m = json.loads((eng / "manifest.json").read_text())
    m["quantization"]["method"] = "int4"
    m["quantization"]["group_size"] = 32
    (eng / "manifest.json").write_text(json.dumps(m))
    refused(eng, "tensors do not match")


def test_quality_gate_fails_the_export_and_writes_nothing(source, tmp_path, capsys):
    # A random model's perplexity may move either way under quantization; measure the change
    # first, then set the limit just below it (fails) and just above it (passes).
    args = ["export", "--target", str(source), "--quant", "int4", "--group-size", "32",
            "--eval-windows", "2", "--eval-tokens", "64", "--min-top1-agreement", "0"]
    measured = export_engine(ExportOptions(str(source), str(tmp_path / "probe"), quant="int4", group_size=32,
                                           accept_loss=True, **FAST))
    increase = 100 * measured["quality"]["ppl_increase"]
    out = tmp_path / "gated"
    assert main(args + ["--max-ppl-increase", str(increase - 0.01), "--out", str(out)]) == GATE_EXIT
    assert "quality gate failed" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.glob(".gated.partial*")) == []
    assert main(args + ["--max-ppl-increase", str(increase + 0.01), "--out", str(out)]) == 0
    assert (out / "manifest.json").exists()
    before = (out / "manifest.json").read_bytes()
    # a failed gate over an existing engine leaves it whole
    assert main(args + ["--max-ppl-increase", str(increase - 0.01), "--out", str(out), "--force"]) == GATE_EXIT
    assert (out / "manifest.json").read_bytes() == before and read_manifest(out)


def test_the_gate_is_on_by_default_and_refuses_a_damaged_export_naming_the_flag(tmp_path, capsys, monkeypatch):
    """The bundled target, its weights damaged by the export's quantizer (noise added to every matrix as
    it is quantized): with no gate flag given, the export is refused with the gate's exit status, the
    message names the flag that accepts the loss, and nothing is written; with that flag it is written
    and the manifest says the loss was accepted."""
    import torch

    from llmd.runtime.formats import quantized as quantize
    target = REPO / "models" / "code-target"
    real = quantize.Int8Linear.load_weight
    gen = torch.Generator().manual_seed(0)

    def damaged(self, w):
        real(self, w + 0.5 * w.float().std() * torch.randn(w.shape, generator=gen))
    monkeypatch.setattr(quantize.Int8Linear, "load_weight", damaged)
    args = ["export", "--target", str(target), "--quant", "int8", "--eval-windows", "2", "--eval-tokens", "64"]
    out = tmp_path / "damaged"
    assert main(args + ["--out", str(out)]) == GATE_EXIT
    err = capsys.readouterr().err
    assert "quality gate failed" in err and "--accept-loss" in err and "Traceback" not in err
    assert ("--max-ppl-increase" in err or "--min-top1-agreement" in err) and not out.exists()
    assert main(args + ["--out", str(out), "--accept-loss"]) == 0
    assert "written because --accept-loss was given" in capsys.readouterr().out
    gate = read_manifest(out)["quality"]["gate"]
    assert not gate["passed"] and gate["accepted_loss"] and gate["max_ppl_increase"] == 5.0


def test_the_gate_measures_llmds_own_text_by_default(tmp_path):
    """Without --eval-file the windows come from the text shipped in the package (prose and code), spread
    over all of it; the bundled target's default int8 export passes the default gate on it."""
    from llmd.export.quality import EVAL_TEXT, heldout_texts
    texts, source = heldout_texts()
    assert texts == [EVAL_TEXT.read_text(encoding="utf-8")] and "evaluation text" in source
    assert "def " in texts[0] and "The capital of France is Paris" in texts[0]
    target = REPO / "models" / "code-target"
    q = export_engine(ExportOptions(str(target), str(tmp_path / "e"), quant="int8", **FAST))["quality"]
    assert q["source"] == source and q["gate"]["passed"]


def test_export_refuses_to_overwrite_its_source_or_a_directory_that_is_not_an_engine(source, tmp_path, capsys):
    assert main(["export", "--target", str(source), "--out", str(source), "--force"]) == 2
    assert "would overwrite or sit inside the model being exported" in capsys.readouterr().err
    assert main(["export", "--target", str(source), "--out", str(source.parent), "--force"]) == 2
    assert (source / "config.json").is_file()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["export", "--target", str(source), "--out", str(other), "--force"]) == 2
    assert "not an llmd engine directory" in capsys.readouterr().err and (other / "keep.txt").is_file()


def test_cli_prints_the_summary_table(source, tmp_path, capsys):
    out = tmp_path / "cli"
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("def add(a, b):\n    return a + b\n" * 40)
    rc = main(["export", "--target", str(source), "--quant", "w8a8", "--eval-file", str(eval_file),
               "--eval-windows", "2", "--eval-tokens", "32", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "perplexity" in text and "top-1 agreement" in text and str(eval_file) in text
    assert main(["export", "--target", str(source), "--out", str(out)]) == 2    # exists, no --force


@pytest.mark.parametrize("quant,extra", [("int8", {}), ("int4", {"group_size": 32}), ("w8a8", {}),
                                         ("int4", {"group_size": 64, "symmetric": True, "head": "float"}),
                                         ("int8", {"head": "float", "embed": "int8"}),
                                         ("w8a8", {"embed": "int8", "untied": True})])
def test_engine_dir_round_trip_is_exact(source, model_factory, tmp_path, quant, extra):
    """What is loaded back computes exactly what the quantized model computed before it was written."""
    import torch

    from llmd.runtime.formats.engine_dir import load_engine_part
    from llmd.runtime.formats.quantized import QuantSpec, prepare_quantized, quantize_model
    from llmd.runtime.models.loader import load_model
    if extra.pop("untied", False):
        source = model_factory("untied", hidden=64, intermediate=128, layers=1, tie=False)
    out = tmp_path / "rt"
    # a random model: the gate's limits are not the point here, nor is the int4 scale search (which
    # changes the float weights before rounding); the directory must load back exactly
    export_engine(ExportOptions(str(source), str(out), quant=quant, **extra, **FAST, accept_loss=True,
                                scale_search=False))
    before = quantize_model(load_model(source), QuantSpec(quant, **extra))
    before.prepare_for_inference()
    prepare_quantized(before)
    after, _, _ = load_engine_part(out, read_manifest(out), "target")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with torch.no_grad():
        for batch in (ids, ids[:, :2]):
            assert torch.equal(before.forward_dense(batch), after.forward_dense(batch))


def test_bfloat16_engine_serves(int8_engine):
    llm = LLM(str(int8_engine), kv_memory="16MiB", dtype="bfloat16")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_a_compiled_backend_with_another_kv_dtype_is_refused_before_any_work(source, tmp_path):
    """onnxruntime and tensorrt engines keep keys and values in the model's dtype: an export asking for
    another KV dtype would make an engine no runtime could load, so it is refused up front."""
    from llmd.runtime.formats.quantized import QuantizationError
    out = tmp_path / "never"
    with pytest.raises(QuantizationError, match="--kv-dtype auto"):
        export_engine(ExportOptions(str(source), str(out), quant="none", backend="onnxruntime", kv_dtype="bfloat16",
                                    **FAST))
    assert not out.exists()


@pytest.mark.parametrize("flags, match", [
    (["--eval-tokens", "0"], "--eval-tokens must be at least 2"),
    (["--eval-windows", "0"], "--eval-windows must be at least 1"),
    (["--max-ppl-increase", "nan"], "--max-ppl-increase must be a finite percentage"),
    (["--min-top1-agreement", "101"], "--min-top1-agreement must be a percentage from 0 to 100"),
    (["--eval-tokens", "100000"], "longer than the target's context window"),
])
def test_bad_export_flags_are_refused_with_a_message(source, tmp_path, capsys, flags, match):
    assert main(["export", "--target", str(source), "--out", str(tmp_path / "e"), *flags]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and not (tmp_path / "e").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_by_export(source, tmp_path, capsys):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(source, src)
    shutil.copyfile(REPO / "models" / "code-target" / "tokenizer.json", src / "tokenizer.json")   # 8,192 tokens
    assert main(["export", "--target", str(src), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "tokenizer has 8192 tokens but config.json says vocab_size" in err and not (tmp_path / "e").exists()


def test_a_file_added_to_an_engine_directory_after_export_is_refused(source, tmp_path):
    out = tmp_path / "eng"
    export_engine(ExportOptions(str(source), str(out), **FAST))
    (out / "target" / "extra.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(EngineDirError, match="files the manifest does not list: target/extra.safetensors"):
        read_manifest(out)
