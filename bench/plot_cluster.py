#!/usr/bin/env python3
"""Plots and Markdown tables of bench/bench_cluster_studies.sh (the emulated cluster).

Reads bench/cluster_cp.csv, cluster_weak.csv, cluster_balance.csv, cluster_dit.csv, cluster_a2a.csv
(whichever exist); writes bench/cluster_cp.png (Q:S ablation: step time at 2 x 1, bytes per layer
per rank at 2 x 2; weak scaling step time) and bench/cluster_dit.png (CoCoDiff modes: step time and
exposed communication; all-to-all latency vs size, flat vs TAPA), and prints the tables. Times of
oversubscribed runs (oversubscribed = 1) are labelled as such.
"""
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ["splitkv", "ulysses", "ring", "ringx", "lvxattn"]
TITLE = {"splitkv": "Split-KV", "ulysses": "Ulysses", "ring": "Ring", "ringx": "RingX", "lvxattn": "LV-XAttn"}
STYLE = {"splitkv": "o-", "ulysses": "s--", "ring": "^--", "ringx": "v--", "lvxattn": "d--"}


def rows(name):
    path = os.path.join(HERE, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []


def cp_tables(cp, weak):
    for topo in ("2x1", "2x2"):
        sel = [r for r in cp if r["topology"] == topo]
        if not sel:
            continue
        over = " (OVERSUBSCRIBED: 4 ranks on 2 cores; bytes exact)" if topo == "2x2" else ""
        print(f"\n### h100-ib scaled, {topo}{over}\n")
        print("| Q:S | step ms: " + " / ".join(TITLE[m] for m in METHODS) + " | Split-KV speedup over each | MB/layer/rank |")
        print("|---|---|---|---|")
        for point in sorted({int(r["point"]) for r in sel}):
            by = {r["method"]: r for r in sel if int(r["point"]) == point}
            step = {m: float(by[m]["step_ms"]) for m in METHODS if m in by}
            sk = step.get("splitkv")
            speed = " / ".join(f"{step[m] / sk:.2f}x" for m in METHODS[1:] if m in step) if sk else "-"
            mb = " / ".join(f"{float(by[m]['bytes_per_layer']) / 1e6:.2f}" for m in METHODS if m in by)
            print(f"| 1:{point} | " + " / ".join(f"{step[m]:.0f}" if m in step else "n/a" for m in METHODS)
                  + f" | {speed} | {mb} |")
    if weak:
        print("\n### Weak scaling in S, h100-ib scaled, 2x1\n")
        print("| context/sample | S | step ms: " + " / ".join(TITLE[m] for m in METHODS) + " | MB/layer/rank |")
        print("|---|---|---|---|")
        for point in sorted({r["point"] for r in weak}, key=lambda p: int(p.rstrip("k"))):
            by = {r["method"]: r for r in weak if r["point"] == point}
            S = next(iter(by.values()))["S"]
            print(f"| {point} | {S} | " + " / ".join(f"{float(by[m]['step_ms']):.0f}" if m in by else "n/a" for m in METHODS)
                  + " | " + " / ".join(f"{float(by[m]['bytes_per_layer']) / 1e6:.2f}" for m in METHODS if m in by) + " |")


def cp_plot(cp, weak):
    if not cp:
        return
    fig, axes = plt.subplots(1, 3 if weak else 2, figsize=(16 if weak else 11, 4.2))
    for m in METHODS:
        for ax, topo, key, scale in ((axes[0], "2x1", "step_ms", 1e3), (axes[1], "2x2", "bytes_per_layer", 1e6)):
            sel = sorted(((int(r["point"]), float(r[key]) / scale) for r in cp if r["method"] == m and r["topology"] == topo))
            if sel:
                ax.plot([p for p, _ in sel], [v for _, v in sel], STYLE[m], label=TITLE[m])
    axes[0].set(title="Q:S ablation, 2 nodes x 1 rank (h100-ib scaled)", xlabel="S/Q", ylabel="step s (fwd+bwd, one layer)", xscale="log", yscale="log")
    axes[1].set(title="bytes per layer per rank, 2 nodes x 2 ranks", xlabel="S/Q", ylabel="MB", xscale="log", yscale="log")
    if weak:
        for m in METHODS:
            sel = sorted(((int(r["S"]), float(r["step_ms"]) / 1e3) for r in weak if r["method"] == m))
            axes[2].plot([s for s, _ in sel], [v for _, v in sel], STYLE[m], label=TITLE[m])
        axes[2].set(title="weak scaling in S, 2 x 1", xlabel="S (context rows)", ylabel="step s", xscale="log", yscale="log")
    for i, ax in enumerate(axes):
        ticks = sorted({int(r["S"]) for r in weak}) if i == 2 else sorted({int(r["point"]) for r in cp})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "cluster_cp.png"), dpi=110)
    print("\nwrote bench/cluster_cp.png")


def dit_part(dit, a2a):
    if dit:
        print("\n### CoCoDiff, aurora scaled, 2 x 2 (L = 2), OVERSUBSCRIBED times\n")
        print("| mode | step ms | speedup over flat | exposed comm ms | MB intra / inter group per step and rank |")
        print("|---|---|---|---|---|")
        flat = float(next(r for r in dit if r["mode"] == "flat")["step_ms"])
        for r in dit:  # bytes are per step and rank already (diffcp dit --json)
            print(f"| {r['mode']} | {float(r['step_ms']):.0f} | {flat / float(r['step_ms']):.2f}x | {float(r['exposed_comm_ms']):.0f} | "
                  f"{float(r['bytes_intra_group']) / 1e6:.2f} / {float(r['bytes_inter_group']) / 1e6:.2f} |")
    if a2a:
        print("\n### All-to-all latency vs size, flat vs TAPA (aurora scaled, 2 x 2, OVERSUBSCRIBED)\n")
        print("| MiB/rank | flat ms | TAPA ms (phase 1 + phase 2) | flat/TAPA | MiB intra / inter per rank |")
        print("|---|---|---|---|---|")
        for r in a2a:
            print(f"| {r['mib_per_rank']} | {float(r['flat_ms']):.0f} | {float(r['tapa_ms']):.0f} ({float(r['phase1_ms']):.0f} + {float(r['phase2_ms']):.0f}) | "
                  f"{float(r['flat_ms']) / float(r['tapa_ms']):.2f}x | {r['intra_mib']} / {r['inter_mib']} |")
    if not (dit or a2a):
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if dit:
        modes = [r["mode"] for r in dit]
        x = range(len(modes))
        axes[0].bar([i - 0.2 for i in x], [float(r["step_ms"]) for r in dit], 0.4, label="step ms")
        axes[0].bar([i + 0.2 for i in x], [float(r["exposed_comm_ms"]) for r in dit], 0.4, label="exposed comm ms")
        axes[0].set_xticks(list(x), modes)
        axes[0].set(title="CoCoDiff modes, aurora scaled, 2 x 2 (oversubscribed)", ylabel="ms per step")
        axes[0].legend()
    if a2a:
        sz = [float(r["mib_per_rank"]) for r in a2a]
        axes[1].plot(sz, [float(r["flat_ms"]) for r in a2a], "s--", label="flat")
        axes[1].plot(sz, [float(r["tapa_ms"]) for r in a2a], "o-", label="TAPA")
        axes[1].set(title="all-to-all latency vs size (aurora scaled, 2 x 2)", xlabel="MiB per rank", ylabel="ms", xscale="log", yscale="log")
        axes[1].legend()
        axes[1].grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "cluster_dit.png"), dpi=110)
    print("\nwrote bench/cluster_dit.png")


def balance_part(bal):
    if not bal:
        return
    print("\n### Balancers end to end, Split-KV, skewed batch, h100-ib scaled, 2 x 1\n")
    print("| balancer | imbalance % | step ms | exposed comm ms | speedup over none |")
    print("|---|---|---|---|---|")
    base = float(next(r for r in bal if r["point"] == "none")["step_ms"])
    for r in bal:
        print(f"| {r['point']} | {float(r['imbalance_pct']):.2f} | {float(r['step_ms']):.0f} | {float(r['exposed_comm_ms']):.0f} | {base / float(r['step_ms']):.2f}x |")


import matplotlib.ticker  # noqa: E402

cp, weak = rows("cluster_cp.csv"), rows("cluster_weak.csv")
cp_tables(cp, weak)
cp_plot(cp, weak)
balance_part(rows("cluster_balance.csv"))
dit_part(rows("cluster_dit.csv"), rows("cluster_a2a.csv"))
