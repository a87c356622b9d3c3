"""The engine's output never depends on batching, chunking, caching or preemption."""
import random
import time

import pytest
import torch

from engine_run import run as run_engine
from llmd import LLM, SamplingParams
from llmd.runtime.request import Priority

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n=8, seed=0, shared=0):
    rng = random.Random(seed)
    head = [rng.randrange(20, 400) for _ in range(shared)]
    return [head + [rng.randrange(20, 400) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def run(model, ps, params=GREEDY, **kw):
    return run_engine(model, ps, params, **kw)


@pytest.fixture(scope="module")
def ps():
    return prompts(8, shared=0)


@pytest.fixture(scope="module")
def alone(tiny_model_dir, ps):
    return [run(tiny_model_dir, [p])[0][0] for p in ps]


def test_batch_equals_alone(tiny_model_dir, ps, alone):
    batched, _ = run(tiny_model_dir, ps)
    assert batched == alone


def test_chunked_prompts_equal_whole(tiny_model_dir, ps, alone):
    chunked, _ = run(tiny_model_dir, ps, max_batch_tokens=16)
    assert chunked == alone


def test_reference_attention_equals_fast(tiny_model_dir, ps, alone):
    ref, _ = run(tiny_model_dir, ps, attention="reference")
    assert ref == alone


def test_preemption_keeps_output(tiny_model_dir, ps, alone):
    # 96 slots for 8 requests of up to ~94 tokens each: the pool must preempt and recompute.
    small, stats = run(tiny_model_dir, ps, kv_memory=96 * 2 * 2 * 32 * 4, block_size=16)
    assert stats["preemptions"] > 0
    assert small == alone


def test_prefix_cache_keeps_output_and_hits(tiny_model_dir):
    ps = prompts(6, seed=3, shared=40)
    off, _ = run(tiny_model_dir, ps, prefix_cache=False)
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB")
    first = llm.generate(ps[:1], GREEDY)[0].token_ids
    rest = [o.token_ids for o in llm.generate(ps[1:], GREEDY)]
    assert [first] + rest == off
    st = llm.stats()
    assert st["prefix_tokens_hit"] >= 5 * 32
    assert 0 < st["prefix_hit_rate"] < 1


def test_seeded_sampling_independent_of_batch(tiny_model_dir):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB")
    alone = llm.generate([[30, 31, 32]], p)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=0.7, seed=s, ignore_eos=True) for s in range(5)]
    outs = llm.generate([[40, 41], [30, 31, 32], [50] * 30, [60, 61, 62, 63], [70] * 7, [80]],
                        [others[0], p, others[1], others[2], others[3], others[4]])
    assert outs[1].token_ids == alone
    assert len(set(tuple(o.token_ids) for o in outs)) > 1


def test_stop_conditions(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB")
    free = llm.generate([[30, 31, 32]], GREEDY)[0]
    tok = free.token_ids[5]
    stopped = llm.generate([[30, 31, 32]], SamplingParams(max_tokens=24, stop_token_ids=(tok,), ignore_eos=True))[0]
    first = free.token_ids.index(tok)
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    length = llm.generate([[30, 31, 32]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    text = llm.generate(["def fib(n):"], SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    assert len(text) > 6, f"40 tokens gave only {text!r}: too little text to cut at a stop string"
    stop = text[3:6]
    cut = llm.generate(["def fib(n):"], SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


def test_abort_in_every_state_frees_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", max_batch_tokens=16)
    e = llm.engine
    e.add_request("queued", [1] * 10, GREEDY)
    e.add_request("prompt", [2] * 60, GREEDY)       # 60-token prompt: several chunks of 16
    e.add_request("decoding", [3] * 3, GREEDY)
    e.abort("queued")
    e.step()
    # "prompt" is mid-prompt and "decoding" has started.
    assert e.scheduler.requests["prompt"].num_computed_tokens < 60
    e.step(); e.step()
    assert e.abort("prompt") and e.abort("decoding")
    outs = e.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == {"prompt", "decoding"}
    st = e.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["running"] == 0
    assert not e.abort("unknown")


def test_priority_admission_and_preemption(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", max_num_seqs=1)
    e = llm.engine
    e.add_request("batch", [5] * 8, GREEDY, priority="batch")
    e.add_request("normal", [6] * 8, GREEDY, priority="normal")
    e.add_request("inter", [7] * 8, GREEDY, priority=Priority.INTERACTIVE)
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["inter"]
    while e.has_unfinished():
        e.step()
    # Preemption picks the lowest priority: a pool for about two requests, three long ones.
    llm = LLM(str(tiny_model_dir), kv_memory=2 * 64 * 2 * 2 * 32 * 4, block_size=16)
    e = llm.engine
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    e.add_request("b", [5] * 20, long, priority="batch")
    e.step()                      # the batch request runs first (its prompt would wait for the others)
    e.add_request("i", [7] * 20, long, priority="interactive")
    e.add_request("n", [6] * 20, long, priority="normal")
    preempted = []
    while e.has_unfinished():
        before = {r.request_id: r.metrics.preemptions for r in e.scheduler.requests.values()}
        e.step()
        preempted += [rid for rid, n in before.items()
                      if rid in e.scheduler.requests and e.scheduler.requests[rid].metrics.preemptions > n]
    assert preempted and "i" not in preempted
    assert preempted[0] == "b"


@pytest.mark.parametrize("limit", ["blocks", "sequences"])
def test_an_interactive_request_arriving_later_preempts_running_batch_work_at_once(tiny_model_dir, limit):
    """Running batch requests hold the whole pool (or every sequence slot): an interactive request that
    arrives later is admitted at the next step, in place of the latest batch request, which is then
    recomputed with its output unchanged."""
    # 4 blocks, or 2 sequence slots; no speculation, whose lookahead would take slots of its own
    kw = dict(kv_memory=64 * 2 * 2 * 32 * 4, block_size=16) if limit == "blocks" else dict(max_num_seqs=2)
    kw["draft"] = "none"
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [c.token_ids for c in LLM(str(tiny_model_dir), kv_memory="8MiB").generate([[5] * 20, [6] * 20], long)]
    e = LLM(str(tiny_model_dir), **kw).engine
    e.add_request("b1", [5] * 20, long, priority="batch")
    e.add_request("b2", [6] * 20, long, priority="batch")
    outs: dict[str, list[int]] = {}

    def step():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for _ in range(3 if limit == "sequences" else 12):
        step()
    assert {r.request_id for r in e.scheduler.running} == {"b1", "b2"}
    e.add_request("i", [7] * 20, SamplingParams(max_tokens=4, ignore_eos=True), priority="interactive")
    step()
    assert "i" in {r.request_id for r in e.scheduler.running}
    assert e.scheduler.requests["b2"].metrics.preemptions == 1
    while e.has_unfinished():
        step()
    assert [outs["b1"], outs["b2"]] == alone and len(outs["i"]) == 4


def test_a_batch_prompt_waits_while_an_interactive_prompt_computes(tiny_model_dir):
    """A batch prefill in progress does not share steps with an interactive request (it would lengthen
    them); it goes on once the interactive request is done, and its output is unchanged."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = LLM(str(tiny_model_dir), kv_memory="8MiB", draft="none").generate([[5] * 90], params)[0].token_ids
    e = LLM(str(tiny_model_dir), kv_memory="8MiB", max_batch_tokens=32, draft="none", batch_quiet_ms=300).engine
    e.add_request("b", [5] * 90, params, priority="batch")
    outs: dict[str, list[int]] = {}

    def step():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    step()
    assert e.scheduler.requests["b"].num_computed_tokens == 32
    e.add_request("i", [7] * 70, SamplingParams(max_tokens=3, ignore_eos=True), priority="interactive")
    while "i" in e.scheduler.requests:
        step()
        assert e.scheduler.requests["b"].num_computed_tokens == 32       # its prompt waited
    done = time.monotonic()
    assert 0 < e.deferred_s() <= 0.3                                     # and waits for a quiet moment
    step()
    assert e.scheduler.requests["b"].num_computed_tokens == 32
    while e.has_unfinished():
        step()
    assert time.monotonic() - done >= 0.29
    assert outs["b"] == alone and len(outs["i"]) == 3


def test_batch_prompts_are_computed_in_short_chunks(tiny_model_dir):
    e = LLM(str(tiny_model_dir), kv_memory="8MiB", draft="none", batch_prompt_chunk=24, batch_quiet_ms=0).engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    e.add_request("b", [5] * 100, params, priority="batch")
    e.add_request("n", [6] * 100, params, priority="normal")
    e.step()                     # the normal prompt in one step; the batch one waits while it runs
    assert e.scheduler.requests["n"].num_computed_tokens == 100
    while "n" in e.scheduler.requests:
        e.step()
    assert e.scheduler.requests["b"].num_computed_tokens == 0
    e.step()
    e.step()
    assert e.scheduler.requests["b"].num_computed_tokens == 48


def test_int8_kv_cache_stays_close(tiny_model_dir, ps, alone):
    got, st = run(tiny_model_dir, ps, kv_dtype="int8")
    assert st["kv_dtype"] == "int8"
    same_first = sum(g[:8] == a[:8] for g, a in zip(got, alone))
    assert same_first >= 6, f"only {same_first}/8 prompts keep their first 8 greedy tokens with int8 KV"
    # logits of one prompt, float against int8 KV, through a chunked prompt
    f32 = LLM(str(tiny_model_dir), kv_memory="4MiB", max_batch_tokens=16)
    i8 = LLM(str(tiny_model_dir), kv_memory="4MiB", max_batch_tokens=16, kv_dtype="int8")
    p = SamplingParams(max_tokens=1, logprobs=5)
    a = f32.generate([ps[0]], p)[0].logprobs[0]["top"]
    b = dict(i8.generate([ps[0]], p)[0].logprobs[0]["top"])
    for tok, lp in a[:3]:
        assert tok in b and abs(b[tok] - lp) < 0.05


def test_bfloat16_kv_cache_halves_the_pool_and_keeps_greedy_output(tiny_model_dir, ps, alone):
    """A float32 model over a bfloat16 pool: the same budget holds twice the blocks, the attention
    kernel (decode rows) and torch's path (prompt chunks) agree with the reference attention over the
    same pool, and the greedy text stays that of the exact float32 pool on at least 7 of these 8 prompts
    (rounding keys and values to bfloat16 may flip a near-tie)."""
    f32 = LLM(str(tiny_model_dir), kv_memory="4MiB")
    bf = LLM(str(tiny_model_dir), kv_memory="4MiB", kv_dtype="bfloat16")
    assert bf.engine.runner.k_pool.dtype == torch.bfloat16
    assert bf.engine.block_manager.num_blocks == 2 * f32.engine.block_manager.num_blocks
    got, st = run(tiny_model_dir, ps, kv_dtype="bfloat16", max_batch_tokens=16)      # chunked prompts, batched
    assert st["kv_dtype"] == "bfloat16"
    ref, _ = run(tiny_model_dir, ps, kv_dtype="bfloat16", attention="reference")
    assert got == ref
    same = sum(g == a for g, a in zip(got, alone))
    assert same >= 7, f"only {same}/8 prompts keep their greedy tokens over a bfloat16 KV pool"


def test_an_important_long_prompt_never_stalls_running_streams(tiny_model_dir):
    """A 600-token interactive prompt arrives while batch streams decode, with a 64-token step budget:
    it is computed in chunks of what the decodes leave, and every running stream gains a token at
    every step meanwhile (its output unchanged)."""
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [c.token_ids for c in LLM(str(tiny_model_dir), kv_memory="8MiB").generate([[5] * 8, [6] * 8], long)]
    e = LLM(str(tiny_model_dir), kv_memory="8MiB", max_batch_tokens=64).engine
    e.add_request("b1", [5] * 8, long, priority="batch")
    e.add_request("b2", [6] * 8, long, priority="batch")
    outs: dict[str, list[int]] = {}

    def step() -> set[str]:
        got = set()
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.new_token_ids:
                got.add(o.request_id)
        return got
    step(); step()
    e.add_request("i", [7 + i % 300 for i in range(600)], SamplingParams(max_tokens=2), priority="interactive")
    prompt_steps = 0
    while "i" not in outs:
        assert {"b1", "b2"} <= step(), "a running stream got no token while the prompt was computed"
        prompt_steps += 1
    assert prompt_steps >= 600 // 64
    while e.has_unfinished():
        step()
    assert [outs["b1"], outs["b2"]] == alone


@pytest.mark.heavy
def test_loading_a_model_does_not_import_torch_compiler_machinery(tiny_model_dir):
    """Building the model on the meta device used to run ops through torch's Python reference code,
    importing torch._dynamo and sympy on every load (1 s of each daemon start here, for nothing)."""
    import subprocess
    import sys
    code = ("import sys; from llmd import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_model_dir)!r}, kv_memory='16MiB'); "
            "assert llm.generate(['x'], SamplingParams(max_tokens=2))[0].token_ids; "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bfloat16_on_a_cpu_without_bfloat16_arithmetic_says_what_to_use(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """``cpu_bf16`` reads the CPU's flags; where they lack AVX-512 BF16 and AMX, loading with
    ``dtype=bfloat16`` warns that torch widens every product and names the faster equivalent."""
    import logging
    from llmd.runtime import loading
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma f16c\n")
    assert loading.cpu_bf16(str(info)) is False
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert loading.cpu_bf16(str(info)) is True
    assert loading.cpu_bf16(str(tmp_path / "missing")) is None
    for has, warned in ((False, True), (True, False)):
        monkeypatch.setattr(loading, "cpu_bf16", lambda has=has: has)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llmd.loading"):
            LLM(str(tiny_model_dir), kv_memory="4MiB", dtype="bfloat16", draft="none")
        assert any("--dtype float32" in r.getMessage() for r in caplog.records) is warned
