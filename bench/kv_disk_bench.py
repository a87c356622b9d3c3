"""The disk tier's goals, each measured through daemons started here and printed side by side with
its goal:

    python -m llmd.bench.kv_disk_bench                                   # the bundled toy target, anywhere
    python -m llmd.bench.kv_disk_bench --model ~/engines/qwen-coder-int4 --threads 2   # the real coder
    python -m llmd.bench.kv_disk_bench --quick --only restart,faults

restart   a file prefetched as the editor does (its head, prompt-only), then its first completion: on
          the same daemon (warm), after a restart onto the tier, and on a daemon with no tier
          (recompute); the ratios restart / warm and recompute / restart.
memory    a KV pool a quarter of a working set of 40 files, cycled: the share of prompt tokens served
          from memory or the tier, and from memory alone without the tier.
faults    32 prompts at once on a small pool (evictions write hard), kill -9 part way, restart: greedy
          output against a daemon without prefix cache. Then one block file of each prompt's chain
          has a byte flipped or is cut short: each must be detected and dropped, output unchanged.
budget    the working set through a tier of a few dozen files: its bytes on disk, sampled
          throughout, against the budget and one file.
overhead  decode speed and time to first token, tier off against on (runs interleaved).

Every daemon is a `python -m llmd.daemon serve` process of its own; the figures are the client's.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path

from llmd.runtime.block_manager import ROOT_KEY

from .kv_disk_daemon import Answer, Daemon, ask, consume, headers, median, texts, tier_bytes

DEFAULT_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "code-target")
SECTIONS = ("restart", "memory", "faults", "budget", "overhead")
BLOCK = 16


class Bench:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.flags = ["--block-size", str(BLOCK), *args.serve_arg]
        self._chars_per_token = None
        self._context = None

    def daemon(self, name: str, *flags: str) -> Daemon:
        return Daemon(self.args.model, self.work, name, self.args.threads, *self.flags, *flags)

    def tier(self, name: str) -> list[str]:
        return ["--kv-disk", str(self.work / name)]

    # ---- sizes, measured once on the model ----------------------------------------------------
    def calibrate(self) -> None:
        with self.daemon("probe") as d, d.client() as c:
            self._context = int(c.models()[0].get("context_length") or 2048)
            sample = texts(1, 4000)[0][:min(4000, self._context)]       # fewer tokens than the context
            self._chars_per_token = len(sample) / ask(c, "generate", sample, max_tokens=1).usage["prompt_tokens"]
            e = c.stats()["engine"]
            self.kv_bytes_per_token = e["kv_bytes_total"] / (e["kv_blocks_total"] * BLOCK)
        print(f"model {self.args.model}: context {self._context}, {self._chars_per_token:.2f} characters a token, "
              f"{self.kv_bytes_per_token / 1024:.1f} KiB of KV a token")

    def head_tokens(self) -> int:
        """~1,000 tokens, or what the model's context leaves room for."""
        return min(self.args.prefix_tokens, self._context * 3 // 4 - 64)

    def chars(self, tokens: int) -> int:
        return int(tokens * self._chars_per_token)

    # ---- after a restart ----------------------------------------------------------------------
    def restart(self) -> None:
        n, head = self.args.files, self.chars(self.head_tokens())
        docs = [self._document(t, head) for t in texts(2 * n, head + 600)]
        warm_docs, cold_docs = docs[:n], docs[n:]
        with self.daemon("restart-a", *self.tier("restart-kv")) as d, d.client() as c:
            for prefix, suffix in docs:
                ask(c, "infill", prefix, suffix, max_tokens=1, prompt_only=True, priority="batch")
            warm = [self._complete(c, doc) for doc in warm_docs]
        with self.daemon("restart-b", *self.tier("restart-kv")) as d, d.client() as c:
            restarted = [self._complete(c, doc) for doc in cold_docs]
            read = c.stats()["engine"]["kv_disk_blocks_read"]
        with self.daemon("restart-c") as d, d.client() as c:
            recomputed = [self._complete(c, doc) for doc in cold_docs]
        same = sum(a.tokens == b.tokens for a, b in zip(restarted, recomputed))
        w, r, x = (median([a.e2e_ms for a in s]) for s in (warm, restarted, recomputed))
        print(f"[restart] first completion, {median([a.usage['prompt_tokens'] for a in restarted]):.0f}-token "
              f"prompts, {n} files each: warm {w:.1f} ms, after a restart {r:.1f} ms ({read} blocks read from disk), "
              f"recompute {x:.1f} ms")
        print(f"[restart]   computed tokens: warm {median([a.computed for a in warm]):.0f}, after a restart "
              f"{median([a.computed for a in restarted]):.0f}, recompute {median([a.computed for a in recomputed]):.0f}; "
              f"same output as recompute {same}/{n}")
        print(f"[restart]   restart / warm {r / w:.2f}x (goal <= 1.3x); recompute / restart {x / r:.2f}x (goal >= 4x)")

    @staticmethod
    def _document(text: str, head: int) -> tuple[str, str]:
        """The file's head up to a line start (the cursor's line), and what follows as the suffix."""
        cut = text.rfind("\n", 0, head) + 1 or head
        return text[:cut], text[cut:cut + 400]

    @staticmethod
    def _complete(c, doc) -> Answer:
        """The editor's completion at the cursor: the prefix ends at the cursor's line start (the line
        split), so it shares the prefetched head up to there."""
        prefix, suffix = doc
        line = prefix.rstrip("\n").rfind("\n") + 1
        return ask(c, "infill", prefix[:line], prefix[line:] + suffix, max_tokens=16, ignore_eos=True,
                   priority="interactive")

    # ---- beyond memory ------------------------------------------------------------------------
    def working_set(self) -> list[str]:
        size = self.chars(self.head_tokens())
        return [t[:size] for t in texts(40, size)]

    def pool_flags(self, prompts: list[str], fraction: float) -> list[str]:
        tokens = sum(len(p) for p in prompts) / self._chars_per_token
        return ["--kv-memory", str(max(int(tokens * fraction * self.kv_bytes_per_token), 1 << 20))]

    def memory(self) -> None:
        files = self.working_set()
        pool = self.pool_flags(files, 0.25)
        shares = {}
        for name, flags in (("memory and disk", self.tier("memory-kv")), ("memory alone", [])):
            with self.daemon(f"memory-{len(shares)}", *pool, *flags) as d, d.client() as c:
                hit = total = 0
                for rnd in range(1 + self.args.cycles):
                    for text in files:
                        a = ask(c, "generate", text, max_tokens=1)
                        if rnd:
                            hit += a.usage["cached_tokens"] or 0
                            total += a.usage["prompt_tokens"]
                shares[name] = hit / total
                e = c.stats()["engine"]
                extra = (f"; {e['kv_disk_blocks_read']} blocks read, {e['kv_disk_blocks_written']} written, "
                         f"{e['kv_disk_blocks_dropped']} dropped") if flags else ""
                print(f"[memory] pool {e['kv_blocks_total']} blocks for 40 files of ~{total / 40 / self.args.cycles:.0f} "
                      f"tokens, {name}: {100 * shares[name]:.1f} % of prompt tokens cached{extra}")
        print(f"[memory]   with the tier {100 * shares['memory and disk']:.1f} % (goal >= 80 %), without "
              f"{100 * shares['memory alone']:.1f} %")

    # ---- faults -------------------------------------------------------------------------------
    def faults(self) -> None:
        size = self.chars(self.head_tokens() // 2)
        prompts = [f"# part {n}\n" + t[:size] for n, t in enumerate(texts(32, size))]
        with self.daemon("faults-ref", "--no-prefix-cache") as d, d.client() as c:
            want = [ask(c, "generate", p, max_tokens=16, ignore_eos=True).tokens for p in prompts]
        small = self.pool_flags(prompts, 0.25)
        kv = self.work / "faults-kv"
        with self.daemon("faults-kill", *small, *self.tier("faults-kv")) as d:
            with d.client() as c:
                streams = [c.generate(p, max_tokens=16, ignore_eos=True) for p in prompts]
                t0 = time.perf_counter()
                consume(streams[len(streams) // 2], t0)       # half the prompts computed: the tier writes
                written = c.stats()["engine"]["kv_disk_blocks_written"]
                d.kill()
        print(f"[faults] kill -9 with {written} blocks written and {len(list(kv.glob('.*.tmp')))} being written")
        self._check(prompts, want, small, "after kill -9")
        damaged = self._damage(kv)
        bad = self._check(prompts, want, small, "after damage")
        print(f"[faults]   damaged {damaged['flipped']} flipped and {damaged['truncated']} truncated files: "
              f"{bad} detected and dropped (goal: all {damaged['flipped'] + damaged['truncated']})")

    def _check(self, prompts, want, flags, what: str) -> int:
        with self.daemon("faults-again", *flags, *self.tier("faults-kv")) as d, d.client() as c:
            got = [ask(c, "generate", p, max_tokens=16, ignore_eos=True).tokens for p in prompts]
            e = c.stats()["engine"]
        same = sum(a == b for a, b in zip(got, want))
        print(f"[faults]   {what}: greedy output identical to recompute for {same}/{len(prompts)} prompts "
              f"(goal: all); {e['kv_disk_blocks_read']} blocks read, {e['kv_disk_blocks_bad']} bad")
        return e["kv_disk_blocks_bad"]

    @staticmethod
    def _damage(tier: Path) -> dict:
        """Flip a payload byte of, or cut short, the second block file of each chain in the tier."""
        found = headers(tier)
        roots = {key for key, parent in found.values() if parent == ROOT_KEY}
        seconds = sorted({name for name, (_, parent) in found.items() if parent in roots})
        counts = {"flipped": 0, "truncated": 0}
        for i, name in enumerate(seconds):
            path = tier / name
            data = bytearray(path.read_bytes())
            if i % 2:
                path.write_bytes(data[:len(data) // 2])
                counts["truncated"] += 1
            else:
                data[len(data) * 2 // 3] ^= 0x10
                path.write_bytes(data)
                counts["flipped"] += 1
        return counts

    # ---- the budget ---------------------------------------------------------------------------
    def budget(self) -> None:
        files = self.working_set()
        kv = self.work / "budget-kv"
        with self.daemon("budget-probe", *self.tier("budget-probe-kv")) as d, d.client() as c:
            ask(c, "generate", files[0], max_tokens=1)
        file_bytes = max(f.stat().st_size for f in (self.work / "budget-probe-kv").glob("*.kv"))
        budget = 24 * file_bytes + file_bytes // 2
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                if kv.exists():
                    peak[0] = max(peak[0], tier_bytes(kv))
                time.sleep(0.005)
        watcher = threading.Thread(target=sample, daemon=True)
        with self.daemon("budget", *self.pool_flags(files, 0.25), *self.tier("budget-kv"),
                         "--kv-disk-size", str(budget)) as d, d.client() as c:
            watcher.start()
            for text in files * 2:
                ask(c, "generate", text, max_tokens=1)
            e = c.stats()["engine"]
        stop.set()
        watcher.join()
        print(f"[budget] budget {budget} bytes ({file_bytes} a file): at most {peak[0]} on disk, "
              f"{e['kv_disk_blocks_written']} blocks written; over by {max(0, peak[0] - budget)} bytes "
              f"(goal: at most one file, {file_bytes})")

    # ---- no cost when off ---------------------------------------------------------------------
    def overhead(self) -> None:
        size = self.chars(self.head_tokens() // 2)
        prompts = [f"# case {n}\n" + t[:size] for n, t in enumerate(texts(self.args.overhead_prompts, size))]
        runs: dict = {"off": [], "on": []}
        for r in range(2 * self.args.overhead_rounds):
            mode = ("off", "on")[r % 2]
            flags = self.tier(f"overhead-kv-{r}") if mode == "on" else []
            with self.daemon(f"overhead-{r}", *flags) as d, d.client() as c:
                runs[mode].append([ask(c, "generate", p, max_tokens=self.args.decode_tokens, ignore_eos=True)
                                   for p in prompts])
        fig = {m: {"ttft": [median([a.ttft_ms for a in run]) for run in rs],
                   "tps": [median([a.decode_tps for a in run]) for run in rs]} for m, rs in runs.items()}
        for m in ("off", "on"):
            print(f"[overhead] tier {m}: ttft {' / '.join(f'{v:.1f}' for v in fig[m]['ttft'])} ms, decode "
                  f"{' / '.join(f'{v:.1f}' for v in fig[m]['tps'])} tokens/s (each run's median)")
        on_off_ttft = median(fig["on"]["ttft"]) / median(fig["off"]["ttft"])
        on_off_tps = median(fig["on"]["tps"]) / median(fig["off"]["tps"])
        noise = (f"off against off (the noise): ttft {max(fig['off']['ttft']) / min(fig['off']['ttft']):.3f}x, decode "
                 f"{max(fig['off']['tps']) / min(fig['off']['tps']):.3f}x" if len(runs["off"]) > 1
                 else "one run each: the noise is not measured")
        print(f"[overhead]   on / off: ttft {on_off_ttft:.3f}x, decode {on_off_tps:.3f}x; {noise}")


# (flag, default, what it counts, the value under --quick)
COUNTS = (("--threads", 2, "engine threads of each daemon", 2),
          ("--prefix-tokens", 1000, "tokens of a file's head (less where the model's context is shorter)", 1000),
          ("--files", 8, "files per figure of the restart section", 2),
          ("--cycles", 2, "measured passes over the working set", 1),
          ("--overhead-prompts", 8, "prompts per overhead run", 2),
          ("--overhead-rounds", 2, "runs of each of tier off and on", 1),
          ("--decode-tokens", 64, "tokens generated per overhead prompt", 16))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmd.bench.kv_disk_bench",
                                description="Measure the KV tier on disk through daemons started here.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="what the daemons serve (default: the bundled toy target)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, from {','.join(SECTIONS)}")
    for flag, default, what, _ in COUNTS:
        p.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    p.add_argument("--quick", action="store_true", help="fewer files, passes and runs: a check that it all works")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `llmd serve` argument for every daemon")
    p.add_argument("--work-dir", help="keep the daemons' logs and tiers in this directory (default: a temporary one)")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.work_dir and Path(args.work_dir).is_dir() and any(Path(args.work_dir).iterdir()):
        p.error("--work-dir must be new or empty: the tiers of an earlier run would be read back")
    if args.quick:
        for flag, _, _, quick in COUNTS[2:]:
            setattr(args, flag[2:].replace("-", "_"), quick)
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(args, work)
        bench.calibrate()
        for name in chosen:
            getattr(bench, name)()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
