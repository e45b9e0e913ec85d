#!/usr/bin/env python3
"""Plot the balance study CSV written by `bench_balance --csv` into a PNG (needs matplotlib;
not run by CI). Usage: bench/plot_balance.py balance.csv bench/balance.png"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = list(csv.DictReader(open(sys.argv[1])))
COLOR = {"none": "tab:gray", "zigzag": "tab:blue", "partition": "tab:orange", "lpt": "tab:red"}
fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
panels = [("context", "context per sample (tokens)", "context", "P = 8"),
          ("P", "CP size P", "P", "context 256k per sample")]
for ax, (sweep, xlabel, xkey, title) in zip(axes[:2], panels):
    for b in ["none", "zigzag", "partition", "lpt"]:
        pts = [r for r in rows if r["sweep"] == sweep and r["balancer"] == b]
        xs = [int(r[xkey]) for r in pts]
        ys = [max(float(r["imbalance_pct_mean"]), 1e-3) for r in pts]
        es = [float(r["imbalance_pct_std"]) for r in pts]
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=b, color=COLOR[b])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("imbalance 100*(rho-1) %  (mean ± std, 10 seeds)")
    ax.set_title(f"{title}, b = 4, 8k queries/sample")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
ax = axes[2]
for b in ["zigzag", "partition", "lpt"]:
    pts = [r for r in rows if r["sweep"] == "P" and r["balancer"] == b]
    ax.plot([int(r["P"]) for r in pts], [float(r["plan_ms_median"]) for r in pts], marker="o", label=b, color=COLOR[b])
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("CP size P")
ax.set_ylabel("planning time, median (ms)")
ax.set_title("planning latency, context 256k per sample")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print("wrote", sys.argv[2])
