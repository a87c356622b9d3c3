"""Directories written whole: built beside their destination, renamed into place once complete.

A failure, a failed check or Ctrl-C part way leaves the destination as it was (and no half-written
directory behind)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def write_whole(final: Path, write: Callable[[Path], T]) -> T:
    """Call ``write(tmp)`` on a fresh sibling directory of ``final``; on success it replaces ``final``."""
    final = Path(final)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return result
