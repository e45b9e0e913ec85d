#!/usr/bin/env python3
"""Extract DFlash drafter training shards from a Hugging Face target model (not run in CI).

Writes, into OUT_DIR, the files `diffcp train --data OUT_DIR` reads:
  model.safetensors         embedding [V, H] (input embeddings) and lm_head [H, V] (float32);
                            metadata target_layer_ids (JSON list) and num_target_layers
  shard_00000.safetensors   tokens I32 [T], loss_mask U8 [T], offsets I64 [n+1] (sample
                            boundaries into the T rows), hidden F32 [T, n_t * H] (the target's
                            hidden states of the chosen layers, concatenated per token),
                            target_greedy I32 [T] (the target's argmax for each position given
                            the tokens before it: what the held-out tau compares drafts with)
The chosen layers follow SPEC A.1: round(1 + i*(L-4)/(n_t-1)) for i = 0..n_t-1 (L//2 if n_t = 1).

Usage:
  pip install torch transformers safetensors datasets
  tools/extract_shards.py --model Qwen/Qwen3-0.6B --dataset <hf dataset with "prompt"/"response">
                          --out data/qwen --target-layers 5 --max-samples 1000 --max-length 4096
  tools/extract_shards.py --model DIR --token-jsonl FILE ...   # a local model, token ids already
      (one JSON object a line: {"input_ids": [...], "loss_mask": [...]} as `python -m diffcp.data
      tokenize` writes it from conversations (docs/data.md: chat template, multi-turn masks), or
      {"prompt_ids": [...], "response_ids": [...]}; no tokenizer, no hub)
Then: mpirun -np 2 diffcp train --data data/qwen --preset <a preset whose vocab/hidden match>
"""
import argparse
import json
import os

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM


def layer_ids(n_layers: int, n_t: int) -> list[int]:
    if n_t == 1:
        return [n_layers // 2]
    return [round(1 + i * (n_layers - 4) / (n_t - 1)) for i in range(n_t)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="a Hugging Face dataset with prompt / response text")
    src.add_argument("--token-jsonl", help="a local file of token ids: {input_ids, loss_mask} (python -m diffcp.data "
                                           "tokenize) or {prompt_ids, response_ids} per line")
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-layers", type=int, default=5)
    ap.add_argument("--max-samples", type=int, default=0, help="0: every sample")
    ap.add_argument("--max-length", type=int, default=0, help="0: no cut (diffcp.data tokenize bounds the length)")
    ap.add_argument("--samples-per-shard", type=int, default=256)
    args = ap.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    emb = model.get_input_embeddings().weight.detach().float().numpy()          # [V, H]
    head = model.get_output_embeddings().weight.detach().float().numpy().T      # [H, V]
    layers = layer_ids(model.config.num_hidden_layers, args.target_layers)
    save_file({"embedding": np.ascontiguousarray(emb), "lm_head": np.ascontiguousarray(head)},
              os.path.join(args.out, "model.safetensors"),
              metadata={"target_layer_ids": json.dumps(layers),
                        "num_target_layers": str(model.config.num_hidden_layers)})

    if args.dataset:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        pairs = ((tok(ex["prompt"], add_special_tokens=False)["input_ids"],
                  tok(ex["response"], add_special_tokens=False)["input_ids"])
                 for ex in load_dataset(args.dataset, split=args.split))
        samples = ((p + r, [0] * len(p) + [1] * len(r)) for p, r in pairs)
    else:
        def sample(ex):  # diffcp.data tokenize's {input_ids, loss_mask}, or {prompt_ids, response_ids}
            if "input_ids" in ex:
                return ex["input_ids"], ex["loss_mask"]
            return ex["prompt_ids"] + ex["response_ids"], [0] * len(ex["prompt_ids"]) + [1] * len(ex["response_ids"])
        samples = (sample(json.loads(line)) for line in open(args.token_jsonl) if line.strip())
    shard, buf = 0, []

    def flush():
        nonlocal shard, buf
        if not buf:
            return
        tokens = np.concatenate([b[0] for b in buf]).astype(np.int32)
        mask = np.concatenate([b[1] for b in buf]).astype(np.uint8)
        hidden = np.concatenate([b[2] for b in buf]).astype(np.float32)
        greedy = np.concatenate([b[3] for b in buf]).astype(np.int32)
        offsets = np.cumsum([0] + [len(b[0]) for b in buf]).astype(np.int64)
        save_file({"tokens": tokens, "loss_mask": mask, "offsets": offsets, "hidden": hidden,
                   "target_greedy": greedy},
                  os.path.join(args.out, f"shard_{shard:05d}.safetensors"))
        shard, buf = shard + 1, []

    lengths = []
    for n, (ids, mask) in enumerate(samples):
        if args.max_samples and n >= args.max_samples:
            break
        if args.max_length:
            ids, mask = ids[: args.max_length], mask[: args.max_length]
        lengths.append((len(ids), sum(mask)))
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        # hidden_states[0] is the embedding output; layer l's output is hidden_states[l + 1].
        h = torch.cat([out.hidden_states[l + 1][0] for l in layers], dim=-1).numpy()
        # The target's greedy token for position x is the argmax of its logits at x - 1.
        greedy = np.concatenate([[ids[0]], out.logits[0, :-1].argmax(-1).numpy()])
        buf.append((np.array(ids), np.array(mask), h, greedy))
        if len(buf) == args.samples_per_shard:
            flush()
    flush()
    print(f"wrote {shard} shard(s) and model.safetensors to {args.out}; target layers {layers}")
    if lengths:  # the packing statistics: how long the samples are and how many tokens they train
        ls = sorted(n for n, _ in lengths)
        print(f"{len(ls)} samples: tokens min {ls[0]}, median {ls[len(ls) // 2]}, max {ls[-1]}, total {sum(ls)}; "
              f"loss tokens {sum(m for _, m in lengths)}")


if __name__ == "__main__":
    main()
