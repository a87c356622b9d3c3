"""llmd: a local low-latency LLM inference daemon.

`from llmd import LLM, SamplingParams` loads the runtime (and torch) on first use only, so that
`import llmd.clients` stays light.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Priority", "__version__"]


def __getattr__(name):
    if name == "LLM":
        from llmd.runtime.llm import LLM
        return LLM
    if name in ("SamplingParams", "Priority"):
        from llmd.runtime import request
        return getattr(request, name)
    raise AttributeError(f"module 'llmd' has no attribute {name!r}")
