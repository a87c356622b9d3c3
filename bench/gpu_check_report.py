"""bench/gpu_check.sh's record: after each stage, RESULTS/check.json is written again with every stage so
far (exit status, seconds, a note) and every figure found in RESULTS (step 0's checks, the bench's
JSON, the agreement files), so a run cut short still leaves what it measured. Plain Python: it runs
before llmd is installed.

    python bench/gpu_check_report.py RESULTS STAGE EXIT SECONDS [NOTE]    record a stage; prints a summary line
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def figures(results: Path) -> dict:
    out: dict = {}
    step0 = read(results / "step0.json")
    if step0:
        out["step0"] = {k: v.get("ok") for k, v in step0.items() if isinstance(v, dict)}
        out["graph_capture"] = (step0.get("ops_graph") or {}).get("graph")
    bench = read(results / "bench.json")
    if bench:
        one, many = bench.get("llmd_single", {}), bench.get("llmd_concurrent", {})
        out["bench"] = {"decode_tok_s": one.get("decode_tok_s"), "ttft_s": one.get("ttft_s"),
                        "prompt_len": bench.get("prompt_len"),
                        "hf_decode_tok_s": (bench.get("hf_single") or {}).get("decode_tok_s"),
                        "ratio_decode_vs_hf": bench.get("ratio_decode_vs_hf"),
                        "streams": many.get("streams"), "streams_decode_tok_s": many.get("decode_aggregate_tok_s"),
                        "cuda_graphs": (bench.get("engine_stats") or {}).get("cuda_graphs")}
    agree = {p.stem.removeprefix("agreement_"): read(p) for p in sorted(results.glob("agreement_*.json"))}
    if agree:
        out["agreement"] = {k: (v or {}).get("agree") for k, v in agree.items()}
    return out


def summary(f: dict) -> str:
    b = f.get("bench")
    if not b or b.get("decode_tok_s") is None:
        return "no bench figures"
    ratio = b.get("ratio_decode_vs_hf")
    ttft = b.get("ttft_s")
    many = b.get("streams_decode_tok_s")
    return (f"single stream {b['decode_tok_s']:.0f} tok/s (goal >= 1,500), "
            f"{'%.2fx' % ratio if ratio else 'no'} transformers (goal >= 3x); "
            f"{b.get('prompt_len')}-token ttft {1000 * ttft:.1f} ms (goal <= 15 ms); "
            f"{b.get('streams')} streams {many or 0:.0f} tok/s (goal >= 20,000); graphs: {b.get('cuda_graphs')}")


def record(results: Path, stage: str, rc: int, seconds: float, note: str = "") -> dict:
    path = results / "check.json"
    check = read(path) or {"stages": []}
    check["env"] = read(results / "env.json")
    check["stages"].append({"stage": stage, "exit": rc, "seconds": seconds, **({"note": note} if note else {})})
    check["figures"] = figures(results)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(check, indent=1))
    tmp.replace(path)
    return check


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    check = record(Path(argv[0]), argv[1], int(argv[2]), float(argv[3]), " ".join(argv[4:]))
    if argv[1] == "bench":
        print(summary(check["figures"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
