"""The fused decode step (every layer in one kernel call) gives bit-identical hidden states, logits and
KV pools to the Python forward, and steps aside wherever some part has no kernel form."""
import copy
import dataclasses
import random

import pytest
import torch

from llmd import LLM, SamplingParams
from llmd.runtime import kernels
from llmd.runtime.config import EngineConfig
from llmd.runtime.formats.quantized import Int4Linear, QuantLinear, QuantSpec, prepare_quantized, quantize_model
from llmd.runtime.kernels import ops
from llmd.runtime.model_runner import Feed, ModelRunner
from llmd.runtime.models.fused_decode import FusedDecode, layer_linears
from llmd.runtime.models.layers import Linear, MatvecPlan
from llmd.runtime.models.loader import load_model
from fused_step import force_fused

pytestmark = [pytest.mark.skipif(not kernels.available(), reason=f"llmd kernels unavailable: {kernels.why()}"),
              pytest.mark.usefixtures("no_grad")]

BS = 16


def loaded(model_factory, name, bf16_values=False, quant=None, f32_scales=False, **kw):
    """A random model prepared as the engine prepares it; ``quant`` a QuantSpec to quantize it first
    (``f32_scales``: int4 scales that are no float16 values, as an engine directory of an earlier export
    holds them: the float32 blocks)."""
    model = load_model(model_factory(name, **kw), "float32")
    if bf16_values:             # a checkpoint stored in bfloat16, served in float32: bfloat16 blocks
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    if quant is not None:
        quantize_model(model, quant)
    for m in model.modules() if f32_scales else ():
        if isinstance(m, Int4Linear):
            m.scales = torch.nextafter(m.scales, torch.full_like(m.scales, float("inf")))
    model.prepare_for_inference()
    if quant is not None:
        prepare_quantized(model)
    return model


def one_step(runner, feeds, fused):
    """Logits of one step and the pools after it, with the fused form or the Python forward, from the
    same pool contents."""
    model = runner.model
    saved, before = model.fused_decode, (runner.k_pool.clone(), runner.v_pool.clone())
    steps = saved.steps
    if not fused:
        model.fused_decode = None
    try:
        logits = runner.run(runner.prepare_feeds(feeds))
    finally:
        model.fused_decode = saved
    after = (runner.k_pool.clone(), runner.v_pool.clone())
    runner.k_pool.copy_(before[0])
    runner.v_pool.copy_(before[1])
    return logits, after, saved.steps - steps


@pytest.mark.parametrize("arch,kw,kv_dtype", [
    ("LlamaForCausalLM", {}, "auto"),
    ("LlamaForCausalLM", {"bf16_values": True}, "auto"),
    ("Qwen2ForCausalLM", {"hidden": 128, "heads": 8, "kv_heads": 2}, "auto"),   # qkv bias, 4 query heads per kv head
    ("MistralForCausalLM", {"tie": False, "hidden": 128, "intermediate": 320}, "auto"),
    ("Qwen2ForCausalLM", {"hidden": 128, "heads": 8, "kv_heads": 2}, "bfloat16"),  # keys and values rounded as torch does
], ids=["llama", "llama-bf16-values", "qwen2-gqa", "mistral-untied", "qwen2-bf16-kv"])
def test_fused_step_is_bit_identical_to_the_python_forward(model_factory, arch, kw, kv_dtype):
    model = loaded(model_factory, f"fused-{arch}", architecture=arch, **kw)
    fused = force_fused(model)
    narrow = {m.stored.dtype == torch.bfloat16 for m in model.layers.modules() if type(m) is Linear}
    assert narrow == {bool(kw.get("bf16_values"))}
    assert_steps_match(model, fused, kv_dtype)


QUANT = {   # hidden 192 = 128 + 64 (SmolLM2's 576 is 4 x 128 + 64): the kernels' half lines
    "int8": (QuantSpec("int8"), {"hidden": 192, "intermediate": 320}, ops.KIND_Q8),
    "int4-g64": (QuantSpec("int4", group_size=64), {"hidden": 192, "intermediate": 320}, ops.KIND_Q4H),
    "int4-g32": (QuantSpec("int4", group_size=32), {"hidden": 192, "intermediate": 320}, ops.KIND_Q4H),
    "int4-g32-f32-scales": (QuantSpec("int4", group_size=32), {"hidden": 192, "intermediate": 320}, ops.KIND_Q4),
    "int4-g128-qkv-bias": (QuantSpec("int4", group_size=128), {"architecture": "Qwen2ForCausalLM", "hidden": 256,
                                                                "heads": 8, "kv_heads": 2, "intermediate": 384},
                           ops.KIND_Q4H),
    "int8-untied": (QuantSpec("int8"), {"tie": False, "hidden": 128, "intermediate": 256}, ops.KIND_Q8),
}


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("name", QUANT)
def test_quantized_fused_step_is_bit_identical_to_the_python_forward(model_factory, name, kv_dtype):
    """int8 and int4 layers (and the int8g head that reads the result) in the fused step: one stream,
    five streams and verification rows give the logits and pools of the layer-by-layer forward."""
    spec, kw, kind = QUANT[name]
    model = loaded(model_factory, f"fused-{name}", quant=spec, f32_scales=name.endswith("f32-scales"), **kw)
    assert all(isinstance(m, QuantLinear) for m in layer_linears(model))
    fused = model.fused_decode
    assert fused is not None and fused.max_rows == ops.fused_rows()        # the packed forms take many rows
    assert {p.kind for p in fused._products} == {kind}
    assert_steps_match(model, fused, kv_dtype)


def test_an_untied_embedding_table_keeps_no_packed_copy(model_factory):
    """The packed blocks are for products: an untied int8 embedding is only looked up (its stored rows),
    while the head and the layers have theirs."""
    spec, kw, _ = QUANT["int8-untied"]
    model = loaded(model_factory, "fused-int8-untied", quant=spec, **kw)
    assert model.embed_tokens.table.kernel_product() is None
    assert model.lm_head.kernel_product().kind == ops.KIND_Q8G
    assert all(m.kernel_product() is not None for m in layer_linears(model))


def assert_steps_match(model, fused, kv_dtype):
    """Prompts through the Python forward, then decode and verification steps each run both ways from
    the same pools: the same logits and pools, bit for bit, and the fused step really ran (a step of 30
    rows: where every product's kernel takes that many, as blocks and the packed forms do)."""
    runner = ModelRunner(model, num_blocks=64, block_size=BS, dtype="float32", kv_dtype=kv_dtype)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    lengths = [40, 7, 130, 16, 61]
    blocks, start = [], 0
    for n in lengths:
        need = -(-(n + 20) // BS)
        blocks.append(list(range(start, start + need)))
        start += need
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    # the prompts (254 rows: fused where the products take them), then steps of decode and verification rows
    prefill = [Feed(p, 0, b, 1) for p, b in zip(prompts, blocks)]
    fast, fast_pools, ran = one_step(runner, prefill, fused=True)
    slow, slow_pools, _ = one_step(runner, prefill, fused=False)
    assert ran == (sum(lengths) <= fused.max_rows)
    assert torch.equal(fast, slow) and torch.equal(fast_pools[0], slow_pools[0])
    assert torch.equal(fast_pools[1], slow_pools[1])
    runner.k_pool.copy_(slow_pools[0])
    runner.v_pool.copy_(slow_pools[1])
    steps = [
        [Feed([rng.randrange(vocab)], n, b, 1) for n, b in zip(lengths[:1], blocks)],             # one stream
        [Feed([rng.randrange(vocab)], n, b, 1) for n, b in zip(lengths, blocks)],                 # five streams
        [Feed([rng.randrange(vocab) for _ in range(k)], n, b, k)                                  # proposals verified
         for k, n, b in zip([5, 1, 4, 1, 3], lengths, blocks)],
        [Feed([rng.randrange(vocab) for _ in range(k)], n, b, k)                                  # 30 rows
         for k, n, b in zip([12, 9, 4, 2, 3], lengths, blocks)],
    ]
    for feeds in steps:
        fast, fast_pools, ran = one_step(runner, feeds, fused=True)
        slow, slow_pools, _ = one_step(runner, feeds, fused=False)
        assert ran == (sum(len(f.token_ids) for f in feeds) <= fused.max_rows), "the fused step did not run"
        assert torch.equal(fast, slow)
        assert torch.equal(fast_pools[0], slow_pools[0]) and torch.equal(fast_pools[1], slow_pools[1])


@pytest.mark.parametrize("bf16_values", [False, True], ids=["float32-blocks", "bfloat16-blocks"])
def test_rows_up_to_the_fused_limit_are_fused_and_more_take_the_python_forward(model_factory, bf16_values):
    """The Python forward runs every product of blocks on the kernel (float32 on the vector loop at every
    row count; bfloat16 past ``ops.bf16_amx_rows()`` on the tile unit where AMX has it), so the fused step takes
    batches past 16 rows and prompt chunks, up to ``ops.fused_rows()``; one row more runs in Python."""
    model = loaded(model_factory, f"fused-rows-{bf16_values}", bf16_values=bf16_values)
    fused = force_fused(model)
    most = ops.fused_rows()
    assert fused.max_rows == most > 16
    runner = ModelRunner(model, num_blocks=64, block_size=BS, dtype="float32")
    vocab = model.config.vocab_size
    amx = ops.bf16_amx_rows() if bf16_values else 0
    for n in sorted({17, amx, amx + 1} - {0, 1}):       # streams, about the vector loop's last row on AMX
        feeds = [Feed([i % vocab], 0, [i], 1) for i in range(n)]
        fast, fast_pools, ran = one_step(runner, feeds, fused=True)
        slow, slow_pools, _ = one_step(runner, feeds, fused=False)
        assert ran == 1 and torch.equal(fast, slow) and torch.equal(fast_pools[0], slow_pools[0]), n
    chunk = [1 + i % (vocab - 1) for i in range(most + 1)]      # token ids within the vocabulary
    width = -(-len(chunk) // BS)
    feeds = [Feed(chunk[:most], 0, list(range(20, 20 + width)), most)]
    fast, fast_pools, ran = one_step(runner, feeds, fused=True)
    slow, slow_pools, _ = one_step(runner, feeds, fused=False)
    assert ran == 1 and torch.equal(fast, slow) and torch.equal(fast_pools[1], slow_pools[1])
    _, _, ran = one_step(runner, [Feed(chunk, 0, list(range(20, 20 + width)), 1)], fused=True)   # one row too many
    assert ran == 0


def test_a_whole_step_of_the_default_token_budget_is_fused():
    """A default step (prompt chunks and decodes up to max_batch_tokens rows) fits the fused call, so a
    busy server's steps never take the Python forward's fresh buffers."""
    budget = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_batch_tokens")
    assert ops.fused_rows() >= budget


def test_parts_without_a_kernel_form_keep_the_python_forward(model_factory):
    qwen3 = loaded(model_factory, "fused-qwen3", architecture="Qwen3ForCausalLM", head_dim=16)
    assert FusedDecode.build(qwen3) is None                           # q/k norms before rotary
    bf16 = load_model(model_factory("fused-bf16"), "bfloat16")
    bf16.prepare_for_inference()
    assert FusedDecode.build(bf16) is None
    w8a8 = loaded(model_factory, "fused-w8a8", quant=QuantSpec("w8a8"))
    assert w8a8.fused_decode is None                                  # no fused kind for w8a8
    int4_g32 = loaded(model_factory, "fused-int4-g32-288", quant=QuantSpec("int4", group_size=32), intermediate=288)
    assert int4_g32.fused_decode is None                              # 288 columns: not whole lines of 64
    model = loaded(model_factory, "fused-copy")
    force_fused(model)
    assert copy.deepcopy(model).fused_decode is None                  # a copy has its own weights


def test_engine_output_is_the_same_with_and_without_the_fused_step(tiny_model_dir):
    """Greedy output of a batch, of speculation (verification rows), with a bfloat16 KV pool, and
    with an int8 one (which the fused step leaves to the Python forward)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(20, 400) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for opts in ({}, {"draft": "ngram"}, {"kv_dtype": "bfloat16"}, {"kv_dtype": "int8"}):
        llm = LLM(str(tiny_model_dir), kv_memory="8MiB", **opts)
        model = llm.engine.runner.model
        fused = force_fused(model)
        with_fused = [o.token_ids for o in llm.generate(prompts, params)]
        ran = fused.steps
        model.fused_decode = None
        without = [o.token_ids for o in llm.generate(prompts, params)]
        assert with_fused == without
        assert (ran > 0) == (opts.get("kv_dtype") != "int8")


@pytest.mark.parametrize("compare,names", [("fused", ("fused", "layer_by_layer")),
                                           pytest.param("int4-half", ("int4_f16_blocks", "int4_f32_blocks"),
                                                        marks=pytest.mark.slow)])     # an int4 export first
@pytest.mark.slow     # the benchmark script itself, in a subprocess: `make bench` runs it
@pytest.mark.heavy
def test_the_side_by_side_benchmark_runs_both_paths_and_finds_the_same_tokens(compare, names, tmp_path):
    """bench/bench_decode_paths.py, the source of the fused-step figures in docs/perf/2026-12-01-first-figures.md, on a short
    run (int4-half: a random model exported to int4 here, its float16 and float32 blocks)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "bench_decode_paths.py"
    done = subprocess.run([sys.executable, str(script), "--compare", compare, "--rounds", "1", "--gen", "4",
                           "--streams", "3", "--prompt-len", "20"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["same_tokens"] and result["streams"] == 3
    assert result["fused_steps"] > 0                                  # the fused side really ran fused
    assert result[names[0]]["one_stream_tok_s"] > 0 and result[names[1]]["streams_tok_s"] > 0


@pytest.mark.parametrize("kw,kv_dtype", [
    ({}, "auto"),                                                         # tied head: rows from its blocks
    ({"bf16_values": True}, "auto"),                                      # ... in bfloat16
    ({"tie": False, "hidden": 128, "intermediate": 320}, "bfloat16"),     # untied: float32 embedding rows
    ({"quant": QuantSpec("int8"), "hidden": 192, "intermediate": 320}, "auto"),   # int8g head and its rows
    ({"quant": QuantSpec("int4", group_size=64), "tie": False, "hidden": 128, "intermediate": 256},
     "bfloat16"),                                                         # int8g head, int8 embedding rows
], ids=["tied", "tied-bf16-values", "untied-bf16-kv", "int8-tied", "int4-untied-bf16-kv"])
# the head's outputs fill blocks of 64 (real vocabularies do: 8192, 32000, 151936): a model vocabulary of
# 512 over the test tokenizer's 446 tokens
def test_greedy_draft_rounds_in_one_call_match_the_forward_loop(model_factory, kw, kv_dtype):
    """spec.draft's loop (a forward and an argmax per proposal, the first over each request's catch-up
    tokens) against draft_greedy's one call: the same tokens and the same KV written, for three requests
    at once; a round the blocks of one request cannot hold stops early, where the loop goes on."""
    from llmd.runtime.kernels.ops import argmax
    from llmd.runtime.models.fused_decode import head_of
    model = loaded(model_factory, "draft-" + "-".join(map(str, kw.values())) + kv_dtype, vocab_size=512, **kw)
    fused = force_fused(model)
    if type(head_of(model)[0]) is Linear:
        head_of(model)[0].apply_plan(MatvecPlan("blocked", 1, 16, packed=False))
    runner = ModelRunner(model, num_blocks=64, block_size=BS, dtype="float32", kv_dtype=kv_dtype)
    rng = random.Random(3)
    vocab = model.config.vocab_size
    lengths, steps = [28, 47, 9], 6
    blocks = [[2 * i, 2 * i + 1, 2 * i + 40, 2 * i + 41] for i in range(3)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    runner.run(runner.prepare_feeds([Feed(p, 0, b, 1) for p, b in zip(prompts, blocks)]))
    before = (runner.k_pool.clone(), runner.v_pool.clone())

    def the_loop(catch_up, steps):
        runner.k_pool.copy_(before[0])
        runner.v_pool.copy_(before[1])
        loop = [[] for _ in lengths]
        feeds = [Feed(f, n, b, 1) for f, n, b in zip(catch_up, lengths, blocks)]
        for s in range(steps):
            tok = argmax(runner.run(runner.prepare_feeds(feeds))).tolist()
            for i, t in enumerate(tok):
                loop[i].append(t)
            feeds = [Feed([t], n + len(f) + s, b, 1) for t, n, f, b in zip(tok, lengths, catch_up, blocks)]
        loop_pools = (runner.k_pool.clone(), runner.v_pool.clone())
        runner.k_pool.copy_(before[0])
        runner.v_pool.copy_(before[1])
        return loop, loop_pools

    # 21 rows to catch up on first (past 16: the draft loop's call takes up to ops.draft_rows()), then 6
    many = [[rng.randrange(vocab) for _ in range(k)] for k in (9, 5, 7)]
    loop, loop_pools = the_loop(many, 3)
    assert fused.draft_greedy(runner, many, lengths, blocks, 3) == loop and fused.draft_steps == 3
    assert torch.equal(runner.k_pool, loop_pools[0]) and torch.equal(runner.v_pool, loop_pools[1])
    catch_up = [[rng.randrange(vocab) for _ in range(k)] for k in (2, 1, 3)]    # tokens the draft has not seen
    loop, loop_pools = the_loop(catch_up, steps)
    one_call = fused.draft_greedy(runner, catch_up, lengths, blocks, steps)
    assert one_call == loop and fused.draft_steps == 3 + steps
    assert torch.equal(runner.k_pool, loop_pools[0]) and torch.equal(runner.v_pool, loop_pools[1])
    # a request whose blocks hold positions up to 31 only: its catch-up ends at 29, which leaves room for
    # three steps, and so the call stops there for all (never writing into the table's zero padding: block 0)
    short = fused.draft_greedy(runner, catch_up, lengths, [blocks[0][:2], blocks[1], blocks[2][:1]], steps)
    assert short == [row[:3] for row in loop]
    assert torch.equal(runner.k_pool, loop_pools[0]) and torch.equal(runner.v_pool, loop_pools[1])
    most = ops.draft_rows()
    assert most >= 21
    wide = [list(range(most // 2 + 1))] * 2                       # one row past the call's: the loop's
    assert fused.draft_greedy(runner, wide, [0, 0], blocks[:2], 2) is None


def propose_twice(model, ks, kv_dtype, draft_greedy=None, temperatures=(0.0, 0.0, 0.0)):
    """Two proposal rounds of spec.draft's proposer over three requests (the second after verifying
    two proposals and a bonus token): tokens, the proposer's bookkeeping and the pools."""
    from llmd.runtime.request import Request
    from llmd.runtime.sampler import SamplingRow
    from llmd.runtime.spec.draft import DraftProposer
    fused = model.fused_decode
    if draft_greedy is not None:
        fused.draft_greedy = draft_greedy
    try:
        runner = ModelRunner(model, num_blocks=64, block_size=BS, dtype="float32", kv_dtype=kv_dtype)
        rng = random.Random(5)
        reqs = []
        for i, (n, temp) in enumerate(zip((30, 47, 9), temperatures)):
            r = Request(f"r{i}", [rng.randrange(512) for _ in range(n)], SamplingParams(temperature=temp, max_tokens=50))
            r.block_ids = [4 * i + j for j in range(4)]
            reqs.append(r)
        proposer = DraftProposer(runner)
        rows = lambda req, toks: SamplingRow(req.params, torch.Generator().manual_seed(1) if req.params.temperature
                                             else None, None, req.num_prompt_tokens)
        rounds = []
        for _ in range(2):
            props = proposer.propose(list(zip(reqs, ks)), rows)
            rounds.append([p.token_ids for p in props])
            for r, p in zip(reqs, props):
                old = r.num_tokens
                r.token_ids += p.token_ids[:2] + [7]
                proposer.on_verified(r, len(p.token_ids), min(2, len(p.token_ids)), old)
        return rounds, dict(proposer.computed), runner.k_pool.clone(), runner.v_pool.clone()
    finally:
        fused.__dict__.pop("draft_greedy", None)


@pytest.mark.parametrize("kw,kv_dtype", [({}, "auto"), ({"tie": False, "hidden": 128, "intermediate": 320}, "bfloat16")],
                         ids=["tied", "untied-bf16-kv"])
def test_the_proposer_takes_every_greedy_round_in_calls_and_keeps_its_bookkeeping(model_factory, kw, kv_dtype):
    """Through DraftProposer.propose: depths that differ per request (calls of the depth all still want,
    then the rest), calls cut short, and a round with a sampled request (the loop's own forwards) give
    the same proposals, `computed` and pools as the loop alone."""
    from llmd.runtime.models.fused_decode import head_of
    model = loaded(model_factory, "propose-" + kv_dtype, vocab_size=512, **kw)
    fused = force_fused(model)
    head_of(model)[0].apply_plan(MatvecPlan("blocked", 1, 16, packed=False))
    full = type(fused).draft_greedy.__get__(fused)
    loop_only = lambda *a: None
    cut_short = lambda runner, t, pos, b, steps: full(runner, t, pos, b, min(steps, 2))
    calls = []

    def once_then_loop(runner, t, pos, b, steps):      # two steps in one call, then the loop's forwards
        calls.append(steps)
        return full(runner, t, pos, b, min(steps, 2)) if len(calls) % 2 else None
    for ks in [(3, 5, 4), (1, 5, 5)]:
        want = propose_twice(model, ks, kv_dtype, loop_only)
        for variant in (None, cut_short, once_then_loop):
            before = fused.draft_steps
            got = propose_twice(model, ks, kv_dtype, variant)
            assert fused.draft_steps > before
            assert got[:2] == want[:2]
            assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    before = fused.draft_steps
    mixed = (0.0, 0.8, 0.0)
    got = propose_twice(model, (4, 4, 4), kv_dtype, None, mixed)
    want = propose_twice(model, (4, 4, 4), kv_dtype, loop_only, mixed)
    assert fused.draft_steps == before and got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_a_prepared_model_is_freed_as_soon_as_it_is_dropped(model_factory):
    """The fused form holds the model's tensors, not the model: no reference cycle keeps a dropped
    model's weights alive until a garbage collection."""
    import gc
    import weakref
    model = loaded(model_factory, "fused-freed")
    assert model.fused_decode is not None or force_fused(model)
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()

