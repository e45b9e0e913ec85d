#!/usr/bin/env python3
"""One DiT step on a GPU: diffcp's CUDA backend vs diffusers' FluxTransformer2DModel, same model (issue #55).

Runs on a lent GPU from scripts/gpu_check.sh (the device image's python3 with PyTorch; diffusers
carried as wheels); never in CI. FLUX.1's real width (H 3072 = 24 heads x 128, MLP 4H, text 4096,
pooled 768, guidance_embeds) at reduced depth (--double double-stream, --single single-stream
blocks), a --resolution^2 image (1024: 4096 image tokens) and --text-tokens text tokens, random
weights saved as a diffusers folder that diffcp reads (`diffcp dit --weights DIR`), bf16:
  - diffusers: the transformer's forward in bf16 on cuda, eager, and with --compile torch.compile
    (default mode); median of --reps after warm-ups, CUDA-synchronised;
  - diffcp: `diffcp --backend cuda dit --dtype bf16 --weights-dtype bf16 --steps REPS --json` at
    P = 1 (its step_ms: the median step).
One JSON line on stdout.

  python3 bench/bench_gpu_dit.py --diffcp PATH/diffcp [--compile] [--reps 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diffcp", required=True)
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to rehearse the script (diffcp --backend cpu)")
    a = ap.parse_args()

    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    model = FluxTransformer2DModel(num_layers=a.double, num_single_layers=a.single, guidance_embeds=True).eval()
    n_img, T, side = (a.resolution // 16) ** 2, a.text_tokens, a.resolution // 16
    rng = np.random.default_rng(0)
    txt = rng.standard_normal((T, 4096)).astype(np.float32)
    pooled = rng.standard_normal(768).astype(np.float32)
    noise = rng.standard_normal((1, n_img, 64)).astype(np.float32)
    r = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "double": a.double, "single": a.single,
         "image_tokens": n_img, "text_tokens": T, "reps": a.reps,
         "parameters": sum(p.numel() for p in model.parameters())}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "transformer")
        (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                           "transformer": ["diffusers", "FluxTransformer2DModel"]}))
        for name, x in (("txt", txt), ("pooled", pooled), ("noise", noise)):
            np.save(root / f"{name}.npy", x)
        model = model.to(dev, torch.bfloat16)
        ids = torch.zeros(side, side, 3)
        ids[..., 1] += torch.arange(side)[:, None]
        ids[..., 2] += torch.arange(side)[None, :]
        bf = dict(device=dev, dtype=torch.bfloat16)
        inputs = dict(hidden_states=torch.from_numpy(noise).to(**bf), encoder_hidden_states=torch.from_numpy(txt)[None].to(**bf),
                      pooled_projections=torch.from_numpy(pooled)[None].to(**bf), timestep=torch.tensor([1.0], **bf),
                      img_ids=ids.reshape(-1, 3).to(dev), txt_ids=torch.zeros(T, 3, device=dev),
                      guidance=torch.tensor([3.5], **bf), return_dict=False)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def timed(fn, warm=2):
            with torch.no_grad():
                for _ in range(warm):
                    fn(**inputs)
                sync()
                t = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    fn(**inputs)
                    sync()
                    t.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(t)

        r["diffusers_eager_ms"] = timed(model)
        if a.compile:
            r["diffusers_compile_ms"] = timed(torch.compile(model), warm=3)
        del model
        if cuda:
            torch.cuda.empty_cache()
        cmd = [a.diffcp, "--backend", "cuda" if cuda else "cpu", "dit", "--weights", str(root), "--text-embeddings", str(root / "txt.npy"),
               "--pooled", str(root / "pooled.npy"), "--noise", str(root / "noise.npy"), "--resolution", str(a.resolution),
               "--steps", str(a.reps + 1), "--dtype", "bf16", "--weights-dtype", "bf16", "--json", "--out", ""]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            r["diffcp_error"] = (out.stderr or out.stdout)[-2000:]
        else:
            j = json.loads(out.stdout[out.stdout.index("{"):])
            r["diffcp_step_ms"] = j["step_ms"]
            r["diffcp_vs_eager"] = r["diffusers_eager_ms"] / j["step_ms"]
            if "diffusers_compile_ms" in r:
                r["diffcp_vs_compile"] = r["diffusers_compile_ms"] / j["step_ms"]
    print(json.dumps(r))


if __name__ == "__main__":
    main()
