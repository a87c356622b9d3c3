"""The adaptive depth rule, on synthetic measured costs."""
from llmd.runtime.request import Request, SamplingParams
from llmd.runtime.spec.controller import SpecController, expected_tokens


def reqs(n):
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100)) for i in range(n)]


def feed(ctrl, target_cost, draft_cost, b, k_max=4):
    for _ in range(3):                             # a bucket is trusted after three samples
        for k in range(0, k_max + 1):
            ctrl.observe_target(b * (1 + k), target_cost(b * (1 + k)))
        ctrl.observe_draft(b, draft_cost)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(1.0, 3) == 4.0


def test_measures_plain_first_then_explores():
    ctrl = SpecController(4, 2048)
    rs = reqs(1)
    ctrl.plan(rs, 0)
    assert rs[0].spec_k == 0                       # nothing measured: plain decoding, and measure it
    for _ in range(3):
        ctrl.observe_target(1, 0.010)
    ctrl.plan(rs, 0)
    assert rs[0].spec_k >= 2                       # draft cost unknown: speculate (depth >= 2) to measure it
    for _ in range(3):
        ctrl.observe_draft(1, 0.001)
    ctrl.plan(rs, 0)
    assert rs[0].spec_k == 1                       # verification of 2 rows unmeasured: explore depth 1


def test_memory_bound_single_stream_speculates():
    ctrl = SpecController(4, 2048)
    rs = reqs(1)
    for r in rs:
        ctrl.alpha[r.request_id] = 0.8
    feed(ctrl, lambda rows: 0.010 + 0.0002 * rows, 0.001, 1)   # verifying 5 tokens costs ~ one step
    ctrl.plan(rs, 0)
    assert rs[0].spec_k >= 2


def compute_bound_batch():
    """Sixteen streams whose step cost is linear in rows: verification is never free."""
    ctrl = SpecController(4, 2048)
    rs = reqs(16)
    for r in rs:
        ctrl.alpha[r.request_id] = 0.6
    feed(ctrl, lambda rows: 0.0005 * rows, 0.002, 16)
    return ctrl, rs


def test_compute_bound_batch_turns_speculation_off():
    ctrl, rs = compute_bound_batch()
    ctrl.plan(rs, 0)
    assert all(r.spec_k == 0 for r in rs)


def test_an_off_decision_stands_until_the_batch_changes_or_a_probe_is_due():
    ctrl, rs = compute_bound_batch()
    ctrl.plan(rs, 0)
    assert all(r.spec_k == 0 for r in rs)

    def replan(*_):
        raise AssertionError("planned afresh")
    compare, ctrl._best_depth = ctrl._best_depth, replan
    for _ in range(ctrl.probe_every - 1):             # the same sixteen streams: the choice stands
        ctrl.plan(rs, 0)
        assert all(r.spec_k == 0 for r in rs)
    calls = []
    ctrl._best_depth = lambda *a: calls.append(a) or compare(*a)
    ctrl.plan(rs, 0)                                   # a probe is due
    ctrl.plan(rs, 0)                                   # after it: compared afresh, off again
    ctrl.plan(rs, 0)
    assert len(calls) == 2
    other = [Request("new", [1, 2, 3], SamplingParams(max_tokens=100))]
    ctrl.plan(rs[:15] + other, 0)                      # as many streams, one of them new
    ctrl.plan(rs[:15], 0)                              # a stream left
    assert len(calls) == 4


def test_low_acceptance_turns_speculation_off():
    ctrl = SpecController(4, 2048)
    rs = reqs(1)
    ctrl.alpha[rs[0].request_id] = 0.05
    feed(ctrl, lambda rows: 0.010 + 0.0002 * rows, 0.003, 1)
    ctrl.plan(rs, 0)
    assert rs[0].spec_k == 0


def test_depth_capped_by_max_tokens():
    ctrl = SpecController(4, 2048, adaptive=False)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=3))
    r.token_ids.append(9)                          # one output token so far: room for 1 more proposal
    ctrl.plan([r], 0)
    assert r.spec_k == 1


def test_a_probe_after_a_long_pause_speculates_for_one_request_only():
    from llmd.runtime.spec.controller import PROBE_EVERY
    ctrl, rs = compute_bound_batch()
    for _ in range(PROBE_EVERY):
        ctrl.plan(rs, 0)
        assert all(r.spec_k == 0 for r in rs)      # compute-bound: off
    ctrl.plan(rs, 0)
    assert [r.spec_k for r in rs] == [1] + [0] * 15
    ctrl.plan(rs, 0)
    assert all(r.spec_k == 0 for r in rs)          # back off after the probe


def test_probes_that_leave_speculation_off_come_ever_less_often():
    from llmd.runtime.spec.controller import PROBE_EVERY, PROBE_MAX
    ctrl = SpecController(4, 2048)
    rs = reqs(16)
    feed(ctrl, lambda rows: 0.0005 * rows, 0.002, 16)
    probes = []
    for step in range(4 * PROBE_MAX):
        ctrl.plan(rs, 0)
        if any(r.spec_k for r in rs):
            probes.append(step)
        if step % 100 == 0:                        # keep the cost table fresh, as real steps would
            feed(ctrl, lambda rows: 0.0005 * rows, 0.002, 16)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, 8 * PROBE_EVERY + 1, 16 * PROBE_EVERY + 1]
    assert max(gaps) == PROBE_MAX + 1


def test_speculation_that_pays_again_resets_the_probe_interval():
    from llmd.runtime.spec.controller import PROBE_EVERY
    ctrl = SpecController(4, 2048)
    rs = reqs(1)
    ctrl.probe_every = 8 * PROBE_EVERY
    feed(ctrl, lambda rows: 0.010, 0.001, 1)        # memory-bound: verification rows are free
    ctrl.alpha[rs[0].request_id] = 0.9
    ctrl.plan(rs, 0)
    assert rs[0].spec_k > 0 and ctrl.probe_every == PROBE_EVERY


def test_a_bucket_never_costs_more_than_a_larger_one():
    from llmd.runtime.spec.controller import CostTable
    t = CostTable()
    for _ in range(3):
        t.observe(1, 0.0044)          # one-row steps caught at a bad moment
        t.observe(3, 0.0029)
        t.observe(40, 0.0100)
    assert t.estimate(1) == 0.0029 and t.estimate(3) == 0.0029 and t.estimate(40) == 0.0100
    assert t.estimate(200) is None    # nothing measured there yet


def test_the_benchmark_reads_acceptance_back_from_accepted_tokens_per_step():
    from llmd.bench.bench_spec import alpha_from_accepted
    for a in (0.0, 0.3, 0.7, 0.95):
        assert abs(alpha_from_accepted(expected_tokens(a, 4) - 1, 4) - a) < 1e-9
    assert alpha_from_accepted(4.0, 4) >= 0.998            # every proposal accepted (E saturates at 0.999)


def test_an_off_decision_is_replanned_when_a_step_cost_bucket_or_a_request_changes():
    ctrl, rs = compute_bound_batch()
    ctrl.plan(rs, 0)
    assert all(r.spec_k == 0 for r in rs)
    calls = []
    compare = ctrl._best_depth
    ctrl._best_depth = lambda *a: calls.append(a) or compare(*a)
    ctrl.plan(rs, 0)
    assert calls == []                          # unchanged: the choice stands
    ctrl.plan(rs, 40)                           # 16 + 40 rows: the plain step moved from bucket 16-31 to 32-63
    assert len(calls) == 1
    ctrl.plan(rs, 40)
    ctrl.forget(rs[0].request_id)               # a finished request's id may return: plan afresh
    ctrl.plan(rs, 40)
    assert len(calls) == 2


def test_measured_whole_steps_overrule_a_model_that_predicts_a_gain():
    """The cost model says speculating pays (memory-bound verification), but whole decode steps
    measured otherwise: speculation goes off, with a speculating step now and then (CHECK_EVERY steps,
    then twice as many each time) so that the measure stays current; and where speculating steps are
    faster, one in CHECK_EVERY is plain."""
    from llmd.runtime.spec.controller import CHECK_EVERY
    ctrl = SpecController(4, 2048, proposer_is_free=True)
    rs = reqs(1)
    ctrl.alpha[rs[0].request_id] = 0.8
    feed(ctrl, lambda rows: 0.010 + 0.0002 * rows, 0.0, 1)
    for _ in range(8):
        ctrl.rates.observe(1, 1, 0.010, speculated=False)        # 10 ms a token plain
        ctrl.rates.observe(1, 2, 0.030, speculated=True)         # 15 ms a token speculating
    ks = []
    for _ in range(7 * CHECK_EVERY):
        ctrl.plan(rs, 0)
        ks.append(rs[0].spec_k)
    # the measuring steps only, each wait twice the last while it keeps measuring slower
    assert [i for i, k in enumerate(ks) if k] == [CHECK_EVERY - 1, 3 * CHECK_EVERY - 1, 7 * CHECK_EVERY - 1]
    for _ in range(32):
        ctrl.rates.observe(1, 3, 0.012, speculated=True)         # now 4 ms a token: it pays
    ks = []
    for _ in range(2 * CHECK_EVERY):
        ctrl.plan(rs, 0)
        ks.append(rs[0].spec_k)
    assert sum(k == 0 for k in ks) == 2


def test_greedy_only_leaves_sampled_requests_out_and_plans_them_as_plain_rows():
    ctrl = SpecController(4, 2048, greedy_only=True)
    rs = reqs(2)
    rs[1].params = SamplingParams(max_tokens=100, temperature=0.8, seed=1)
    for r in rs:
        ctrl.alpha[r.request_id] = 0.8
    cost = lambda rows: 0.010 + 0.0002 * rows          # noqa: E731
    feed(ctrl, cost, 0.001, 1)
    for _ in range(3):                                 # steps of the greedy one beside the sampled one
        ctrl.observe_target(2, cost(2))
    ctrl.plan(rs, 0)
    assert rs[0].spec_k >= 2 and rs[1].spec_k == 0
