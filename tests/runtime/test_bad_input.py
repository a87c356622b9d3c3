"""Bad input gets a clear, typed error, and the engine goes on serving everyone else."""
import json
import shutil
import struct

import pytest

from llmd import LLM, SamplingParams
from llmd.runtime.errors import InvalidRequest, ModelLoadError


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model directory"):
        LLM(str(tmp_path / "nope"))


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors.*truncated or corrupt"):
        LLM(str(d))


def test_header_that_lies_about_sizes(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    f = d / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 10_000_000]       # claims far more bytes than exist
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(d))


def test_shape_mismatch_names_tensor(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"tensor .model.layers.0.mlp.\w+_proj.weight. has shape \(\d+, \d+\), config.json implies"):
        LLM(str(d))


def test_unknown_architecture(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        LLM(str(d))


def test_a_device_the_model_cannot_run_on_is_refused_before_loading(tiny_model_dir):
    import torch
    with pytest.raises(InvalidRequest, match="device must be one of auto, cpu, cuda"):
        LLM(str(tiny_model_dir), device="gpu")
    # asking for CUDA where torch sees no GPU says why instead of quietly running on the CPU
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="--device cuda: .* or use --device cpu"):
            LLM(str(tiny_model_dir), device="cuda")
    assert LLM(str(tiny_model_dir), device="cpu", kv_memory="4MiB").generate(
        [[30, 31]], SamplingParams(max_tokens=2))[0].error is None


def test_malformed_config_json(tiny_model_dir, tmp_path):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        LLM(str(d))


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope scaling's factor must be a finite positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope scaling's factor must be a finite positive"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite positive number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                       "original_max_position_embeddings": 64}},
     "high_freq_factor > low_freq_factor"),
    ({"eos_token_id": ["</s>"]}, "'eos_token_id' must be a token id"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
    ({"quantization_config": {"quant_method": "fp8"}}, "already quantized"),
    ({"vocab_size": 10 ** 9}, "more than .* bytes of safetensors can hold"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear rope scaling needs factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8}}, "llama3 rope scaling needs low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
])
def test_inconsistent_config_values_are_refused_naming_the_file(tiny_model_dir, tmp_path, change, match):
    d = copy_model(tiny_model_dir, tmp_path / "m")
    cfg = {**json.loads((d / "config.json").read_text()), **change}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(d), kv_memory="4MiB")


def test_weights_of_an_unloadable_dtype_or_found_twice_are_refused(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    d = copy_model(tiny_model_dir, tmp_path / "fp8")
    tensors = load_file(str(d / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("down_proj.weight"))
    save_file({**tensors, name: tensors[name].to(torch.float8_e4m3fn)}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' has dtype float8_e4m3fn"):
        LLM(str(d), kv_memory="4MiB")
    d = copy_model(tiny_model_dir, tmp_path / "twice")
    save_file({name: tensors[name]}, str(d / "zz-extra.safetensors"))
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' is also in another safetensors file"):
        LLM(str(d), kv_memory="4MiB")
    d = copy_model(tiny_model_dir, tmp_path / "index")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {name: 1}}))
    with pytest.raises(ModelLoadError, match="weight_map values must be shard file names"):
        LLM(str(d), kv_memory="4MiB")


@pytest.mark.parametrize("make_params, match", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(max_tokens=-5), "max_tokens"),
    (lambda: SamplingParams(prompt_only="yes"), "prompt_only"),
    (lambda: SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(logprobs=1000), "logprobs"),
])
def test_bad_sampling_params(make_params, match):
    with pytest.raises(InvalidRequest, match=match):
        make_params()


def test_bad_requests_fail_alone(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="4MiB", max_model_len=64)
    e = llm.engine
    e.add_request("good", [30, 31, 32], SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    with pytest.raises(InvalidRequest, match="context window is 64"):
        e.add_request("long", [30] * 64, SamplingParams())
    with pytest.raises(InvalidRequest, match=r"token ids must be integers in \[0, "):
        e.add_request("oov", [30, 10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="empty"):
        e.add_request("empty", [], SamplingParams())
    # A text that cannot fit is refused from its length alone, before it is tokenized (no stall)
    # and a text as long as it could be still tokenizes and meets the exact check.
    with pytest.raises(InvalidRequest, match="characters cannot fit the context window of 64 tokens"):
        e.add_request("huge", "x = 1\n" * 200_000, SamplingParams())
    with pytest.raises(InvalidRequest, match="context window is 64"):
        e.add_request("long text", "x = 1\n" * 100, SamplingParams())
    with pytest.raises(InvalidRequest, match="already in use"):
        e.add_request("good", [1], SamplingParams())
    texts = []
    while e.has_unfinished():
        for o in e.step():
            texts.append(o)
    final = [o for o in texts if o.finished]
    assert [o.request_id for o in final] == ["good"] and final[0].metrics["output_tokens"] == 8
    st = e.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_generate_with_one_bad_prompt_leaves_no_request_behind(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="4MiB", max_model_len=64)
    with pytest.raises(InvalidRequest, match="context window is 64"):
        llm.generate([[30, 31], [32, 33], [30] * 64], SamplingParams(max_tokens=4))
    finals = llm.engine.step()               # only the two aborted requests' final outputs remain
    assert [(o.finish_reason, o.new_token_ids) for o in finals] == [("abort", [])] * 2
    assert not llm.engine.has_unfinished()
    st = llm.stats()
    assert st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_free"] == st["kv_blocks_total"]
    assert [len(c.token_ids) for c in llm.generate([[30, 31]], SamplingParams(max_tokens=4, ignore_eos=True))] == [4]


@pytest.mark.parametrize("arch, extra, window", [
    ("MistralForCausalLM", {}, 4096),                                   # no key: transformers' default window
    ("MistralForCausalLM", {"sliding_window": None}, None),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 28}, None),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, 16),
])
def test_a_sliding_window_is_a_cap_only_for_backends_without_windows(arch, extra, window):
    from llmd.runtime.models.config import ModelConfig
    raw = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 8192,
           **extra}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.max_position_embeddings == 8192 and cfg.window_cap == window
