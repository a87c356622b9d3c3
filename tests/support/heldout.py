"""The benchmark's held-out completion prompts, read once per process: llmd.bench.bench_spec parses every
held-out standard-library file on each call, and its first n prompts are the first n of any longer list
(one shuffle of all the functions, then a slice), so the tests slice one list of MOST."""
import functools

MOST = 200


@functools.lru_cache(maxsize=None)
def _all() -> tuple[str, ...]:
    from llmd.bench.bench_spec import completion_prompts as read
    return tuple(read(MOST))


def completion_prompts(n: int) -> list[str]:
    if n > MOST:
        raise ValueError(f"at most {MOST} held-out prompts are read here, asked for {n}")
    return list(_all()[:n])
