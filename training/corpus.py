"""The demo models' training text: the Python standard library's own sources.

Every machine that runs llmd has this text, so the bundled target and draft can be rebuilt anywhere
without a download. Files are split into train and held-out sets by a stable hash of their path
relative to the stdlib root, so the split does not depend on the machine, the file order or a seed.

Training samples are built per file chunk; about half are rearranged for fill-in-the-middle in the
prefix-suffix-middle order real coder models use:

    <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle <|endoftext|>
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EOT = "<|endoftext|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
FIM_PAD, FILE_SEP, REPO_NAME = "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"
SPECIAL_TOKENS = (EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_PAD, FILE_SEP, REPO_NAME)
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    rel: str          # path relative to the corpus root, '/'-separated: the split key
    path: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """Every .py file under root except installed packages, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(SourceFile(rel.as_posix(), p))
    return sorted(out, key=lambda f: f.rel)


def is_heldout(rel: str, fraction: float = 0.05) -> bool:
    """Stable: the first 8 bytes of sha256(path) decide, so every machine splits alike."""
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


def split(files: list[SourceFile], fraction: float = 0.05) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.rel, fraction)]
    held = [f for f in files if is_heldout(f.rel, fraction)]
    return train, held


def read_source(f: SourceFile) -> str:
    """Undecodable bytes are dropped (a few test files hold deliberately broken encodings).
    Special-token spellings inside the sources are left alone: they are tokenized as text."""
    return f.path.read_bytes().decode("utf-8", errors="ignore")


def chunks(text: str, max_chars: int, rng: random.Random | None = None, min_chars: int | None = None
           ) -> Iterator[str]:
    """Line-aligned pieces of at most about max_chars characters; with ``rng`` and ``min_chars`` each
    piece's limit is drawn from [min_chars, max_chars], so pieces of every length occur."""
    def limit() -> int:
        return max_chars if rng is None or min_chars is None else rng.randint(min_chars, max_chars)
    lines = text.splitlines(keepends=True)
    buf, n, cap = [], 0, limit()
    for line in lines:
        if n and n + len(line) > cap:
            yield "".join(buf)
            buf, n, cap = [], 0, limit()
        buf.append(line)
        n += len(line)
    if buf:
        yield "".join(buf)


def fim_rearrange(text: str, rng: random.Random) -> tuple[str, str, str]:
    """Cut text into (prefix, middle, suffix).

    Half the cuts are at two random character positions (any span, as an editor cursor may sit
    mid-token); the other half take 1 to 4 whole lines as the middle, the shape of a completion
    that fills in a statement or two. Line spans teach the model to end a middle where the suffix
    takes over, which random character cuts rarely show a small model."""
    if rng.random() < 0.5:
        a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        return text[:a], text[a:b], text[b:]
    lines = text.splitlines(keepends=True)
    first = rng.randrange(len(lines))
    last = min(len(lines), first + rng.randint(1, 4))
    return "".join(lines[:first]), "".join(lines[first:last]), "".join(lines[last:])


@dataclass(frozen=True)
class Piece:
    """One training document: ordinary text pieces and control tokens, in order.

    Text and control tokens stay separate so that a control-token spelling inside the sources can
    never become a control token."""
    parts: tuple[tuple[bool, str], ...]    # (is_control_token, text)


def make_pieces(files: list[SourceFile], seed: int, fim_rate: float = 0.5,
                max_chars: int = 1700, min_chars: int = 300) -> Iterator[Piece]:
    """Documents for training or evaluation, deterministic for a seed and file list.

    Chunks of 300 to 1,700 characters (under ~512 tokens) fit whole in one training window, so a
    fill-in-the-middle sample is trained with its prefix and suffix in view; the spread of lengths
    lets the windows pack tightly."""
    rng = random.Random(seed)
    for f in files:
        for chunk in chunks(read_source(f), max_chars, rng, min_chars):
            if not chunk.strip():
                continue
            if rng.random() < fim_rate:
                pre, mid, suf = fim_rearrange(chunk, rng)
                parts = ((True, FIM_PREFIX), (False, pre), (True, FIM_SUFFIX), (False, suf),
                         (True, FIM_MIDDLE), (False, mid), (True, EOT))
            else:
                parts = ((False, chunk), (True, EOT))
            yield Piece(tuple(p for p in parts if p[1]))
