#!/usr/bin/env python3
"""How a PyTorch DFlash training loop lays out its context with diffcp.plan every step.

Each step the data loader packs b samples and samples anchors; every rank calls diffcp.plan with
the same (lengths, anchors) and gets the same plan (no communication). Rank p then holds the
context rows of plan.chunks_of_rank(p) and owns an even contiguous range of the anchor blocks.
The rows it needs are gathered from the loader's slices with one all-to-all (here: computed as
index arrays; in PyTorch, `torch.distributed.all_to_all_single` on the hidden states with these
split sizes, or diffcp's own redistribute in C++).

    PYTHONPATH=build/release/python python3 examples/python/train_loop_plan.py --P 8 --steps 5
(no MPI needed: it prints what every rank would do).
"""
import argparse

import numpy as np

import diffcp


def loader_batch(rng, samples, context, anchors_per_sample, block):
    """A packed micro-batch as a DFlash loader makes it: lengths, sorted anchors in the response."""
    lengths = rng.integers(context // 2, context + 1, size=samples)
    anchors = []
    for L in lengths:
        prompt = int(0.25 * L)
        anchors.append(np.sort(rng.choice(np.arange(prompt, L - block + 1), anchors_per_sample, replace=False)))
    return lengths, anchors


def rows_to_move(plan, S, P):
    """send[p][r]: rows rank p sends to rank r when the loader gave rank p the slice [pS/P, (p+1)S/P)."""
    send = np.zeros((P, P), np.int64)
    for (beg, end), r in zip(plan.chunks, plan.rank):
        for p in range(P):
            lo, hi = max(beg, p * S // P), min(end, (p + 1) * S // P)
            if hi > lo and p != r:
                send[p, r] += hi - lo
    return send


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--P", type=int, default=8)
    ap.add_argument("--J", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        lengths, anchors = loader_batch(rng, args.samples, args.context, args.anchors, args.block)
        plan = diffcp.plan(lengths, anchors, args.block, args.P, args.J, "lpt")
        none = diffcp.plan(lengths, anchors, args.block, args.P, 1, "none")
        S = int(lengths.sum())
        moved = rows_to_move(plan, S, args.P).sum()
        # In the model: hidden = all_to_all(hidden_slice, splits from rows_to_move); then for each
        # drafter layer, the Split-KV layer (diffcp.SplitKV) on the rank's rows.
        print(f"step {step}: S = {S}, blocks = {sum(len(a) for a in anchors)}, imbalance lpt "
              f"{plan.imbalance_pct:.2f} % (contiguous {none.imbalance_pct:.2f} %), rows moved {moved} "
              f"({100 * moved / S:.0f} % of S), rank 0 holds {len(plan.chunks_of_rank(0))} chunks")


if __name__ == "__main__":
    main()
