#!/usr/bin/env python3
"""diffcp.plan from Python, binding overhead included, against the same LPT written in Python
(the Split-KV paper's planner is Python; SPEC A.5 quotes 0.38-1.24 ms per step for it).

Workload (the paper's balance study at P = 64): b = 4 samples x 256k context, 8k queries (512
anchors of B = 16) per sample, prompt 25 %, J = 16. Prints medians of --reps calls.

    PYTHONPATH=build/release/python python3 bench/bench_plan_py.py [--P 64] [--J 16] [--reps 50]
"""
import argparse
import heapq
import statistics
import time

import numpy as np

import diffcp


def python_lpt(lengths, anchors, B, P, J):
    """SPEC A.3's LPT in numpy + heapq: equal chunks, prices, descending, least-loaded rank with < J chunks."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    s = np.concatenate([np.full(len(a), st) for st, a in zip(starts, anchors)])
    a = np.concatenate([st + np.asarray(an) for st, an in zip(starts, anchors)])
    S = int(np.sum(lengths))
    n = P * J
    edges = (np.arange(n + 1) * S) // n
    lo, hi = edges[:-1, None], edges[1:, None]
    price = B * np.clip(np.minimum(a[None, :], hi) - np.maximum(s[None, :], lo), 0, None).sum(axis=1)
    heap = [(0, p) for p in range(P)]
    count = [0] * P
    rank = np.empty(n, np.int32)
    for j in np.argsort(-price, kind="stable"):
        load, p = heapq.heappop(heap)
        rank[j] = p
        count[p] += 1
        if count[p] < J:
            heapq.heappush(heap, (load + int(price[j]), p))
    return rank


def median_ms(f, reps):
    f()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--J", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    B, L, A = 16, 256 * 1024, 512
    lengths = np.full(4, L)
    anchors = [np.sort(rng.choice(np.arange(L // 4, L - B + 1), A, replace=False)) for _ in lengths]
    ours = median_ms(lambda: diffcp.plan(lengths, anchors, B, args.P, args.J, "lpt"), args.reps)
    py = median_ms(lambda: python_lpt(lengths, anchors, B, args.P, args.J), max(5, args.reps // 5))
    plan = diffcp.plan(lengths, anchors, B, args.P, args.J, "lpt")
    print(f"P = {args.P}, J = {args.J}: diffcp.plan {ours:.3f} ms (imbalance {plan.imbalance_pct:.3f} %), "
          f"Python LPT {py:.3f} ms: {py / ours:.1f}x; vs the paper's 0.38-1.24 ms: "
          f"{0.38 / ours:.1f}-{1.24 / ours:.1f}x")


if __name__ == "__main__":
    main()
