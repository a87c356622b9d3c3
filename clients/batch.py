"""``llmd batch IN.jsonl OUT.jsonl``: offline requests at ``batch`` priority.

Each input line is a JSON object, one of::

    {"id": "a", "prompt": "def fib(n):", "max_tokens": 64}
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}]}
    {"id": "c", "prefix": "def f(", "suffix": "\\n", "files": [["util.py", "..."]]}

with any sampling key of the protocol (max_tokens, temperature, top_p, seed, stop, ...) beside
it. A line without ``id`` gets ``line-N`` (N counts lines from 1, so it is stable across runs).
Each output line is ``{"id", "text", "finish_reason", "usage"}`` or ``{"id", "error": {"code",
"message"}}``. A bad line (not JSON, unknown keys, a refused request) is an error line, never
fatal; a duplicate id is recorded as an error under ``line-N``.

Resuming: ids already in OUT are skipped. Output is appended one whole line at a time and
flushed; a partial last line left by a killed run is cut off before resuming, so every id
appears exactly once. If the daemon goes away, drains for a restart, or fails inside its engine
twice on one request, the run stops (exit 1) without writing that line and can be resumed: only
answers and errors that a retry would repeat are written. One run at a time holds OUT (a lock);
ids of the form ``line-N`` are reserved for lines without one.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from llmd.protocol import Done, Error, Token

from .backend import async_client, backend_of
from .client import SAMPLING_KEYS, AsyncClient, ClientError, DaemonUnavailable, RequestError

STOP_CODES = {"draining"}           # the daemon is going away: stop, write nothing, resume later
RETRY_CODES = {"internal"}          # retried once; a second failure stops the run like STOP_CODES
GENERATED_ID = re.compile(r"line-\d+")

KINDS = {"prompt": "generate", "messages": "chat", "prefix": "infill"}
EXTRA_KEYS = {"generate": {"prompt"}, "chat": {"messages"}, "infill": {"prefix", "suffix", "files"}}


class BadLine(ValueError):
    code = "bad_line"


@dataclass(frozen=True)
class BatchItem:
    id: str
    kind: str            # generate | chat | infill
    fields: dict         # prompt / messages / prefix, suffix, files
    sampling: dict


def parse_line(line: str, number: int) -> BatchItem:
    """One input line as a BatchItem; raises BadLine naming the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLine(f"not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.pop("id", None)
    if rid is None:
        rid = f"line-{number}"
    elif not isinstance(rid, str) or not rid:
        raise BadLine("id must be a non-empty string")
    elif GENERATED_ID.fullmatch(rid):
        raise BadLine(f"id {rid!r} is reserved for lines without an id (line-N); choose another")
    kinds = [k for k in KINDS if k in obj]
    if len(kinds) != 1:
        raise BadLine("give exactly one of prompt, messages or prefix")
    kind = KINDS[kinds[0]]
    fields = {k: obj.pop(k) for k in EXTRA_KEYS[kind] if k in obj}
    unknown = set(obj) - set(SAMPLING_KEYS)
    if unknown:
        raise BadLine(f"unknown key(s): {', '.join(sorted(unknown))}")
    if kind == "infill" and "files" in fields:
        files = fields["files"]
        if not isinstance(files, list) or not all(isinstance(f, list) and len(f) == 2 for f in files):
            raise BadLine("files must be a list of [path, text] pairs")
        fields["files"] = [tuple(f) for f in files]
    return BatchItem(rid, kind, fields, obj)


def done_ids(out_path: Path) -> set[str]:
    """Ids already answered in ``out_path``; cuts off a partial last line left by a killed run."""
    if not out_path.exists():
        return set()
    ids, end = set(), 0
    with open(out_path, "r+b") as f:
        for raw in f:                        # line by line: OUT may be large
            if not raw.endswith(b"\n"):
                break                        # a partial last line
            end += len(raw)
            try:
                ids.add(json.loads(raw)["id"])
            except (ValueError, KeyError, TypeError):
                continue
        f.truncate(end)
    return ids


def pending_items(in_path: Path, skip: set[str]) -> Iterator[tuple[str, object]]:
    """(id, BatchItem or BadLine) for every input line not yet answered; blank lines are ignored."""
    seen: set[str] = set()
    with open(in_path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadLine(f"not UTF-8 ({e.reason} at byte {e.start})") from None
                item = parse_line(line, number)
            except BadLine as e:
                yield f"line-{number}", e
                continue
            if item.id in seen:
                yield f"line-{number}", BadLine(f"duplicate id {item.id!r}")
                continue
            seen.add(item.id)
            yield item.id, item


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


@dataclass(frozen=True)
class BatchConfig:
    socket: Optional[str] = None
    concurrency: int = 8
    progress: bool = True
    busy_retry_s: float = 0.2


class BatchBusy(RuntimeError):
    pass


class BatchRunner:
    """Runs the pending lines with at most ``concurrency`` requests in flight; one writer (``_write``)."""

    def __init__(self, config: BatchConfig, in_path: Path, out_path: Path):
        if config.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.config, self.in_path, self.out_path = config, in_path, out_path
        self.written = 0
        self._out = None
        self._bar = None

    async def run(self) -> int:
        with open(self.out_path, "a", encoding="utf-8") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BatchBusy(f"{self.out_path} is being written by another llmd batch run") from None
            return await self._run()

    async def _run(self) -> int:
        skip = done_ids(self.out_path)
        from tqdm import tqdm
        self._bar = tqdm(total=count_lines(self.in_path), initial=len(skip), unit="req", file=sys.stderr,
                         disable=not self.config.progress, mininterval=0.25)
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.config.concurrency * 2)
        client = async_client(self.config.socket, timeout=600.0)
        try:
            with open(self.out_path, "a", encoding="utf-8") as self._out:
                tasks = [asyncio.create_task(self._feed(queue, skip))]
                tasks += [asyncio.create_task(self._worker(client, queue)) for _ in range(self.config.concurrency)]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for t in tasks:
                        t.cancel()
        finally:
            self._bar.close()
            await client.aclose()
        return self.written

    async def _feed(self, queue: asyncio.Queue, skip: set[str]) -> None:
        for rid, item in pending_items(self.in_path, skip):
            if rid not in skip:
                await queue.put((rid, item))
        for _ in range(self.config.concurrency):
            await queue.put(None)          # one stop mark per worker

    async def _worker(self, client: AsyncClient, queue: asyncio.Queue) -> None:
        while (job := await queue.get()) is not None:
            rid, item = job
            self._write(await self._answer(client, rid, item))

    async def _answer(self, client: AsyncClient, rid: str, item) -> dict:
        if isinstance(item, BadLine):
            return {"id": rid, "error": {"code": item.code, "message": str(item)}}
        retried = False
        while True:
            try:
                return await self._run_one(client, item)
            except RequestError as e:
                if e.code in STOP_CODES or (e.code in RETRY_CODES and retried):
                    raise DaemonUnavailable(f"the daemon answered {rid!r} with {e.code} ({e.event.message})") from None
                if e.code in RETRY_CODES:
                    retried = True
                elif e.code != "busy":
                    return {"id": rid, "error": {"code": e.code, "message": e.event.message}}
            except (TypeError, ValueError) as e:   # a value the client cannot send (type, size, encoding)
                return {"id": rid, "error": {"code": "invalid_request", "message": str(e)}}
            await asyncio.sleep(self.config.busy_retry_s)

    async def _run_one(self, client: AsyncClient, item: BatchItem) -> dict:
        start = {"generate": client.generate, "chat": client.chat, "infill": client.infill}[item.kind]
        args = dict(item.fields)
        # stream=False: the answer is written whole, so the daemon sends it in one event, not one per token
        if item.kind == "chat":
            stream = await start(args.pop("messages"), priority="batch", **args, **item.sampling, stream=False)
        elif item.kind == "infill":
            stream = await start(args.pop("prefix"), args.pop("suffix", ""), priority="batch", **args, **item.sampling,
                                 stream=False)
        else:
            stream = await start(args.pop("prompt"), priority="batch", **item.sampling, stream=False)
        parts = [ev.text async for ev in stream if isinstance(ev, Token)]
        final = stream.final
        if isinstance(final, Error):
            raise RequestError(final)
        assert isinstance(final, Done)
        if final.finish_reason == "shutdown":
            raise DaemonUnavailable("the daemon shut down during the batch")
        return {"id": item.id, "text": "".join(parts), "finish_reason": final.finish_reason, "usage": final.usage}

    def _write(self, record: dict) -> None:
        self._out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._out.flush()
        self.written += 1
        self._bar.update(1)


def run_batch(args) -> int:
    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.is_file():
        print(f"llmd batch: {in_path}: no such file", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print(f"llmd batch: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
        return 2
    config = BatchConfig(socket=backend_of(args), concurrency=args.concurrency,
                         progress=not args.no_progress and sys.stderr.isatty() or args.progress)
    try:
        written = asyncio.run(BatchRunner(config, in_path, out_path).run())
    except BatchBusy as e:
        print(f"llmd batch: {e}; wait for it or choose another output file", file=sys.stderr)
        return 2
    except ClientError as e:
        print(f"llmd batch: {e}; rerun the same command to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("llmd batch: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    print(f"llmd batch: {written} lines written to {out_path}", file=sys.stderr)
    return 0
