#!/usr/bin/env python3
"""Plots bench/bench_serve.py's CSV: images/s and median latency per request over concurrent
clients, per P, batching on and off (medians over rounds; the in-process call as a mark at one
client). Needs matplotlib (not a dependency; not run by CI).
Usage: bench/plot_serve.py [bench/serve.csv] [bench/serve.png]
"""
import csv
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/serve.csv"
    out = sys.argv[2] if len(sys.argv) > 2 else "bench/serve.png"
    with open(src) as f:
        rows = list(csv.DictReader(f))

    def med(P, batching, clients, col):
        v = [float(r[col]) for r in rows if r["P"] == str(P) and r["batching"] == str(batching) and r["clients"] == str(clients)]
        return statistics.median(v) if v else None

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    clients = [1, 2, 4]
    for P, color in ((1, "tab:blue"), (2, "tab:orange")):
        for batching, style in ((1, "-o"), (0, "--s")):
            label = f"P = {P}, batching {'on' if batching else 'off'}"
            ax[0].plot(clients, [med(P, batching, c, "images_per_s") for c in clients], style, color=color, label=label)
            ax[1].plot(clients, [med(P, batching, c, "latency_ms_median") for c in clients], style, color=color, label=label)
    ip = med(1, -1, 1, "latency_ms_median")
    if ip is not None:
        ax[1].plot([1], [ip], "k*", markersize=12, label="in process, P = 1")
    ax[0].set(xlabel="concurrent clients", ylabel="images / s", title="throughput", xticks=clients)
    ax[1].set(xlabel="concurrent clients", ylabel="ms per request (median)", title="latency", xticks=clients)
    for a in ax:
        a.grid(alpha=0.3)
    ax[1].legend(fontsize=8)
    fig.suptitle("python -m diffcp.serve: stand-in FLUX.1 pipeline, default DiT, 256², 8 steps, bf16 (medians over rounds)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
