"""Shifted reuse: after an edit, the keys and values of the text after it are moved to their new
positions (keys rotated) instead of computed again. Approximate by design; what is exact is tested
exactly: the rotation itself, the bookkeeping (which run, how stale), that exact requests never read
approximate blocks, and that chunking does not change a shifted request's output."""
from pathlib import Path

import pytest
import torch

from llmd import LLM
from llmd.clients.client import Client
from llmd.runtime.block_manager import BlockManager
from llmd.runtime.block_reuse import SHIFT_MIN_RUN
from llmd.runtime.model_runner import rotate_keys
from llmd.runtime.models.config import RopeScaling
from llmd.runtime.models.layers import Rotary, apply_rotary
from llmd.runtime.request import Request, SamplingParams

from daemon_fixtures import daemon_settings, running_daemon

TARGET = Path(__file__).resolve().parents[2] / "models" / "code-target"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, prompt_only=True)
PREFIX = "import os\n\ndef walk(root):\n    out = []\n    for name in os.listdir(root):\n        path = os.path.join(root, name)\n        "
SUFFIX = ("\n        if os.path.isdir(path):\n            out.extend(walk(path))\n    return out\n\n\n"
          "def main():\n    for item in walk('.'):\n        print(item)\n")


@pytest.mark.parametrize("adjacent", [False, True])
@pytest.mark.parametrize("scaling", [RopeScaling(), RopeScaling("llama3", 8.0, 1.0, 4.0, 64)])
def test_rotating_a_key_by_delta_is_the_key_at_the_later_position(adjacent, scaling):
    d, p, delta = 64, 37, 113
    rot = Rotary(d, 512, 10000.0, scaling)
    k = torch.randn(3, 5, 2, d, generator=torch.Generator().manual_seed(0))   # [layers, tokens, heads, D]

    def at(pos):
        cos, sin = rot.cos[pos], rot.sin[pos]
        if adjacent:
            pairs = k.unflatten(-1, (d // 2, 2))
            c = torch.complex(pairs[..., 0], pairs[..., 1]) * torch.complex(cos, sin)
            return torch.stack((c.real, c.imag), -1).flatten(-2)
        return apply_rotary(k, cos, sin)

    for shift in (delta, -p):
        moved = rotate_keys(at(p), shift, rot.inv_freq, adjacent)
        assert torch.allclose(moved, at(p + shift), atol=2e-4), (moved - at(p + shift)).abs().max()


def _req(rid, tokens, key="doc"):
    return Request(rid, list(tokens), SamplingParams(), reuse_key=key)


def _finish(bm, r):
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r, r.num_tokens)
    bm.free_request(r)


def test_the_run_after_an_edit_is_found_with_its_staleness():
    bm = BlockManager(64, 4)
    bm.max_stale = 8
    head, tail = list(range(100, 111)), list(range(200, 220))
    old = _req("a", head + [1] + tail)
    bm.allocate(old, bm.lookup_prefix(old), old.num_tokens)
    _finish(bm, old)
    new = _req("b", head + [1, 2, 3] + tail)              # two tokens typed after the shared head
    hit = bm.lookup_prefix(new)
    assert hit.num_tokens == len(head) + 1
    s = hit.shift
    assert (s.start, s.src_start, s.length, s.stale) == (len(head) + 3, len(head) + 1, len(tail) - 1, 2)
    other = _req("c", head + [1, 2, 3] + tail, key="other")   # another key never sees it
    assert bm.lookup_prefix(other).shift is None


def test_a_run_that_missed_too_much_or_was_overwritten_is_not_taken():
    bm = BlockManager(16, 4)
    bm.max_stale = 3
    head, tail = list(range(100, 108)), list(range(200, 220))
    old = _req("a", head + tail)
    bm.allocate(old, bm.lookup_prefix(old), old.num_tokens)
    _finish(bm, old)
    assert bm.lookup_prefix(_req("b", head + [1, 2, 3] + tail)).shift.stale == 3
    assert bm.lookup_prefix(_req("b", head + [1, 2, 3, 4] + tail)).shift is None     # 4 > max_stale
    filler = Request("f", list(range(500, 564)), SamplingParams())                    # takes every block
    bm.allocate(filler, bm.lookup_prefix(filler), filler.num_tokens)
    bm.free_request(filler)
    assert bm.lookup_prefix(_req("b", head + [1] + tail)).shift is None               # its blocks were reused


@pytest.fixture(scope="module")
def engines():
    shift = LLM(str(TARGET), kv_memory="8MiB", block_size=16, draft="none")
    exact = LLM(str(TARGET), kv_memory="8MiB", prefix_cache=False, draft="none")
    return shift, exact


@pytest.fixture
def llm(engines):
    engines[0].engine.block_manager.reset_prefix_cache()
    return engines[0]


def fim(llm, prefix):
    return llm.tokenizer.build_infill(prefix, SUFFIX, [], "psm")


def test_a_keystroke_computes_only_the_typed_tokens_and_exact_requests_stay_exact(llm, engines):
    exact = engines[1]
    first = llm.generate(fim(llm, PREFIX), PREFILL, reuse_key="doc")[0]
    assert first.metrics["shifted_tokens"] == 0
    typed = llm.generate(fim(llm, PREFIX + "o"), GREEDY, reuse_key="doc")[0]
    n = typed.metrics["prompt_tokens"]
    suffix_tokens = len(llm.tokenizer.encode(SUFFIX))
    assert typed.metrics["shifted_tokens"] >= suffix_tokens - 2
    assert n - typed.metrics["cached_tokens"] <= 4          # the typed token, the marker after the run
    # the same prompt without the key: blocks from the first approximate position were never keyed,
    # so it computes them and answers exactly as an engine without any cache
    plain = llm.generate(fim(llm, PREFIX + "o"), GREEDY)[0]
    assert plain.metrics["shifted_tokens"] == 0
    assert plain.metrics["cached_tokens"] < n - suffix_tokens
    assert plain.token_ids == exact.generate(fim(llm, PREFIX + "o"), GREEDY)[0].token_ids
    assert llm.stats()["shift_tokens"] >= typed.metrics["shifted_tokens"]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_staleness_adds_up_over_edits_until_the_text_is_computed_again(llm):
    limit = llm.engine.block_manager.max_stale
    llm.generate(fim(llm, PREFIX), PREFILL, reuse_key="doc")
    typed, shifted = "", []
    for word in ["out", ".append", "(path", ")", "  # keep", " it", " for", " later"] * 3:
        typed += word
        out = llm.generate(fim(llm, PREFIX + typed), PREFILL, reuse_key="doc")[0]
        shifted.append(out.metrics["shifted_tokens"])
        if not shifted[-1]:
            break
    tokens_typed = len(llm.tokenizer.encode(typed))
    assert shifted[0] > 0 and shifted[-1] == 0 and tokens_typed > limit / 2
    again = llm.generate(fim(llm, PREFIX + typed + "x"), PREFILL, reuse_key="doc")[0]
    assert again.metrics["shifted_tokens"] > 0       # the recomputed text is fresh again


def test_chunking_does_not_change_a_shifted_requests_output(llm):
    small = LLM(str(TARGET), kv_memory="8MiB", block_size=16, draft="none", max_batch_tokens=5)
    outs = []
    for engine in (llm, small):
        engine.generate(fim(engine, PREFIX), PREFILL, reuse_key="doc")
        out = engine.generate(fim(engine, PREFIX + "out.app"), GREEDY, reuse_key="doc")[0]
        assert out.metrics["shifted_tokens"] > 0
        outs.append(out.token_ids)
    assert outs[0] == outs[1]


def test_off_when_the_daemon_setting_is_zero():
    off = LLM(str(TARGET), kv_memory="8MiB", block_size=16, draft="none", shift_max_stale=0)
    off.generate(fim(off, PREFIX), PREFILL, reuse_key="doc")
    assert off.generate(fim(off, PREFIX + "o"), GREEDY, reuse_key="doc")[0].metrics["shifted_tokens"] == 0


@pytest.mark.heavy
def test_the_daemon_shifts_only_infills_that_ask_under_their_replace_key(tiny_model_dir, tmp_path):
    prefix = "def area(r):\n    return "
    suffix = "\n\n" + "".join(f"print(area({i}))\n" for i in range(12))
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path, draft="none")) as server:
        with Client(server.settings.socket) as c:
            def usage(text, **kw):
                s = c.infill(text, suffix, max_tokens=2, **kw)
                s.text()
                return s.final.usage
            usage(prefix, replace="doc", shift_reuse=True, prompt_only=True)
            u = usage(prefix + "3", replace="doc", shift_reuse=True)
            assert u["shifted_tokens"] >= SHIFT_MIN_RUN
            assert u["prompt_tokens"] - u["cached_tokens"] <= 4
            usage(prefix + "31", replace="doc2")
            assert usage(prefix + "314", replace="doc2")["shifted_tokens"] == 0      # not asked
