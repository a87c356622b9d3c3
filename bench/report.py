"""Bench results on disk: the JSON (everything, including the doctor's evidence) and one PNG
(latency distributions per workload and peer; aggregate tokens/s against concurrency)."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(res: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(res, indent=1, sort_keys=False))
    return path


def read_json(path: str | Path) -> dict:
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read bench results from {path}: {e}") from None
    if not isinstance(res, dict) or not isinstance(res.get("workloads"), dict):
        raise ValueError(f"{path} is not an `llmd bench --workload` result (no 'workloads' section)")
    return res


def write_png(res: dict, path: str | Path) -> Path:
    """Needs matplotlib (the `bench` extra); raises ImportError naming it otherwise."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path = Path(path)
    workloads = list(res["workloads"])
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(4 * (len(workloads) + 1), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        samples = res["workloads"][w]["samples"]
        names = sorted(samples, key=lambda n: (not n.startswith("llmd"), n))
        ax.boxplot([[1000 * v for v in samples[n]["e2e_s"]] or [0] for n in names], tick_labels=names)
        ax.set_title(f"{w}: end-to-end latency")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", rotation=30)
    ax = axes[0][-1]
    for name, curve in res.get("concurrency", {}).items():
        xs = sorted(int(n) for n in curve)
        ax.plot(xs, [curve[str(n)] for n in xs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("throughput against concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
