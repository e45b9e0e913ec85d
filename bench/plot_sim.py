#!/usr/bin/env python3
"""Plot of bench/bench_sim_papers.sh's study beyond the papers (issue #12).

Reads bench/sim_papers.csv (the `scale` study: the Split-KV paper's weak scaling continued from
P = 8 to 1024 on the h100-ib profiles, 35B-A3B drafter layer, b = 8, 8k queries and 16k x P context
per sample) and writes bench/sim_scaling.png: predicted bytes per rank and layer, step time per
layer, and the LPT planner's wall time (it really runs at every P), per method and profile.
"""
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ["splitkv", "ring", "ringx", "lvxattn"]  # Ulysses cannot serve P > n_kv = 4 here
TITLE = {"splitkv": "Split-KV", "ring": "Ring", "ringx": "RingX", "lvxattn": "LV-XAttn"}
COLOR = {"splitkv": "C0", "ring": "C2", "ringx": "C3", "lvxattn": "C4"}
PROFILE_STYLE = {"h100-ib": "-", "h100-ib-8nic": ":"}


def main():
    rows = [r for r in csv.DictReader(open(os.path.join(HERE, "sim_papers.csv")))
            if r["study"] == "scale" and r["supported"] == "true"]
    if not rows:
        raise SystemExit("bench/sim_papers.csv has no `scale` rows: run bench/bench_sim_papers.sh first")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for profile, style in PROFILE_STYLE.items():
        for m in METHODS:
            pts = sorted((int(r["P"]), r) for r in rows if r["method"] == m and r["profile"] == profile)
            if not pts:
                continue
            P = [p for p, _ in pts]
            label = f"{TITLE[m]} ({profile})"
            axes[0].plot(P, [float(r["bytes_per_layer"]) / 1e9 for _, r in pts], style, color=COLOR[m], marker="o",
                         label=label)
            axes[1].plot(P, [float(r["step_ms"]) for _, r in pts], style, color=COLOR[m], marker="o", label=label)
            if m == "splitkv":
                axes[2].plot(P, [float(r["plan_ms"]) for _, r in pts], style, color=COLOR[m], marker="o",
                             label=f"LPT ({profile} run)")
    for ax, title, unit in [(axes[0], "bytes sent per rank and layer", "GB"),
                            (axes[1], "predicted step (fwd + bwd) per layer", "ms"),
                            (axes[2], "LPT planning time (measured here)", "ms")]:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("P (ranks; context 16k x P per sample)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("diffcp sim: the Split-KV paper's weak scaling continued to P = 1024 "
                 "(35B-A3B drafter layer; solid: one 400 Gb/s uplink per node, dotted: one per rank)")
    fig.tight_layout()
    out = os.path.join(HERE, "sim_scaling.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
