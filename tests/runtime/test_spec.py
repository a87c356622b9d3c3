"""Speculative decoding never changes greedy output, trims both caches, and leaks nothing."""
import random

import pytest

from engine_run import run as run_engine
from llmd import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


@pytest.fixture(scope="module")
def drafts(model_factory, tiny_model_dir):
    return {
        "same": str(tiny_model_dir),                                               # accepts everything
        "other": str(model_factory("draft-other", seed=7, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)),
        "ngram": "ngram",
    }


def prompts(n=8, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(20, 400) for _ in range(rng.randrange(3, 8))]
        out.append((motif * 12)[:rng.randrange(8, 70)])          # repetitive: n-gram lookup finds matches
    return out


def run(model, ps, params=GREEDY, **kw):
    return run_engine(model, ps, params, **kw)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return run(tiny_model_dir, prompts())[0]


@pytest.mark.parametrize("which", ["same", "other", "ngram"])
@pytest.mark.parametrize("mode", ["batch", "chunked", "preempt", "alone"])
def test_greedy_identical_with_speculation(tiny_model_dir, drafts, plain, which, mode):
    kw = dict(draft=drafts[which], num_speculative_tokens=4, adaptive_speculation=False)
    ps = prompts()
    if mode == "chunked":
        kw["max_batch_tokens"] = 16
    if mode == "preempt":
        kw["kv_memory"] = 96 * 2 * 2 * 32 * 4 * (2 if which != "ngram" else 1)
    if mode == "alone":
        got = [run(tiny_model_dir, [p], **kw)[0][0] for p in ps[:3]]
        assert got == plain[:3]
        return
    got, st = run(tiny_model_dir, ps, **kw)
    assert got == plain
    assert st["spec_proposed"] > 0
    if mode == "preempt":
        assert st["preemptions"] > 0
    if which == "same":
        assert st["spec_acceptance_rate"] == 1.0
    if which == "other":
        assert st["spec_acceptance_rate"] < 1.0


def test_adaptive_greedy_identical(tiny_model_dir, drafts, plain):
    got, st = run(tiny_model_dir, prompts(), draft=drafts["other"], num_speculative_tokens=4)
    assert got == plain
    assert st["spec_proposed"] > 0, "the controller never speculated: nothing was checked"


def test_metrics_per_request(tiny_model_dir, drafts):
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", draft=drafts["same"], num_speculative_tokens=3,
              adaptive_speculation=False)
    out = llm.generate([[30, 31, 32]], SamplingParams(max_tokens=17, ignore_eos=True))[0]
    m = out.metrics
    # 1 token from the prompt step, then 4 per step (3 accepted + bonus): 4 verification steps
    assert m["spec_proposed"] == 12 and m["spec_accepted"] == 12
    assert m["spec_acceptance"] == 1.0 and m["spec_mean_accepted_len"] == 3.0
    assert len(out.token_ids) == 17


def test_rollback_trims_blocks(tiny_model_dir, drafts):
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", block_size=4, draft=drafts["other"],
              num_speculative_tokens=6, adaptive_speculation=False)
    e = llm.engine
    e.add_request("r", list(range(30, 39)), SamplingParams(max_tokens=40, ignore_eos=True))
    while e.has_unfinished():
        e.step()
        r = e.scheduler.requests.get("r")
        if r is not None:
            # after each step: blocks cover the computed tokens and no speculative tail beyond the verified ones
            assert -(-r.num_computed_tokens // 4) <= len(r.block_ids) <= -(-r.num_tokens // 4)
            assert r.num_computed_tokens == r.num_tokens - 1
            assert r.spec_token_ids == []
    st = e.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["spec_proposed"] > st["spec_accepted"]


def test_draft_with_other_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from llmd.runtime.errors import ModelLoadError
    from llmd.runtime.models.random_model import write_random_model
    other = write_random_model(tmp_path / "bytes", "tiny", hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, vocab_size=512)
    with pytest.raises(ModelLoadError, match="draft's tokenizer differs"):
        LLM(str(tiny_model_dir), draft=str(other))


def test_ngram_keeps_copying_the_passage_it_was_copying():
    """An output copying its prompt meets an n-gram that occurs twice there: the lookup's latest
    occurrence is the wrong passage, the continuation of the one being copied is right."""
    from llmd.runtime.request import Request
    from llmd.runtime.spec.ngram import NgramProposer
    prompt = [7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 6]
    req = Request("r", prompt + [7, 1], SamplingParams(max_tokens=20))
    ng = NgramProposer(n=3, min_n=2)
    assert ng.propose([(req, 4)])[0].token_ids == [2, 3, 4, 8]       # "7 1" occurs once: copy from there
    req.token_ids.extend([2, 3])                                     # two accepted, the copy goes on
    assert ng.propose([(req, 4)])[0].token_ids == [4, 8, 1, 2]       # not [5, 6, 7, 1] after "1 2 3"
    req.token_ids.extend([9])                                        # the output leaves the passage
    assert ng.propose([(req, 4)])[0].token_ids == []                 # "2 3 9" / "3 9" occur nowhere


def test_ngram_guesses_from_the_last_token_alone_briefly():
    """No 2- or 3-gram match: the latest earlier occurrence of the last token proposes at most
    weak_k tokens (a short guess, cheap to verify); weak_k=0 proposes nothing."""
    from llmd.runtime.request import Request
    from llmd.runtime.spec.ngram import NgramProposer
    req = Request("r", [5, 1, 2, 3, 4, 6, 7, 5, 9, 8, 9, 3], SamplingParams(max_tokens=20))
    weak = NgramProposer(n=3, min_n=2, weak_k=3).propose([(req, 8)])[0]
    assert weak.token_ids == [4, 6, 7] and weak.guess     # a guess: kept out of the controller's acceptance
    other = Request("o", [1, 2, 3], SamplingParams(max_tokens=20))
    beside = NgramProposer(n=3, min_n=2, weak_k=3).propose([(req, 8), (other, 8)])[0]
    assert beside.token_ids == []                         # with another stream its rows are not free
    assert NgramProposer(n=3, min_n=2, weak_k=0).propose([(req, 8)])[0].token_ids == []
    req.token_ids.extend([4])                       # "3 4" occurs: a real match proposes the full k
    strong = NgramProposer(n=3, min_n=2, weak_k=3).propose([(req, 8)])[0]
    assert strong.token_ids == [6, 7, 5, 9, 8, 9, 3, 4] and not strong.guess
    short = Request("s", [5, 5], SamplingParams(max_tokens=20))    # fewer tokens than n: shorter n-grams still tried
    assert NgramProposer(n=3, min_n=2, weak_k=3).propose([(short, 4)])[0].token_ids == [5]


def test_a_draft_with_a_shorter_context_stops_proposing_where_it_ends(tiny_model_dir, model_factory):
    """The draft's rotary tables end at 48 positions; requests run past them with the same greedy
    output (speculation stops for them instead of failing the batch)."""
    short = model_factory("draft-short", seed=7, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_pos=48)
    ps = [p for p in prompts(12, seed=3) if len(p) >= 30][:3]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = run(tiny_model_dir, ps, params)[0]
    got, st = run(tiny_model_dir, ps, params, draft=str(short), num_speculative_tokens=4, adaptive_speculation=False)
    assert got == want
    assert st["spec_proposed"] > 0


def test_auto_speculates_greedy_requests_only_and_leaves_seeded_samples_as_they_were(tiny_model_dir):
    """draft="auto" (the daemon's default) with no draft model: n-gram lookup for greedy requests;
    a seeded sampled request beside them gives the text it gives with no speculation at all."""
    ps = prompts(6, seed=5)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=11)
    mixed = [greedy, sampled] * 3
    want, _ = run(tiny_model_dir, ps, mixed)
    # a fixed depth: adaptive speculation picks it from measured step times, which would make whether
    # anything is proposed depend on this machine's timing
    fixed = dict(draft="auto", adaptive_speculation=False)
    got, st = run(tiny_model_dir, ps, mixed, **fixed)
    assert got == want
    assert st["spec_proposed"] > 0                             # the greedy ones speculated
    alone, st = run(tiny_model_dir, ps[1:2], sampled, **fixed)
    assert alone == [want[1]] and st["spec_proposed"] == 0     # a sampled request alone never does


def test_the_default_depth_follows_the_proposer(tiny_model_dir, drafts):
    assert LLM(str(tiny_model_dir), draft="ngram", kv_memory="8MiB").engine.num_speculative_tokens == 8
    assert LLM(str(tiny_model_dir), draft=drafts["other"], kv_memory="8MiB").engine.num_speculative_tokens == 6
    assert LLM(str(tiny_model_dir), draft="auto", kv_memory="8MiB").engine.num_speculative_tokens == 8
    assert LLM(str(tiny_model_dir), draft="ngram", num_speculative_tokens=3, kv_memory="8MiB").engine.num_speculative_tokens == 3


def test_proposal_slots_are_dropped_before_a_request_is_ended_for_want_of_blocks(tiny_model_dir):
    """A pool of two 4-token blocks ends a long answer when it is full; asking for 4 proposal slots on top
    must not end it sooner: the proposals go, the tokens stay."""
    prompt, p = [5, 6, 5, 6, 5], SamplingParams(max_tokens=10, ignore_eos=True)
    small = dict(kv_memory=8 * 512, block_size=4)
    plain = LLM(str(tiny_model_dir), **small).generate([prompt], p)[0]
    spec = LLM(str(tiny_model_dir), **small, draft="ngram", num_speculative_tokens=4, adaptive_speculation=False)
    assert spec.engine.block_manager.num_blocks == 2
    got = spec.generate([prompt], p)[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) >= 3
    assert (got.token_ids, got.finish_reason) == (plain.token_ids, "length")


def test_a_seeded_sampled_request_gives_its_seeds_text_with_a_draft_alone_or_in_a_batch(tiny_model_dir, drafts):
    """Speculation keeps a sampled request's distribution, but which text a seed gives would follow how
    deep each step speculated (which follows the batch): a request with its own seed does not speculate,
    so its text is the seed's text with or without a draft, alone or beside others."""
    ps = prompts()
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    want = run(tiny_model_dir, ps[:1], seeded)[0][0]
    kw = dict(draft=drafts["same"], num_speculative_tokens=4)
    assert run(tiny_model_dir, ps[:1], seeded, **kw)[0][0] == want
    mixed = [seeded] + [SamplingParams(max_tokens=24, ignore_eos=True)] * 5
    llm = LLM(str(tiny_model_dir), kv_memory="8MiB", **kw)
    outs = llm.generate(ps[:6], mixed)
    assert outs[0].token_ids == want
    assert llm.stats()["spec_proposed"] > 0           # the greedy neighbours did speculate
