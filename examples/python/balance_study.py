#!/usr/bin/env python3
"""A balance study (SPEC A.5): imbalance of each balancer as P grows, on the paper's workload
shape (b samples, 25 % prompt, anchors in the response), plotted with matplotlib.

    PYTHONPATH=build/release/python python3 examples/python/balance_study.py --out balance.png
    ... --no-plot            prints the table only (no matplotlib needed)
"""
import argparse

import numpy as np

import diffcp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--J", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="balance.png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    names = ["none", "zigzag", "lpt"]
    table = {n: [] for n in names}
    for P in args.P:
        for n in names:
            vals = []
            for seed in range(args.seeds):
                rng = np.random.default_rng(seed)
                L = args.context
                lengths = np.full(args.samples, L)
                anchors = [np.sort(rng.choice(np.arange(L // 4, L - args.block + 1), args.anchors, replace=False))
                           for _ in range(args.samples)]
                vals.append(diffcp.plan(lengths, anchors, args.block, P, args.J, n).imbalance_pct)
            table[n].append(float(np.mean(vals)))
    print("P      " + "".join(f"{n:>10}" for n in names))
    for i, P in enumerate(args.P):
        print(f"{P:<7}" + "".join(f"{table[n][i]:>9.2f}%" for n in names))
    if args.no_plot:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for n in names:
        ax.plot(args.P, table[n], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("ranks P")
    ax.set_ylabel("imbalance 100(rho-1) %")
    ax.set_title(f"{args.samples} x {args.context} context, {args.anchors} anchors/sample, J = {args.J}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
