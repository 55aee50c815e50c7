"""One plot of several `vllm_cpu.py` runs: symbiont / vLLM throughput and ITL p50 per
scenario, grouped by model and thread setting (issue 17).

    python benchmarks/peers/threads_plot.py RUN_DIR [RUN_DIR ...] --out threads.png

Each RUN_DIR is a `vllm_cpu.py --out` folder (its `vllm_cpu.json`); runs of the same model
and thread setting are drawn side by side, so repeats show the run-to-run spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(run: Path) -> tuple[str, list[dict]]:
    path = run / "vllm_cpu.json"
    if not path.is_file():
        raise SystemExit(f"{run}: no vllm_cpu.json (pass a vllm_cpu.py --out folder)")
    data = json.loads(path.read_text())
    threads = data["args"]["threads"]
    setting = "defaults" if threads is None else f"{threads} thr"
    return f"{data['args']['model']}, {setting}", data["rows"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", type=Path, help="vllm_cpu.py --out folders")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []  # (label, throughput ratio, ITL p50 ratio)
    for run in args.runs:
        group, rows = load(run)
        for row in rows:
            s, v = row["symbiont"], row["vllm"]
            scenario = row["label"].removeprefix("base, ")
            bars.append(
                (f"{group}\n{scenario}", s["tok_s"] / v["tok_s"], s["itl_p50"] / v["itl_p50"])
            )
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(bars)), 7), sharex=True)
    x = range(len(bars))
    for ax, column, title in (
        (axes[0], 1, "throughput, symbiont / vLLM (above 1: symbiont faster)"),
        (axes[1], 2, "ITL p50, symbiont / vLLM (below 1: symbiont faster)"),
    ):
        ax.bar(x, [b[column] for b in bars], color="tab:blue")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
    axes[1].set_xticks(list(x), [b[0] for b in bars], rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
