"""The runner contract: what the engine, the speculative proposers, the disk tier and the stats read
from a model runner (llmd.runtime.runner.Runner), and from its ``execution``. Every runner
(``ModelRunner`` on the cpu, reference and compiled backends, ``CudaRunner``) has every member; what a
runner cannot do it says through a capability flag, never through a missing attribute the caller would
have to probe for.

    engine          execute (the base class's, over the primitives below), stats, can_shift
    Runner.execute  copy_slots, copy_shifted (if can_shift), prepare, run / run_greedy (if screens_head),
                    sample (if samples_on_device), execution.greedy
    spec/draft.py   prepare_feeds, run, execution.greedy, execution.greedy_rounds
    kv_tier.py      block_views
"""
from __future__ import annotations

from typing import Optional

from ..runner import Runner

# data members every runner sets (methods are the abstract ones below)
RUNNER_ATTRIBUTES = {
    "model": "the LlamaForCausalLM it runs (its head screen, its weights for the bench)",
    "k_pool": "keys [layers, slots, kv_heads, head_dim]; ``v_pool`` the values, same shape and dtype",
    "v_pool": "values, as ``k_pool``",
    "device": "where the pools and the step's tensors live",
    "execution": "the step's backend: ``greedy``, ``greedy_rounds`` and ``kernels`` (EXECUTION_MEMBERS)",
    "can_shift": "capability: ``copy_shifted`` moves keys to other positions (else it raises)",
    "screens_head": "capability: greedy steps find their tokens through the head's screen (``run_greedy``)",
    "samples_on_device": "capability: ``run``'s logits stay on the device and ``sample`` draws there",
    "step_graphs": "how steps are replayed from captured graphs (None: never), for the stats",
    "proposer": "the speculative proposer ``execute`` asks for proposals (None: the step never speculates)",
}
EXECUTION_MEMBERS = ("greedy", "greedy_rounds", "kernels")


def missing_members(runner) -> list[str]:
    """The contract's names that ``runner`` (an instance) or its ``execution`` lacks."""
    methods = sorted(Runner.__abstractmethods__)
    missing = [m for m in [*methods, *RUNNER_ATTRIBUTES] if not hasattr(runner, m)]
    execution: Optional[object] = getattr(runner, "execution", None)
    if execution is not None:
        missing += [f"execution.{m}" for m in EXECUTION_MEMBERS if not hasattr(execution, m)]
    return missing
