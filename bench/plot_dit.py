#!/usr/bin/env python3
"""Plots the CoCoDiff studies of bench/bench_dit_studies.sh.

  bench/dit_modes.png    per mode: bytes across / inside groups per rank per step (P = 2 L = 1,
                         P = 4 L = 2) and step time / exposed communication (P = 2, real runs)
  bench/dit_quality.png  PSNR vs Flat over step time and over bytes across groups: fixed r (dots,
                         labelled) and the linear schedule (star)
Usage: bench/plot_dit.py [bench/dit_modes.csv] [bench/dit_quality.csv]
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MODES = ["flat", "tapa", "vfirst", "cocodiff"]


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def plot_modes(path, out):
    r = rows(path)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, point in enumerate(["P2_L1", "P4_L2"]):
        sel = {x["mode"]: x for x in r if x["point"] == point}
        xs = [m for m in MODES if m in sel]
        inter = [float(sel[m]["bytes_inter_group"]) / 1e6 for m in xs]
        intra = [float(sel[m]["bytes_intra_group"]) / 1e6 for m in xs]
        off = -0.2 + 0.4 * i
        pos = [k + off for k in range(len(xs))]
        ax[0].bar(pos, inter, 0.38, label=f"{point} across groups")
        ax[0].bar(pos, intra, 0.38, bottom=inter, alpha=0.4, label=f"{point} inside groups")
        for p, m in zip(pos, xs):
            if m == "cocodiff":
                pred = float(sel[m]["predicted_bytes_inter_group"]) / 1e6
                ax[0].plot([p - 0.19, p + 0.19], [pred, pred], "k--")
        ax[0].set_xticks(range(len(xs)), xs)
    ax[0].set_ylabel("MB per rank per step")
    ax[0].set_title("bytes (dashed: V-Major prediction)")
    ax[0].legend(fontsize=7)
    for a, point in zip(ax[1:], ["P2_L2", "P2_L1"]):
        sel = {x["mode"]: x for x in r if x["point"] == point}
        xs = [m for m in MODES if m in sel]
        step = [float(sel[m]["step_ms"]) for m in xs]
        comm = [float(sel[m]["exposed_comm_ms"]) for m in xs]
        a.bar(xs, step, label="step (median)")
        a.bar(xs, comm, label="exposed communication")
        loads = ", ".join(sorted({sel[m]["load1"] for m in xs}))
        a.set_title(f"P = 2, {point[3:]} (load {loads})")
        a.set_ylabel("ms")
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_quality(path, out):
    r = [x for x in rows(path) if x["mode"] == "cocodiff"]
    fixed = [x for x in r if x["cache_schedule"] == "fixed"]
    lin = [x for x in r if x["cache_schedule"] == "linear"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for a, key, label in [(ax[0], "total_ms", "total sampling time (ms)"),
                          (ax[1], "bytes_inter_group", "bytes across groups per rank per step")]:
        psnr = lambda x: 99.0 if x["psnr"] == "inf" else float(x["psnr"])
        a.plot([float(x[key]) for x in fixed], [psnr(x) for x in fixed], "o-", label="fixed r")
        for x in fixed:
            a.annotate(x["cache_ratio"], (float(x[key]), psnr(x)), fontsize=7)
        a.plot([float(x[key]) for x in lin], [psnr(x) for x in lin], "*", ms=14, label="linear 0 -> 1")
        a.set_xlabel(label)
        a.set_ylabel("PSNR vs Flat (dB; 99 = identical)")
        a.legend()
    fig.suptitle("CoCoDiff speed / quality (P = 2, L = 1, 256^2, random weights)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    modes = sys.argv[1] if len(sys.argv) > 1 else "bench/dit_modes.csv"
    quality = sys.argv[2] if len(sys.argv) > 2 else "bench/dit_quality.csv"
    plot_modes(modes, modes.replace(".csv", ".png"))
    plot_quality(quality, quality.replace(".csv", ".png"))
