"""A GGUF file served from its own blocks (llmd.runtime.formats.gguf_native, kernels' blocks.c).

Every block type: dequantization equal to the `gguf` package's bit for bit; products equal to a
float64 product of the dequantized weight with x quantized as the kernel says; each row's result the
same alone and in any batch. A model of each type serves, batch-invariant; the mapped file's pages are
read in place (no anonymous copy); a file is found by its magic bytes; hostile files fail typed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from llmd.runtime import kernels
from llmd.runtime.errors import ModelLoadError
from llmd.runtime.formats.gguf_check import GGUFError, is_gguf_file
from llmd.runtime.formats.gguf_native import BLOCKS, PACKS8, TYPES, GGUFLinear, load_native
from llmd.runtime.kernels import ops
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams

from gguf_factory import ALL_TYPES, BLOCK_TYPES, random_blocks, write_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="llmd's kernels are not built here")
K32 = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}


def gguf_dequantize(name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    import gguf
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(TYPES[name])).reshape(rows, cols)


def x_as_quantized(name: str, x: np.ndarray) -> np.ndarray:
    """x as the kernel reads it for a weight of type ``name``: float32 for the float types, else each
    span of 32 (or 256) columns as round(x 127 / max|x|) times max|x| / 127, in float64."""
    if name in ("F32", "F16", "BF16"):
        return x.astype(np.float64)
    span = 32 if name in K32 else 256
    m, k = x.shape
    xs = x.reshape(m, k // span, span)
    amax = np.abs(xs).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xs * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


def product(name: str, raw: np.ndarray, x: np.ndarray, n: int, order=None) -> np.ndarray:
    lin = GGUFLinear(x.shape[1], [(TYPES[name], torch.from_numpy(raw))])
    if order is not None:
        lin.permute_outputs(torch.as_tensor(order))
    y = ops.gg_matvec(torch.from_numpy(x), lin.parts(), 1, n)
    assert y is not None
    assert (lin.packed_bytes() > 0) == (TYPES[name] in PACKS8 and n % 8 == 0)
    return y.numpy()


@pytest.mark.parametrize("name", ALL_TYPES)
def test_dequantization_equals_the_gguf_package_bit_for_bit(name):
    rng = np.random.default_rng(TYPES[name])
    rows, cols = 40, 512
    raw = np.ascontiguousarray(random_blocks(name, rows, cols, rng))
    want = gguf_dequantize(name, raw, rows, cols).astype(np.float32)
    lin = GGUFLinear(cols, [(TYPES[name], torch.from_numpy(raw))])
    got = lin.dense_weight().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    ids = torch.tensor([39, 0, 7, 7])
    assert np.array_equal(lin.rows(ids).numpy().view(np.uint32), want[ids.numpy()].view(np.uint32))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_products_equal_a_float64_product_and_each_row_stands_alone(name):
    rng = np.random.default_rng(100 + TYPES[name])
    n, k = 48, 768
    raw = np.ascontiguousarray(random_blocks(name, n, k, rng))
    w = gguf_dequantize(name, raw, n, k).astype(np.float64)
    # 70 rows: Q5_K and Q6_K widen their rows (blocks.c, E8_MIN), across two tiles of x (M_TILE)
    x = rng.standard_normal((70, k)).astype(np.float32)
    x[3] = 0.0                                       # a row of zeros: scale 0, no NaN
    x[5, :32] *= 1000                                # one span far larger than the rest
    y = product(name, raw, x, n)
    if TYPES[name] in PACKS8:                        # and the file's layout gives the same numbers' sums
        lin = GGUFLinear(k, [(TYPES[name], torch.from_numpy(raw))], packable=False)
        flat = ops.gg_matvec(torch.from_numpy(x), lin.parts(), 1, n).numpy()
        assert np.abs(flat - y).max() <= 1e-5 * np.abs(y).max()
    want = x_as_quantized(name, x) @ w.T
    bound = np.abs(x_as_quantized(name, x)) @ np.abs(w).T
    assert np.all(np.abs(y - want) <= 1e-5 * bound + 1e-30), np.abs(y - want).max()
    assert np.all(y[3] == 0)
    for rows in ([0], [36], [4, 5, 6], list(range(1, 9)), list(range(30, 37)), list(range(50, 70))):
        alone = product(name, raw, np.ascontiguousarray(x[rows]), n)
        assert np.array_equal(alone.view(np.uint32), y[rows].view(np.uint32)), rows
    # against the float weight the error is x's 8-bit rounding alone (the float types: none)
    exact = x.astype(np.float64) @ w.T
    tol = 1e-5 if name in ("F32", "F16", "BF16") else 0.03
    assert np.abs(y - exact).max() <= tol * np.abs(exact).max()


def test_parts_and_row_orders_are_outputs_end_to_end():
    rng = np.random.default_rng(7)
    k = 512
    a, b = random_blocks("Q4_K", 32, k, rng), random_blocks("Q6_K", 16, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    lin = GGUFLinear(k, [(TYPES["Q4_K"], torch.from_numpy(a)), (TYPES["Q6_K"], torch.from_numpy(b))])
    perm = torch.cat([torch.randperm(32, generator=torch.Generator().manual_seed(1)), torch.arange(32, 48)])
    lin.permute_outputs(perm)
    y = lin(torch.from_numpy(x)).numpy()
    ya, yb = product("Q4_K", a, x, 32), product("Q6_K", b, x, 16)
    assert np.array_equal(y, np.concatenate([ya[:, perm[:32].numpy()], yb], axis=1))
    dense = lin.dense_weight().numpy()
    assert np.array_equal(dense[:32], gguf_dequantize("Q4_K", a, 32, k)[perm[:32].numpy()])
    with pytest.raises(ValueError):
        lin.permute_outputs(torch.arange(47, -1, -1))          # would move rows between parts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One small model per type (every matrix of that type), llama (tied) and qwen2 (untied, biases)."""
    out = {}
    for i, name in enumerate(ALL_TYPES):
        arch = "qwen2" if i % 2 else "llama"
        out[name] = write_model(tmp_path_factory.mktemp("native") / f"{name}.gguf", {"*": name}, arch=arch,
                                tie=arch == "llama", seed=i)
    return out


PROMPTS = ["def fib(n):", "import os\nimport sys\n", "The quick brown fox", "héllo wörld 🙂", "for i in range(10):",
           "class Reader:", "x = 1\ny = 2\n", "print('hello world')"]


@pytest.mark.parametrize("name", ALL_TYPES)
def test_each_type_serves_and_a_row_does_not_depend_on_its_batch(models, name):
    llm = LLM(str(models[name]), kv_memory="8MiB", draft="none")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batch = [c.token_ids for c in llm.generate(PROMPTS, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batch == alone
    assert all(len(t) == 12 for t in batch)
    assert llm.engine.runner.model.fused_decode is not None and llm.engine.runner.model.fused_decode.steps > 0


def test_native_logits_follow_the_float_import(models):
    """The same file served in place and imported as float32: x's 8-bit rounding moves the final
    hidden state by a few percent at most."""
    import torch.nn.functional as F
    path = models["Q4_K"]
    native, _, tok = load_native(path, progress=False)
    native.prepare_for_inference()
    ids = torch.tensor(tok.encode("def fib(n):\n    return n"))
    from llmd.runtime.models.llama import causal_attention  # noqa: F401  (the dense forward's attention)
    with torch.no_grad():
        got = native.forward_dense(ids[None])[0]
        ref_model, _, _ = load_native(path, progress=False)
        for m in list(ref_model.modules()):
            if isinstance(m, GGUFLinear):
                m.forward = (lambda self: lambda x: F.linear(x, self.dense_weight(), self.bias))(m)
        want = ref_model.forward_dense(ids[None])[0]
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.max() < 0.1, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_a_file_is_known_by_its_magic_bytes_not_its_name(models, tmp_path):
    blob = tmp_path / "sha256-0123abcd"                  # an Ollama blob: no extension
    blob.write_bytes(models["Q8_0"].read_bytes())
    assert is_gguf_file(blob) and not is_gguf_file(Path(__file__))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    a = LLM(str(blob), kv_memory="8MiB").generate(["def f"], params)[0].token_ids
    b = LLM(str(models["Q8_0"]), kv_memory="8MiB").generate(["def f"], params)[0].token_ids
    assert a == b and len(a) == 5


def test_an_unread_type_is_refused_with_what_to_do(tmp_path):
    import gguf
    path = write_model(tmp_path / "m.gguf", {"*": "Q8_0"})
    data = bytearray(path.read_bytes())
    # retype one matrix to TQ2_0 (a type the kernels do not read) in its tensor info
    at = data.index(b"blk.0.attn_v.weight") + len(b"blk.0.attn_v.weight") + 4 + 16
    assert int.from_bytes(data[at:at + 4], "little") == TYPES["Q8_0"]
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0]
    del per, size
    data[at:at + 4] = int(gguf.GGMLQuantizationType.TQ2_0).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        load_native(bad, progress=False)
    assert str(bad) in str(e.value)


RSS_SCRIPT = textwrap.dedent("""
    import sys
    from llmd.runtime.llm import LLM
    from llmd.runtime.request import SamplingParams
    def anon():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    def file_rss():
        for line in open("/proc/self/status"):
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    llm = LLM(sys.argv[1], kv_memory="4MiB", draft="none")      # kernels built and loaded before measuring
    del llm
    a0, f0 = anon(), file_rss()
    llm = LLM(sys.argv[1], kv_memory="4MiB", draft="none")
    llm.generate(["def f"], SamplingParams(max_tokens=3, ignore_eos=True))
    print(anon() - a0, file_rss() - f0)
""")


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K"])
@pytest.mark.heavy
def test_mapped_pages_are_read_in_place_not_copied(tmp_path, kind):
    """A 35-70 MB file loaded and run. Q6_K is read where it lies: its pages count as the file's
    (shared with the page cache) and anonymous memory grows by a small part of it. Q4_K's matrices
    are copied once into the 8-row layout and their mapped pages handed back: the copy is the
    anonymous memory, the file's pages are not kept beside it."""
    path = write_model(tmp_path / "big.gguf", {"*": kind, "token_embd": "Q8_0"}, hidden=1024, intermediate=4096,
                       layers=4, heads=8, kv_heads=4)
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    anon, mapped = map(int, out.stdout.split()[-2:])
    assert size > 30e6
    if kind == "Q6_K":
        assert anon < 0.15 * size, (anon, size)
        assert mapped > 0.9 * size, (mapped, size)
    else:
        assert 0.8 * size < anon < 1.15 * size, (anon, size)
        assert mapped < 0.2 * size, (mapped, size)


@pytest.fixture(scope="module")
def k_file(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hostile") / "k.gguf", {"*": "Q4_K", "attn_v": "Q6_K"})


def test_hostile_files_fail_typed(k_file, tmp_path):
    from gguf_hostile import hostile
    for name, data in hostile(k_file.read_bytes()).items():
        path = tmp_path / "hostile.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFError) as e:
            load_native(path, progress=False)
        assert str(path) in str(e.value), name


@pytest.fixture(scope="module")
def small_k_file(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("fuzz") / "k.gguf", {"*": "Q4_K", "ffn_down": "Q5_K", "attn_v": "Q3_K"},
                       layers=1, intermediate=256)


@settings(max_examples=int(os.environ.get("LLMD_FUZZ_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_files_serve_or_fail_typed(small_k_file, tmp_path_factory, data):
    """Header mutations, and block bytes anywhere: a typed error or a model that runs (whatever its
    numbers), never a crash."""
    blob = bytearray(small_k_file.read_bytes())
    for _ in range(data.draw(st.integers(1, 6))):
        if not blob:
            break
        kind = data.draw(st.sampled_from(["header", "block", "cut"]))
        if kind == "cut":
            del blob[data.draw(st.integers(0, len(blob) - 1)):]
        else:
            at = data.draw(st.integers(0, min(len(blob), 4096) - 1) if kind == "header"
                           else st.integers(0, len(blob) - 1))
            blob[at] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fz") / "m.gguf"
    path.write_bytes(bytes(blob))
    try:
        model, _, tok = load_native(path, progress=False)
    except ModelLoadError:
        return
    model.prepare_for_inference()
    with torch.no_grad():
        logits = model.forward_dense(torch.tensor([[1, 2, 3]]))[0]
    assert logits.shape[-1] == model.config.vocab_size


def test_block_table_matches_the_gguf_package():
    import gguf
    for name, t in TYPES.items():
        assert BLOCKS[t] == tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]), name
    assert set(BLOCK_TYPES) <= set(TYPES)
