#!/usr/bin/env python3
"""One DiT transformer step, diffcp vs diffusers' own forward on the CPU, same shape, same run (issue #34).

Shape-faithful at reduced depth, per family (--family):
  flux1:      FLUX.1's real width (H 3072 = 24 heads x 128, MLP 4H, text 4096, pooled 768, RoPE axes
              16/56/56, guidance_embeds) with DOUBLE double-stream and SINGLE single-stream blocks;
  qwen_image: Qwen-Image's real width (H 3072 = 24 heads x 128, MLP 4H, text 3584, RoPE axes
              16/56/56) with DOUBLE double-stream blocks, one conditional pass (--guidance 1: the
              transformer's forward; classifier-free guidance runs it twice);
  flux2:      FLUX.2-dev's real width (H 6144 = 48 heads x 128, SwiGLU MLP 3H, text 15360, RoPE axes
              32/32/32/32, guidance_embeds) with DOUBLE double- and SINGLE single-stream blocks;
  sd3:        SD3.5-large's real width (H 2432 = 38 heads x 64, MLP 4H, text 4096, pooled 2048, the
              192^2 position table, RMS QK-norm) with DOUBLE blocks (the last one context-pre-only),
              one conditional pass (--guidance 1), the latent [1, 16, 128, 128];
a 1024 x 1024 image (4096 image tokens) and 512 text tokens. The model is diffusers' class with
random weights, saved as a diffusers folder that diffcp reads (`diffcp dit --weights DIR`). Timed,
interleaved ROUNDS times (diffusers' model is loaded from the folder for its timing and freed before
diffcp runs, so the two never hold the weights at once):
  - diffusers: one forward in float32, torch.set_num_threads(CORES), no grad (the median of the round's
    REPS forwards);
  - diffcp: `dit --json` with --steps REPS (its step_ms: the median step, slowest rank) at P = 1
    (unbound, OMP_NUM_THREADS = CORES) and P = 2 (--bind-to core, CORES / 2 threads each), flat
    and every CoCoDiff mode, with
    the bytes per rank per step it measures and its closed form (every rank its own group:
    --group-size 1, so all bytes cross groups).
Writes CSV (default bench/diffusers_flux_step.csv, bench/diffusers_qwen_image_step.csv) and prints
medians and ratios.

  V/bin/python bench/bench_diffusers_step.py --family flux1|qwen_image --diffcp build/release/src/diffcp [--rounds 3]
Needs torch and diffusers (PyPI) in a venv, ~8 GB (flux1 1 + 1 blocks) / ~10 GB (qwen_image 2 blocks) of memory.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import gc

from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel
from diffusers.utils import logging as diffusers_logging


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--family", choices=["flux1", "qwen_image", "flux2", "sd3"], default="flux1")
    ap.add_argument("--double", type=int, help="double-stream blocks (default: flux1 1, qwen_image 2)")
    ap.add_argument("--single", type=int, default=1, help="flux1's single-stream blocks")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--modes", default="flat,tapa,vfirst,cocodiff")
    ap.add_argument("--csv")
    a = ap.parse_args()
    flux, flux2, sd3 = a.family == "flux1", a.family == "flux2", a.family == "sd3"
    a.double = a.double if a.double is not None else 2 if a.family in ("qwen_image", "sd3") else 1
    a.csv = a.csv or ("bench/diffusers_flux_step.csv" if flux else f"bench/diffusers_{a.family}_step.csv")
    diffusers_logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    torch.set_num_threads(a.cores)
    torch.manual_seed(0)
    cls = {"flux1": FluxTransformer2DModel, "flux2": Flux2Transformer2DModel, "qwen_image": QwenImageTransformer2DModel,
           "sd3": SD3Transformer2DModel}[a.family]
    if sd3:  # SD3.5-large's config but its depth
        model = cls(num_layers=a.double, attention_head_dim=64, num_attention_heads=38, caption_projection_dim=2432,
                    pos_embed_max_size=192, qk_norm="rms_norm").eval()
    elif flux or flux2:
        model = cls(num_layers=a.double, num_single_layers=a.single, guidance_embeds=True).eval()
    else:
        model = cls(num_layers=a.double).eval()
    n_img, T = (a.resolution // 16) ** 2, a.text_tokens
    J = 4096 if flux or sd3 else 15360 if flux2 else 3584  # joint_attention_dim
    C = 128 if flux2 else 64  # in_channels
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "transformer")
        del model
        gc.collect()
        pipeline = {"flux1": "FluxPipeline", "flux2": "Flux2Pipeline", "qwen_image": "QwenImagePipeline",
                    "sd3": "StableDiffusion3Pipeline"}[a.family]
        (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline, "transformer": ["diffusers", cls.__name__]}))
        txt = rng.standard_normal((T, J)).astype(np.float32)
        pooled = rng.standard_normal(2048 if sd3 else 768).astype(np.float32)
        side8 = a.resolution // 8
        noise = rng.standard_normal((1, 16, side8, side8) if sd3 else (1, n_img, C)).astype(np.float32)
        for name, x in (("txt", txt), ("pooled", pooled), ("noise", noise)):
            np.save(root / f"{name}.npy", x)
        side = a.resolution // 16
        img_ids = torch.zeros(side, side, 3)
        img_ids[..., 1] += torch.arange(side)[:, None]
        img_ids[..., 2] += torch.arange(side)[None, :]
        img_ids = img_ids.reshape(-1, 3)
        if flux:
            inputs = dict(hidden_states=torch.from_numpy(noise), encoder_hidden_states=torch.from_numpy(txt)[None],
                          pooled_projections=torch.from_numpy(pooled)[None], timestep=torch.tensor([1.0]),
                          img_ids=img_ids, txt_ids=torch.zeros(T, 3), guidance=torch.tensor([3.5]), return_dict=False)
        elif sd3:
            inputs = dict(hidden_states=torch.from_numpy(noise), encoder_hidden_states=torch.from_numpy(txt)[None],
                          pooled_projections=torch.from_numpy(pooled)[None], timestep=torch.tensor([1000.0]),
                          return_dict=False)
        elif flux2:
            ids4 = torch.zeros(side * side, 4)
            ids4[:, 1:3] = img_ids[:, 1:3]
            txt4 = torch.zeros(T, 4)
            txt4[:, 3] = torch.arange(T)
            inputs = dict(hidden_states=torch.from_numpy(noise), encoder_hidden_states=torch.from_numpy(txt)[None],
                          timestep=torch.tensor([1.0]), img_ids=ids4, txt_ids=txt4, guidance=torch.tensor([4.0]),
                          return_dict=False)
        else:
            inputs = dict(hidden_states=torch.from_numpy(noise), encoder_hidden_states=torch.from_numpy(txt)[None],
                          timestep=torch.tensor([1.0]), img_shapes=[[(1, side, side)]], return_dict=False)
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        for r in range(a.rounds):
            times = []
            model = cls.from_pretrained(root / "transformer", torch_dtype=torch.float32).eval()
            for _ in range(a.reps):
                t0 = time.perf_counter()
                model(**inputs)
                times.append(1e3 * (time.perf_counter() - t0))
            del model
            gc.collect()
            rows.append({"round": r, "impl": "diffusers", "P": 1, "mode": "-", "step_ms": statistics.median(times),
                         "bytes_inter_group": "", "predicted_bytes_inter_group": ""})
            print(rows[-1], flush=True)
            for P in (1, 2):
                for mode in a.modes.split(",") if P > 1 else ["flat"]:
                    # P = 1: unbound (Open MPI would bind the one rank to one core); P = 2: a core each.
                    cmd = ["mpirun", "-np", str(P), "--bind-to", "none" if P == 1 else "core", a.diffcp, "dit", "--weights", str(root),
                           "--text-embeddings", str(root / "txt.npy"),
                           "--noise", str(root / "noise.npy"), "--resolution", str(a.resolution), "--steps", str(a.reps),
                           "--mode", mode, "--group-size", "1", "--json", "--out", ""]
                    cmd += (["--pooled", str(root / "pooled.npy")] if flux or sd3 else []) + ([] if flux or flux2 else ["--guidance", "1"])
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                         env=dict(env, OMP_NUM_THREADS=str(max(1, a.cores // P)))).stdout
                    j = json.loads(out[out.index("{"):])
                    rows.append({"round": r, "impl": "diffcp", "P": P, "mode": mode, "step_ms": j["step_ms"],
                                 "bytes_inter_group": j["bytes_inter_group"],
                                 "predicted_bytes_inter_group": j["predicted_bytes_inter_group"]})
                    print(rows[-1], flush=True)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = statistics.median(x["step_ms"] for x in rows if x["impl"] == "diffusers")
    print("\n| implementation | P | mode | median step ms | diffusers / this | bytes per rank per step (measured / closed form) |")
    print("|---|---|---|---|---|---|")
    print(f"| diffusers {cls.__name__} (torch {torch.__version__}) | 1 | - | {base:.0f} | 1.00 | - |")
    keys = sorted({(x["P"], x["mode"]) for x in rows if x["impl"] == "diffcp"})
    for P, mode in keys:
        sel = [x for x in rows if x["impl"] == "diffcp" and x["P"] == P and x["mode"] == mode]
        m = statistics.median(x["step_ms"] for x in sel)
        print(f"| diffcp | {P} | {mode} | {m:.0f} | {base / m:.2f} | "
              f"{sel[0]['bytes_inter_group']:.0f} / {sel[0]['predicted_bytes_inter_group']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
