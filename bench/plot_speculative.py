#!/usr/bin/env python3
"""Plots of tools/long_context_study.py (issue #53).

Reads bench/long_context_tau.csv and bench/speculative_speed.csv (whichever exist) and writes
bench/long_context_tau.png (decoding tau vs prompt length, one curve per drafter training context;
the training context marked on each curve) and bench/speculative_speed.png (tokens/s of plain
greedy generation and of speculative decoding, and the speed-up, per prompt length and mode), and
prints Markdown tables.
"""
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    path = os.path.join(HERE, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []


def plot_tau(rows):
    contexts = sorted({int(r["train_context"]) for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    print("| drafter trained at | " + " | ".join(f"prompt {L}" for L in sorted({int(r['prompt_length']) for r in rows})) + " |")
    print("|---" * (1 + len({r['prompt_length'] for r in rows})) + "|")
    for i, C in enumerate(contexts):
        pts = sorted((int(r["prompt_length"]), float(r["tau"]), r["lossless"]) for r in rows if int(r["train_context"]) == C)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, "o-", color=f"C{i}", label=f"drafter trained at context {C}")
        ax.axvline(C, color=f"C{i}", ls=":", lw=1)
        print(f"| {C} | " + " | ".join(f"{y:.2f}" + ("" if ok == "yes" else f" ({ok})") for _, y, ok in pts) + " |")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    ax.set_xlabel("prompt length (tokens; dotted: each drafter's training context)")
    ax.set_ylabel("decoding tau (tokens per block, greedy)")
    ax.set_ylim(bottom=1.0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("DFlash drafters trained at several contexts (Split-KV, P = 2):\n"
                 "acceptance length vs prompt length; corpus: documents repeating every 1024 tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "long_context_tau.png"), dpi=120)
    print()


def plot_speed(rows):
    labels = [f"{r['mode'].replace('-', chr(10))}\nprompt {int(r['prompt_length'])}" for r in rows]
    base = [float(r["baseline_tokens_per_s"]) for r in rows]
    spec = [float(r["speculative_tokens_per_s"]) for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    x = range(len(rows))
    w = 0.38
    ax.bar([i - w / 2 for i in x], base, w, label="target alone (transformers generate, KV cache; greedy or sampled)", color="C7")
    ax.bar([i + w / 2 for i in x], spec, w, label="diffcp.speculative.generate", color="C0")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("new tokens / s (1 CPU thread)")
    ax.set_ylim(0, max(base + spec) * 1.35)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    sp = [float(r["speedup"]) for r in rows]
    bars = ax2.bar(list(x), sp, 0.6, color=["C2" if s >= 1 else "C3" for s in sp])
    for b, r in zip(bars, rows):
        ax2.annotate(f"{float(r['speedup']):.2f}x\n(decode {float(r['decode_speedup']):.2f}x)\ntau {float(r['tau']):.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom", fontsize=7)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, fontsize=8)
    ax2.set_ylabel("speed-up (speculative / plain, prefill included)")
    ax2.set_ylim(0, max(sp + [1.0]) * 1.3)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Speculative decoding wall clock (drafter trained at context {rows[0]['train_context']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "speculative_speed.png"), dpi=120)
    print("| mode | prompt | plain tok/s | speculative tok/s | speed-up | decode-only | tau | target ms/forward | draft ms/block |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['prompt_length']} | {r['baseline_tokens_per_s']} | {r['speculative_tokens_per_s']} | "
              f"{r['speedup']} | {r['decode_speedup']} | {r['tau']} | {r['target_ms_per_block']} | {r['draft_ms_per_block']} |")


def main():
    tau = load("long_context_tau.csv")
    if tau:
        plot_tau(tau)
    speed = load("speculative_speed.csv")
    if speed:
        plot_speed(speed)


if __name__ == "__main__":
    main()
