"""KVDisk: the prefix cache's tier on disk, so computed prompt blocks outlive evictions and restarts.

One file per full block, named by a digest of the model's fingerprint and the block's key (the
prefix cache's hash chain, llmd.runtime.prefix_index), so two models never share a name:

    <dir>/<32 hex>.kv      0600, in a 0700 directory; written as .<name>.<pid>.tmp, then renamed

    | HEADER (72 bytes)                                           | tokens   | payload      | crc32      |
    | magic | fingerprint | key | parent key | n | payload bytes  | n int64  | pools' bytes | of the rest |

A read checks every field against what it was asked for (fingerprint, key, parent key, tokens, sizes)
and the checksum; a file that fails any check is deleted and its block computed instead.

Threads: the engine thread calls ``holds``, ``room``, ``put``, ``fetch``, ``finished`` and ``stats``;
one I/O thread writes and reads the files, reads first. KVDisk is the only writer of its index, its
queues and its counters; both threads change them under one lock. Writes wait in a bounded queue,
and a write that finds it full is dropped. The index (file -> bytes) is least recently used first; a
write first deletes the oldest files until it fits the budget. An error writing (a read-only or full
disk) logs one warning and turns the tier off.
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import struct
import threading
import time
import weakref
import zlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("llmd.kv_disk")

MAGIC = b"LLMDKV01"
HEADER = struct.Struct("<8s16s16s16sQQ")    # magic, fingerprint, key, parent key, tokens, payload bytes (72)
CRC = struct.Struct("<I")
STALE_TMP_S = 60                            # a temporary file this old was left by a killed writer
QUEUE_BYTES = 64 << 20                      # writes waiting hold this much memory at most; more are dropped


@dataclass(frozen=True)
class BlockRecord:
    """A full block as the prefix cache keys it."""

    key: int
    parent_key: int
    tokens: tuple[int, ...]


@dataclass
class Fetch:
    """A read of a request's blocks: ``payloads`` holds the first blocks read whole (the rest failed)."""

    request_id: str
    records: list[BlockRecord]
    payloads: list[memoryview] = field(default_factory=list)


class KVDisk:
    def __init__(self, directory: str, budget: int, fingerprint: bytes, payload_bytes: int, block_size: int):
        self.dir = Path(directory).expanduser()
        self.budget = budget
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.block_size = block_size
        self.file_bytes = HEADER.size + 8 * block_size + payload_bytes + CRC.size
        self.queue_blocks = max(4, QUEUE_BYTES // payload_bytes)
        self.enabled = True
        self._index: OrderedDict[str, int] = OrderedDict()   # file name -> bytes, least recently used first
        self._queued: dict[str, list] = {}                    # name -> payload, waiting in the write queue
        self._writes: deque = deque()
        self._reads: deque = deque()
        self._done: list[Fetch] = []
        self._reading = 0                                     # fetches asked for and not yet done
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False                                    # the I/O thread is on a job
        self.counts = dict(hits=0, blocks_read=0, blocks_written=0, blocks_dropped=0, blocks_bad=0,
                           bytes_read=0, bytes_written=0, read_s=0.0)
        self.bytes = 0
        self._open()
        self._thread = threading.Thread(target=self._run, name="llmd-kv-disk", daemon=True)
        if self.enabled:
            self._thread.start()
            atexit.register(_finish, weakref.ref(self))

    # ---- the engine thread ---------------------------------------------------------------------
    def holds(self, key: int) -> bool:
        """Is the block on disk, or waiting to be written?"""
        name = self._name(key)
        return self.enabled and (name in self._index or name in self._queued)

    def room(self) -> bool:
        return self.enabled and len(self._writes) < self.queue_blocks

    def put(self, record: BlockRecord, parts: Callable[[], list]) -> bool:
        """Queue a block for writing; ``parts()`` copies its payload (buffers, ``payload_bytes`` in all)
        and is only called when the queue has room. False: dropped (the queue is full)."""
        if not self.enabled:
            return False
        if not self.room():
            with self._cv:
                self.counts["blocks_dropped"] += 1
            return False
        data = parts()
        with self._cv:
            self._queued[self._name(record.key)] = data
            self._writes.append((record, data))
            self._cv.notify()
        return True

    def fetch(self, request_id: str, records: list[BlockRecord]) -> None:
        """Read ``records`` (a chain, in order) in the background; ``finished`` returns the result."""
        with self._cv:
            self._reads.append(Fetch(request_id, records))
            self._reading += 1
            self._cv.notify()

    def finished(self, wait_s: float = 0.0) -> list[Fetch]:
        """Fetches read since the last call (waiting up to ``wait_s`` for one when there is none)."""
        with self._cv:
            if not self._done and wait_s > 0:
                self._cv.wait_for(lambda: self._done or not self._reading, wait_s)
            done, self._done = self._done, []
        return done

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and read is done (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._writes or self._reads or self._busy), timeout_s)

    def stop(self) -> None:
        """Let the I/O thread end once the queued jobs are done (never waits)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs (waiting at most ``timeout_s``) and end the I/O thread; the tier is
        off from then on."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.enabled = False

    def stats(self) -> dict:
        with self._cv:
            out = {f"kv_disk_{k}": v for k, v in self.counts.items()}
            out.update(kv_disk_on=self.enabled, kv_disk_bytes=self.bytes, kv_disk_files=len(self._index),
                       kv_disk_budget=self.budget, kv_disk_queued=len(self._writes))
        return out

    # ---- opening -------------------------------------------------------------------------------
    def _open(self) -> None:
        """Make the owner-only directory and index its files, oldest first; leftovers of an
        interrupted write are deleted once they are a minute old (another process may be writing one)."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.dir, 0o700)
            found = []
            for entry in os.scandir(self.dir):
                if entry.name.endswith(".tmp"):
                    if entry.stat().st_mtime < time.time() - STALE_TMP_S:
                        os.unlink(entry.path)
                elif entry.name.endswith(".kv") and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name[:-3], st.st_size))
            if not os.access(self.dir, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.dir} is not writable")
        except OSError as e:
            self._off(e)
            return
        for _, name, size in sorted(found):
            self._index[name] = size
            self.bytes += size
        self._fit(0)

    def _off(self, error: OSError) -> None:
        if self.enabled:
            log.warning("the KV tier on disk (%s) is off: %s; llmd goes on without it", self.dir, error)
        self.enabled = False
        self._writes.clear()
        self._queued.clear()

    # ---- the I/O thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._stop or self._reads or self._writes)
                if not (self._reads or self._writes):
                    return                                    # stopped, and nothing is left
                self._busy = True
                job = self._reads.popleft() if self._reads else self._writes.popleft()
            try:
                if isinstance(job, Fetch):
                    self._read_fetch(job)
                else:
                    self._write(*job)
            except Exception as e:                           # never strand a parked request: the tier goes
                log.exception("the KV tier on disk failed")
                with self._cv:
                    self._off(OSError(str(e)))

    def _write(self, record: BlockRecord, parts: list) -> None:
        name = self._name(record.key)
        with self._cv:
            ok = self.enabled and self.file_bytes <= self.budget
            self.counts["blocks_dropped"] += self.enabled and not ok
            if ok:
                self._fit(self.file_bytes)
        written = False
        try:
            written = ok and self._write_file(name, record, parts)
        finally:
            with self._cv:
                if written:
                    self.bytes += self.file_bytes - self._index.pop(name, 0)
                    self._index[name] = self.file_bytes
                    self.counts["blocks_written"] += 1
                    self.counts["bytes_written"] += self.file_bytes
                self._queued.pop(name, None)

    def _write_file(self, name: str, record: BlockRecord, parts: list) -> bool:
        """Write the block beside its name and rename it into place; False: the tier is off."""
        body = self._header(record) + array("q", record.tokens).tobytes()
        crc = zlib.crc32(body)
        for p in parts:
            crc = zlib.crc32(p, crc)
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                for p in parts:
                    f.write(p)
                f.write(CRC.pack(crc))
            os.replace(tmp, self.dir / f"{name}.kv")
            return True
        except OSError as e:
            _unlink(tmp)
            with self._cv:
                self._off(e)
            return False

    def _fit(self, more: int) -> None:
        """Delete the least recently used files until ``more`` bytes fit the budget (lock held)."""
        while self._index and self.bytes + more > self.budget:
            name, size = self._index.popitem(last=False)
            self.bytes -= size
            _unlink(self.dir / f"{name}.kv")

    def _read_fetch(self, fetch: Fetch) -> None:
        t0 = time.perf_counter()
        try:
            for record in fetch.records:
                payload = self._read(record)
                if payload is None:
                    break
                fetch.payloads.append(payload)
        finally:
            self._fetched(fetch, time.perf_counter() - t0)

    def _fetched(self, fetch: Fetch, seconds: float) -> None:
        with self._cv:
            n = len(fetch.payloads)
            self.counts["hits"] += n > 0
            self.counts["blocks_read"] += n
            self.counts["bytes_read"] += n * self.file_bytes
            self.counts["read_s"] += seconds
            self._done.append(fetch)
            self._reading -= 1
            self._cv.notify_all()

    def _read(self, record: BlockRecord) -> Optional[memoryview]:
        """The block's payload, or None when its file is missing or fails a check (then deleted).
        A block still waiting to be written is read from the queue."""
        name = self._name(record.key)
        with self._cv:
            queued = self._queued.get(name)
        if queued is not None:
            return memoryview(bytearray(b"".join(memoryview(p).cast("B") for p in queued)))
        path = self.dir / f"{name}.kv"
        data = bytearray(self.file_bytes + 1)            # one byte more: a longer file is no block either
        try:
            with open(path, "rb") as f:
                size = f.readinto(data)
        except OSError:
            with self._cv:
                self.bytes -= self._index.pop(name, 0)
            return None
        header = self._header(record)
        head, end = len(header), self.file_bytes - CRC.size
        ok = (size == self.file_bytes and data[:head] == header
              and data[head:head + 8 * self.block_size] == array("q", record.tokens).tobytes()
              and CRC.unpack_from(data, end)[0] == zlib.crc32(memoryview(data)[:end]))
        with self._cv:
            if not ok:
                self.counts["blocks_bad"] += 1
                self.bytes -= self._index.pop(name, 0)
                _unlink(path)
                return None
            if name in self._index:
                self._index.move_to_end(name)
        start = head + 8 * self.block_size
        return memoryview(data)[start:start + self.payload_bytes]

    # ---- names and headers ---------------------------------------------------------------------
    def _name(self, key: int) -> str:
        return hashlib.blake2b(self.fingerprint + key.to_bytes(16, "little"), digest_size=16).hexdigest()

    def _header(self, record: BlockRecord) -> bytes:
        return HEADER.pack(MAGIC, self.fingerprint, record.key.to_bytes(16, "little"),
                           record.parent_key.to_bytes(16, "little"), len(record.tokens), self.payload_bytes)


def _finish(ref) -> None:
    """At exit: the queued writes of a tier still open get a moment to land."""
    disk = ref()
    if disk is not None:
        disk.close(2.0)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
