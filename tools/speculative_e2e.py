#!/usr/bin/env python3
"""From a transformers target to a measured tau, end to end on this machine (issue #36; not in CI:
needs torch >= 2.6 and transformers from PyPI):

1. target: a tiny Qwen3 (Qwen3ForCausalLM, random init: vocab 64, hidden 64, 6 layers), trained
   briefly on a synthetic corpus whose continuation is learnable (random motifs of 2-6 tokens,
   repeated), saved with save_pretrained (no hub);
2. data: prompts (a new motif, repeated 2-3 times and cut) whose responses are the target's own
   greedy continuations (as DFlash trains on the target's outputs), as token ids in JSONL;
   the last --heldout of them are held out;
3. tools/extract_shards.py writes the drafter's training shards from the saved target;
4. `mpirun -np 2 diffcp train --data ... --preset tiny` trains the drafter (Split-KV over 2 ranks)
   and reports its held-out tau (anchors on the held-out responses, drafts against the target's
   greedy tokens); `diffcp export` writes the DFlash folder;
5. diffcp.Drafter.load + diffcp.speculative.generate decode every held-out prompt with the target:
   lossless (the output equals the target's greedy generation, token for token) and tau measured.

Goal (issue #36): the decoding tau > 1.5 and within 10 % of the trainer's held-out tau. Exit 1 if not.

  python3 -m venv --system-site-packages V && V/bin/pip install --ignore-installed "torch>=2.6" && V/bin/pip install transformers safetensors
  PYTHONPATH=build/release/python V/bin/python tools/speculative_e2e.py --diffcp build/release/src/diffcp [--out bench/speculative_e2e.txt]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import diffcp

V, MASK = 64, 63  # the tiny drafter preset's vocabulary and mask token (the target never emits 63)


def motif_sequence(rng, length):
    m = rng.integers(2, 7)
    motif = rng.integers(0, MASK, size=m)
    return np.resize(motif, length)


def train_target(seed, steps, log):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    model.train()
    for step in range(steps):
        x = torch.tensor(np.stack([motif_sequence(rng, 64) for _ in range(32)]), dtype=torch.long)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  target step {step}: loss {loss.item():.4f}")
    model.eval()
    return model


@torch.no_grad()
def greedy(model, prompt, n):
    seq = torch.tensor(prompt, dtype=torch.long)
    for _ in range(n):
        nxt = model(seq[None]).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    return seq[len(prompt):].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--out", help="also write this report here")
    ap.add_argument("--samples", type=int, default=480)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--response", type=int, default=40, help="response tokens per sample (and tokens decoded)")
    ap.add_argument("--target-steps", type=int, default=600)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="train a drafter whose layer 0 is a sliding-window layer of this window (layer 1 full): "
                         "its DFlash folder (from a 1-step run, layer_types edited) is the --init of the real run")
    args = ap.parse_args()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    here = os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp(prefix="diffcp_spec_")
    log(f"speculative_e2e: torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
        f"diffcp {args.diffcp}, work dir {work}")
    t0 = time.time()
    target = train_target(args.seed, args.target_steps, log)
    target.save_pretrained(f"{work}/target")
    log(f"1. target trained ({args.target_steps} steps) and saved: {time.time() - t0:.0f} s")

    rng = np.random.default_rng(args.seed + 1)
    records = []
    for _ in range(args.samples):
        base = motif_sequence(rng, 64)
        prompt = base[: rng.integers(8, 17)].tolist()
        records.append({"prompt_ids": prompt, "response_ids": greedy(target, prompt, args.response)})
    with open(f"{work}/data.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    log(f"2. {args.samples} prompts with the target's greedy responses ({args.response} tokens), last {args.heldout} held out")

    subprocess.run([sys.executable, f"{here}/extract_shards.py", "--model", f"{work}/target", "--token-jsonl",
                    f"{work}/data.jsonl", "--out", f"{work}/shards", "--target-layers", "2",
                    "--max-samples", str(args.samples), "--samples-per-shard", "128"], check=True)
    log("3. tools/extract_shards.py wrote the shards")

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    mpi = ["mpirun", "--oversubscribe", "-np", "2", args.diffcp, "train", "--data", f"{work}/shards",
           "--heldout", str(args.heldout), "--no-progress"]
    shape = ["--preset", "tiny"]
    if args.sliding_window:  # a sliding drafter: the tiny shape with layer_types, as --init
        subprocess.run(mpi + shape + ["--steps", "1", "--out", f"{work}/init"], env=env, check=True, capture_output=True)
        subprocess.run([args.diffcp, "export", "--checkpoint", f"{work}/init/checkpoint.bin", "--out", f"{work}/init/dflash"],
                       check=True, capture_output=True)
        c = json.load(open(f"{work}/init/dflash/config.json"))
        c.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
                 sliding_window=args.sliding_window)
        json.dump(c, open(f"{work}/init/dflash/config.json", "w"))
        shape = ["--init", f"{work}/init/dflash"]
        log(f"   drafter layers: sliding_attention (window {args.sliding_window}), full_attention")
    train = subprocess.run(mpi + shape + ["--steps", str(args.drafter_steps), "--out", f"{work}/train"], env=env,
                           check=True, capture_output=True, text=True)
    m = re.search(r"held-out acceptance length tau ([0-9.]+) \(against the ([^)]*)\)", train.stdout)
    train_tau = float(m.group(1))
    log(f"4. diffcp train ({args.drafter_steps} steps, P = 2): held-out tau {train_tau:.3f} (against the {m.group(2)})")
    subprocess.run([args.diffcp, "export", "--checkpoint", f"{work}/train/checkpoint.bin", "--out", f"{work}/drafter"],
                   check=True, capture_output=True)

    drafter = diffcp.Drafter.load(f"{work}/drafter")
    if args.sliding_window:
        assert drafter.config["layer_types"] == ["sliding_attention", "full_attention"], drafter.config
    taus, lossless, forwards, new = [], 0, 0, 0
    t1 = time.time()
    for r in records[-args.heldout:]:
        out, stats = diffcp.speculative.generate(target, drafter, torch.tensor(r["prompt_ids"]), args.response)
        got = out[0, len(r["prompt_ids"]):].tolist()
        lossless += got == r["response_ids"]
        taus.append(stats["tau"])
        forwards += stats["target_forwards"]
        new += stats["new_tokens"]
    decode_tau = float(np.mean(taus))
    log(f"5. decoding {args.heldout} held-out prompts x {args.response} tokens with transformers' DynamicCache "
        f"({time.time() - t1:.1f} s): lossless {lossless}/{args.heldout} (output == the target's greedy tokens), "
        f"tau {decode_tau:.3f} (mean over prompts of the mean acceptance length; block size {drafter.block_size}), "
        f"{new / forwards:.2f} new tokens per target forward (prefill included; plain greedy: 1)")
    rel = abs(decode_tau - train_tau) / train_tau
    ok = lossless == args.heldout and decode_tau > 1.5 and rel <= 0.10
    log(f"decoding tau {decode_tau:.3f} vs trainer's held-out tau {train_tau:.3f}: {100 * rel:.1f} % apart "
        f"(goal <= 10 %), decoding tau > 1.5: {decode_tau > 1.5}, lossless: {lossless == args.heldout} -> "
        f"{'PASSED' if ok else 'FAILED'}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
