#!/usr/bin/env python3
"""Plots and summary tables of bench/bench_cp_studies.sh.

Reads bench/cp_qs.csv, bench/cp_weak.csv, bench/cp_strong.csv (whichever exist) and writes
bench/cp_qs.png (Q:S ablation: step time at P = 2, bytes per layer per rank at P = 2 and 8) and
bench/cp_scaling.png (weak and strong: step time at P = 1, 2; bytes per rank at P = 1..8), and
prints Markdown tables. Rows of "volumes only" runs (timed = 0) are never used for times.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ["splitkv", "ulysses", "ring", "ringx", "lvxattn"]
TITLE = {"splitkv": "Split-KV", "ulysses": "Ulysses", "ring": "Ring", "ringx": "RingX", "lvxattn": "LV-XAttn"}
STYLE = {"splitkv": "o-", "ulysses": "s--", "ring": "^--", "ringx": "v--", "lvxattn": "d--"}
COLOR = {"splitkv": "C0", "ulysses": "C1", "ring": "C2", "ringx": "C3", "lvxattn": "C4"}


def pow2_ticks(ax):
    """Labelled ticks at the powers of two inside a log axis' range, plain numbers."""
    lo, hi = ax.get_ylim()
    ax.set_yticks([2.0**k for k in range(-4, 20) if lo <= 2.0**k <= hi])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def load(study):
    path = os.path.join(HERE, f"cp_{study}.csv")
    if not os.path.exists(path):
        return []
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        r["P"] = int(r["P"])
        r["point"] = int(r["point"])
        r["supported"] = r["supported"] == "true"
        r["timed"] = r["timed"] == "1"
        for k in ("step_ms", "fwd_ms", "bwd_ms", "bytes_per_layer", "predicted_bytes_per_layer", "run_peak_bytes", "S", "Q"):
            r[k] = float(r[k]) if r.get(k) not in (None, "") else None
    return rows


def series(rows, method, P, key, timed=None):
    pts = sorted((r["point"], r[key]) for r in rows if r["method"] == method and r["P"] == P and r["supported"]
                 and (timed is None or r["timed"] == timed))
    return [p for p, _ in pts], [v for _, v in pts]


def value(rows, method, P, point, key):
    for r in rows:
        if r["method"] == method and r["P"] == P and r["point"] == point and r["supported"]:
            return r[key]
    return None


def fmt(v, scale=1.0, digits=1):
    return "n/a" if v is None else f"{v / scale:.{digits}f}"


def qs(rows):
    if not rows:
        return
    points = sorted({r["point"] for r in rows})
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    for m in METHODS:
        x, y = series(rows, m, 2, "step_ms", timed=True)
        if x:
            ax[0].plot(x, [v / 1e3 for v in y], STYLE[m], color=COLOR[m], label=TITLE[m])
        for i, P in ((1, 2), (2, 8)):
            x, y = series(rows, m, P, "bytes_per_layer")
            if x:
                ax[i].plot(x, [v / 2**20 for v in y], STYLE[m], color=COLOR[m], label=TITLE[m])
    ax[0].set_title("step time (fwd + bwd), P = 2, one rank per core")
    ax[0].set_ylabel("s (median, slowest rank)")
    ax[1].set_title("bytes per layer per rank, P = 2")
    ax[2].set_title("bytes per layer per rank, P = 8 (volumes only)")
    for a in ax[1:]:
        a.set_ylabel("MiB")
        a.set_yscale("log")
        pow2_ticks(a)
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xticks(points)
        a.set_xticklabels([f"1:{p}" for p in points])
        a.set_xlabel("Q:S (Q = 4096 packed rows)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "cp_qs.png"), dpi=110)

    print("### Q:S ablation, P = 2 (real timings; load " + ", ".join(sorted({r["load1"] for r in rows if r["timed"]})) + ")\n")
    print("| Q:S | load | " + " | ".join(f"{TITLE[m]} step ms" for m in METHODS) + " | fastest | Split-KV vs fastest other |")
    print("|---|---|" + "---|" * (len(METHODS) + 2))
    for p in points:
        load1 = next((r["load1"] for r in rows if r["timed"] and r["point"] == p), "n/a")
        steps = {m: value([r for r in rows if r["timed"]], m, 2, p, "step_ms") for m in METHODS}
        ok = {m: v for m, v in steps.items() if v is not None}
        best = min(ok, key=ok.get)
        others = [v for m, v in ok.items() if m != "splitkv"]
        ratio = min(others) / ok["splitkv"] if "splitkv" in ok and others else None
        print(f"| 1:{p} | {load1} | " + " | ".join(fmt(steps[m], 1, 0) for m in METHODS) + f" | {TITLE[best]} | "
              + ("n/a" if ratio is None else f"{ratio:.2f}x") + " |")
    lo, hi = points[0], points[-1]
    print(f"\nstep-time growth 1:{lo} -> 1:{hi} at P = 2: " + ", ".join(
        f"{TITLE[m]} {value(rows, m, 2, hi, 'step_ms') / value(rows, m, 2, lo, 'step_ms'):.2f}x"
        for m in METHODS if value(rows, m, 2, lo, "step_ms") and value(rows, m, 2, hi, "step_ms")))
    for P in (2, 8):
        print(f"\n### Q:S ablation, bytes per layer per rank (MiB), P = {P}" + (" (volumes only)" if P == 8 else "") + "\n")
        print("| Q:S | " + " | ".join(TITLE[m] for m in METHODS) + " |")
        print("|---|" + "---|" * len(METHODS))
        for p in points:
            print(f"| 1:{p} | " + " | ".join(fmt(value(rows, m, P, p, "bytes_per_layer"), 2**20, 1) for m in METHODS) + " |")
        print(f"\nbytes growth 1:{lo} -> 1:{hi} at P = {P}: " + ", ".join(
            f"{TITLE[m]} {value(rows, m, P, hi, 'bytes_per_layer') / value(rows, m, P, lo, 'bytes_per_layer'):.2f}x"
            for m in METHODS if value(rows, m, P, lo, "bytes_per_layer")))
    print()


def scaling(weak, strong):
    if not weak and not strong:
        return
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.6))
    for rows, ls, name in ((weak, "-", "weak"), (strong, ":", "strong")):
        for m in METHODS:
            pts = sorted((r["P"], r["bytes_per_layer"]) for r in rows if r["method"] == m and r["supported"] and r["P"] > 1)
            if pts:
                ax[1].plot([p for p, _ in pts], [v / 2**20 for _, v in pts], STYLE[m][0] + ls, color=COLOR[m],
                           label=f"{TITLE[m]} ({name})")
            pts = sorted((r["P"], r["step_ms"]) for r in rows if r["method"] == m and r["supported"] and r["timed"])
            if pts:
                ax[0].plot([p for p, _ in pts], [v / 1e3 for _, v in pts], STYLE[m][0] + ls, color=COLOR[m],
                           label=f"{TITLE[m]} ({name})")
    ax[0].set_title("step time, P = 1, 2 (one rank per core)")
    ax[0].set_ylabel("s (median, slowest rank)")
    ax[0].set_xticks([1, 2])
    ax[1].set_title("bytes per layer per rank (P = 4, 8: volumes only)")
    ax[1].set_ylabel("MiB")
    ax[1].set_yscale("log")
    pow2_ticks(ax[1])
    ax[1].set_xscale("log", base=2)
    ax[1].set_xticks([2, 4, 8])
    ax[1].set_xticklabels(["2", "4", "8"])
    for a in ax:
        a.set_xlabel("P")
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "cp_scaling.png"), dpi=110)

    for rows, name in ((weak, "weak"), (strong, "strong")):
        if not rows:
            continue
        loads = ", ".join(sorted({r["load1"] for r in rows if r["timed"]}))
        print(f"### {name} scaling (P = 1, 2 timed, load {loads}; P = 4, 8 volumes only)\n")
        print("| P | S | " + " | ".join(f"{TITLE[m]} step ms / MiB per rank" for m in METHODS) + " |")
        print("|---|---|" + "---|" * len(METHODS))
        for P in sorted({r["P"] for r in rows}):
            S = next(r["S"] for r in rows if r["P"] == P)
            cells = []
            for m in METHODS:
                r = next((r for r in rows if r["P"] == P and r["method"] == m), None)
                if r is None or not r["supported"]:
                    cells.append("n/a")
                else:
                    t = fmt(r["step_ms"], 1, 0) if r["timed"] else "-"
                    cells.append(f"{t} / {fmt(r['bytes_per_layer'], 2**20, 1)}")
            print(f"| {P} | {int(S)} | " + " | ".join(cells) + " |")
        print()


def main():
    qs(load("qs"))
    scaling(load("weak"), load("strong"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
