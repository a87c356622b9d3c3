"""Run prompts through a fresh LLM and check that every block came back to the pool."""
from llmd import LLM


def run(model, ps, params, **kw):
    llm = LLM(str(model), **{"kv_memory": "8MiB", **kw})
    outs = llm.generate(ps, params)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], "blocks leaked"
    return [o.token_ids for o in outs], stats
