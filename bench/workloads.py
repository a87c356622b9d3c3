"""Benchmark workloads: seeded request lists that anyone can rebuild bit for bit.

A workload is a tuple of requests, each with its prompt as token ids (so every engine under test
receives exactly the same tokens), its output length and its arrival time in seconds from the start.

    completion  keystroke-driven fill-in-the-middle over held-out stdlib files: each session types
                through one file, so consecutive prompts share the file's head as an exact prefix
    voice       short chat turns under one system prompt, history growing per conversation
    edit        rewrite a code snippet: the answer copies most of the prompt
    batch       long offline prompts (summarise a file), all present at the start
    mixed       voice, completion and batch requests together, Poisson arrivals at `rate` per second
    stamped     voice turns whose prompts open with a timestamp, before the stable system prompt:
                the layout that defeats prefix caching (doctor's example of a failure)

Text comes from the held-out split of export/corpus.py, so a trained demo model has not seen it.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, replace

from llmd.training.corpus import list_sources, read_source, split

WORKLOADS = ("completion", "voice", "edit", "batch", "mixed", "stamped")

SYSTEM = ("You are a voice assistant running on this computer. Answer in one or two short sentences, "
          "plainly, without lists or markup. If you are unsure, say so briefly.")
QUESTIONS = ("what time is sunset today", "set a timer for ten minutes", "how do I undo a git commit",
             "what is the capital of Australia", "turn the lights down a little", "remind me to call Sam at five",
             "how many grams in an ounce", "what's a quick dinner with eggs", "spell necessary",
             "is it going to rain tomorrow", "play something calm", "what does idempotent mean")
RENAMES = (("data", "payload"), ("result", "outcome"), ("self", "this"), ("name", "label"), ("value", "item"))


@dataclass(frozen=True)
class Scale:
    """Sizes of one build. `short` keeps a test run to seconds on the tiny model."""
    requests: int = 24            # requests per workload (mixed: in total)
    prompt_chars: int = 1024      # longest prompt text, in characters (a byte tokenizer: about tokens)
    max_tokens: int = 64          # longest answer
    sessions: int = 3             # completion sessions / voice conversations
    pace: float = 1.0             # multiplies every arrival time (short runs compress the pauses)

    @classmethod
    def named(cls, name: str) -> "Scale":
        return {"short": cls(requests=4, prompt_chars=160, max_tokens=8, sessions=2, pace=0.1), "full": cls()}[name]


@dataclass(frozen=True)
class WorkRequest:
    rid: str
    kind: str                     # the workload it came from (mixed keeps its parts' kinds)
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: tuple[WorkRequest, ...]


def build(name: str, tokenizer, *, seed: int = 0, scale: Scale = Scale(), rate: float = 4.0) -> Workload:
    """The requests of workload `name`, identical for equal (tokenizer, seed, scale, rate)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"{name}:{seed}")
    if name == "mixed":
        reqs = _mixed(tokenizer, rng, seed, scale, rate)
    else:
        reqs = _BUILDERS[name](tokenizer, rng, scale)
    reqs = [replace(r, arrival_s=round(r.arrival_s * scale.pace, 4)) for r in reqs]
    return Workload(name, seed, tuple(sorted(reqs, key=lambda r: (r.arrival_s, r.rid))))


def heldout_texts(rng: random.Random, count: int, min_chars: int) -> list[tuple[str, str]]:
    """(relative path, text) of `count` held-out stdlib files of at least `min_chars`, chosen by rng."""
    held = [f for f in _heldout_files() if f.path.stat().st_size >= min_chars]
    return [(f.rel, read_source(f)) for f in rng.sample(held, min(count, len(held)))]


@functools.lru_cache(maxsize=1)
def _heldout_files() -> tuple:
    return tuple(split(list_sources())[1])


def _completion(tok, rng, scale: Scale) -> list[WorkRequest]:
    out = []
    per = max(1, scale.requests // scale.sessions)
    window = scale.prompt_chars * 2 // 3
    for s, (rel, text) in enumerate(heldout_texts(rng, scale.sessions, 4 * scale.prompt_chars)):
        start = _line_start(text, rng.randrange(0, len(text) - 2 * scale.prompt_chars))
        cursor, t = start + window // 2, rng.uniform(0, 1)
        for k in range(per):
            cursor += rng.randint(1, 6)                      # a few keystrokes since the last request
            prefix, suffix = text[start:cursor], text[cursor:cursor + window // 3]
            out.append(WorkRequest(f"completion-{s}-{k}", "completion", _infill(tok, prefix, suffix),
                                   max(1, scale.max_tokens // 2), round(t, 4)))
            t += rng.uniform(0.15, 0.6)                      # typing pauses
    return out


def _infill(tok, prefix: str, suffix: str) -> tuple[int, ...]:
    try:
        return tuple(tok.build_infill(prefix, suffix))
    except Exception:                                        # a model without FIM tokens: plain completion
        return tuple(tok.encode(prefix))


def _voice(tok, rng, scale: Scale, stamped: bool = False, kind: str = "voice") -> list[WorkRequest]:
    out = []
    per = max(1, scale.requests // scale.sessions)
    for s in range(scale.sessions):
        history: list[dict] = []
        t = rng.uniform(0, 1)
        for k in range(per):
            history.append({"role": "user", "content": rng.choice(QUESTIONS)})
            system = SYSTEM
            if stamped:
                system = f"[{_timestamp(rng, t)}]\n{SYSTEM}"
            ids = _chat(tok, [{"role": "system", "content": system}] + history)
            out.append(WorkRequest(f"{kind}-{s}-{k}", kind, ids, max(1, scale.max_tokens * 3 // 4), round(t, 4)))
            history.append({"role": "assistant", "content": "Sure. " + rng.choice(QUESTIONS).capitalize() + "."})
            t += rng.uniform(1.0, 3.0)                       # the user listens, then speaks again
    return out


def _stamped(tok, rng, scale: Scale) -> list[WorkRequest]:
    return _voice(tok, rng, scale, stamped=True, kind="stamped")


def _timestamp(rng: random.Random, t: float) -> str:
    sec = 9 * 3600 + 26 * 60 + t + rng.random()
    return f"2025-03-14 {int(sec) // 3600:02d}:{int(sec) // 60 % 60:02d}:{sec % 60:06.3f}"


def _chat(tok, messages: list[dict]) -> tuple[int, ...]:
    try:
        return tuple(tok.encode_chat(messages))
    except Exception:
        return tuple(tok.encode("\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"))


def _edit(tok, rng, scale: Scale) -> list[WorkRequest]:
    out = []
    t = 0.0
    files = heldout_texts(rng, scale.requests, 2 * scale.prompt_chars)
    for k, (rel, text) in enumerate(files):
        start = _line_start(text, rng.randrange(0, len(text) - scale.prompt_chars))
        snippet = text[start:start + scale.prompt_chars // 2]
        old, new = rng.choice(RENAMES)
        prompt = f"Rename `{old}` to `{new}` in this code from {rel} and return the whole code.\n```python\n" \
                 f"{snippet}\n```\n```python\n"
        out.append(WorkRequest(f"edit-{k}", "edit", tuple(tok.encode(prompt)), scale.max_tokens, round(t, 4)))
        t += rng.uniform(0.5, 2.0)
    return out


def _batch(tok, rng, scale: Scale) -> list[WorkRequest]:
    out = []
    for k, (rel, text) in enumerate(heldout_texts(rng, scale.requests, 2 * scale.prompt_chars)):
        start = _line_start(text, rng.randrange(0, len(text) - scale.prompt_chars))
        body = text[start:start + scale.prompt_chars - 64]
        prompt = f"Summarise what this part of {rel} does.\n\n{body}\n\nSummary:"
        out.append(WorkRequest(f"batch-{k}", "batch", tuple(tok.encode(prompt)), scale.max_tokens, 0.0))
    return out


def _mixed(tok, rng, seed: int, scale: Scale, rate: float) -> list[WorkRequest]:
    """Interleave the voice, completion and batch pools, re-timed as one Poisson process."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    third = replace(scale, requests=max(1, scale.requests // 3))
    pools = [list(build(k, tok, seed=seed, scale=replace(third, pace=1.0)).requests) for k in ("voice", "completion", "batch")]
    out, t = [], 0.0
    while any(pools):
        pool = rng.choice([p for p in pools if p])
        t += rng.expovariate(rate)
        r = pool.pop(0)
        out.append(replace(r, rid=f"mixed-{r.rid}", arrival_s=round(t, 4)))
    return out


def _line_start(text: str, pos: int) -> int:
    nl = text.rfind("\n", 0, pos)
    return nl + 1


_BUILDERS = {"completion": _completion, "voice": _voice, "edit": _edit, "batch": _batch, "stamped": _stamped}
