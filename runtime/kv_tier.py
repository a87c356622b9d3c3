"""DiskTier: the engine's side of the KV tier on disk (llmd.runtime.kv_disk holds the files).

    evicted full block ──copy (engine thread)──▶ write queue ──I/O thread──▶ <dir>/<name>.kv
    full cached blocks when the engine goes idle ──────┘   (a full queue drops the write)

    add_request: the prompt's blocks past its memory hit that the tier holds ──▶ read queue;
                 the request is parked here, not yet the scheduler's, while other requests step
    step start:  a finished read ──▶ BlockManager.restore keys free blocks for the blocks read whole,
                 their bytes are copied into the pools, and the request goes to the scheduler, whose
                 lookup finds them like any cached block (a block that failed a check is computed)

A draft model's pool shares the target's block ids, so a block's file holds both pools' keys and
values. The tier is the only writer of the parked requests.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from .block_manager import BlockManager
from .config import EngineConfig, parse_bytes
from .kv_disk import BlockRecord, KVDisk
from .prefix_index import ROOT_KEY, block_key
from .request import Request

IDLE_WAIT_S = 0.01           # a step with nothing else to do waits this long for a read to finish


class DiskTier:
    def __init__(self, disk: KVDisk, block_manager: BlockManager, runners: list):
        self.disk = disk
        self.bm = block_manager
        self.runners = runners
        self.parked: dict[str, Request] = {}
        self.offered: set[tuple[int, int]] = set()  # (block id, epoch): cached blocks flush has queued
        self.blocks_restored = 0
        block_manager.spill = True
        weakref.finalize(self, disk.stop)          # an engine dropped unclosed ends the I/O thread

    @classmethod
    def open(cls, config: EngineConfig, model_paths: list[str], facts: dict, block_manager: BlockManager,
             runners: list) -> Optional["DiskTier"]:
        """The tier the config asks for, or None (no ``kv_disk``, or no prefix cache). Every runner
        gives its pools block by block (``block_views``, in the runner contract)."""
        if not config.kv_disk or not config.prefix_cache:
            return None
        views = [v for r in runners for v in r.block_views(0)]
        layout = [[list(v.shape), str(v.dtype)] for v in views]
        facts = {**facts, "layout": layout, "block_size": config.block_size, "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "byteorder": sys.byteorder}
        payload = sum(v.numel() * v.element_size() for v in views)
        disk = KVDisk(config.kv_disk, parse_bytes(config.kv_disk_size), fingerprint(model_paths, facts),
                      payload, config.block_size)
        return cls(disk, block_manager, runners)

    # ---- reads ---------------------------------------------------------------------------------
    def park(self, request: Request) -> bool:
        """Start reading the request's blocks that memory lacks and the tier holds; True: parked
        until they are read."""
        if not self.disk.enabled:
            return False
        chain = [rec for rec, block_id in prompt_blocks(self.bm, request, self.disk.holds) if block_id is None]
        if not chain:
            return False
        self.parked[request.request_id] = request
        self.disk.fetch(request.request_id, chain)
        return True

    def land(self, wait: bool) -> list[Request]:
        """Requests whose reads finished, their blocks in the pools (waiting a moment for one when
        ``wait``)."""
        ready = []
        for fetch in self.disk.finished(IDLE_WAIT_S if wait and self.parked else 0.0):
            request = self.parked.pop(fetch.request_id, None)
            if request is None:
                continue                                   # aborted meanwhile
            keep = [b for _, b in prompt_blocks(self.bm, request, lambda key: True) if b is not None]
            ids = self.bm.restore(fetch.records[:len(fetch.payloads)], request.cache_salt, keep)
            self.spill()                                   # blocks restore evicted, before they are overwritten
            for block_id, payload in zip(ids, fetch.payloads):
                if block_id is not None:
                    self._load(block_id, payload)
                    self.blocks_restored += 1
            ready.append(request)
        return ready

    # ---- writes --------------------------------------------------------------------------------
    def spill(self) -> None:
        """Queue the blocks evicted since the last call that the tier lacks (copied now, while intact)."""
        for block_id, record in self.bm.take_evicted():
            if not self.disk.holds(record.key):
                self.disk.put(record, lambda b=block_id: self._copy(b))

    def flush(self) -> int:
        """The engine is idle: queue each cached full block the tier lacks, as the queue has room, once
        while it stays in memory (a budget smaller than memory would otherwise rewrite blocks at
        every idle moment). Returns how many it queued."""
        offered, queued = set(), 0
        for block_id, record in self.bm.cached_records():
            held = (block_id, self.bm.pool.epoch(block_id))      # a block handed out again: a new epoch
            if held in self.offered:
                offered.add(held)
            elif self.disk.room() and not self.disk.holds(record.key):
                offered.add(held)
                queued += self.disk.put(record, lambda b=block_id: self._copy(b))
        self.offered = offered
        return queued

    def _copy(self, block_id: int) -> list:
        """A copy of the block's bytes in every pool, as flat byte arrays."""
        out = []
        for runner in self.runners:
            for view in runner.block_views(block_id):
                out.append(torch.empty(view.shape, dtype=view.dtype).copy_(view).view(-1).view(torch.uint8).numpy())
        return out

    @torch.inference_mode()
    def _load(self, block_id: int, payload) -> None:
        data = torch.frombuffer(payload, dtype=torch.uint8)
        at = 0
        for runner in self.runners:
            for view in runner.block_views(block_id):
                n = view.numel() * view.element_size()
                view.copy_(data[at:at + n].view(view.dtype).view(view.shape))
                at += n

    # ---- the rest ------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.disk.stats(), "kv_disk_blocks_restored": self.blocks_restored,
                "kv_disk_parked": len(self.parked)}

    def close(self, timeout_s: float = 5.0) -> None:
        """Write every cached block the tier lacks, a queueful at a time, for at most ``timeout_s``,
        and stop the I/O thread (shutdown, tests)."""
        deadline = time.monotonic() + timeout_s
        while self.flush() and self.disk.drain(max(0.0, deadline - time.monotonic())):
            pass
        self.disk.close(max(0.0, deadline - time.monotonic()))


def prompt_blocks(bm: BlockManager, request: Request, holds: Callable[[int], bool]) \
        -> Iterator[tuple[BlockRecord, Optional[int]]]:
    """The request's full blocks as the prefix lookup walks them (its last token aside), each with the
    cached block that holds it in memory (or None), up to the first that neither memory nor ``holds``
    has."""
    parent, bs = ROOT_KEY, bm.block_size
    for start in range(0, request.num_tokens - bs, bs):
        tokens = tuple(request.token_ids[start:start + bs])
        key = block_key(parent, tokens, request.cache_salt)
        block_id = bm.prefix.cached_block(key, tokens)
        if block_id is None and not holds(key):
            return
        yield BlockRecord(key, parent, tokens), block_id
        parent = key


def fingerprint(paths: Sequence[str], facts: dict) -> bytes:
    """16 bytes naming the model files (each file's path, size and modification time) and ``facts``
    (dtypes, pool layout, execution), so that no other model or layout ever reads a block."""
    h = hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16)
    for p in paths:
        for f in _model_files(Path(p)):
            st = f.stat()
            h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogatepass"))
    return h.digest()


def _model_files(path: Path, limit: int = 4096) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else []
    return files[:limit]
