#!/usr/bin/env python3
"""diffcp's DiT against diffusers' own model, from a diffusers folder (issue #34).

Builds FluxTransformer2DModel with a tiny random config (no hub: the class instantiated here),
saves it as a diffusers pipeline folder (model_index.json, transformer/, and scheduler/ with
FLUX.1-dev's or FLUX.1-schnell's FlowMatchEulerDiscreteScheduler), and runs
`diffcp dit --weights FOLDER` under mpirun at each P and mode with `--dump-velocity`. For every
step k it computes diffusers' velocity at diffcp's own latent x_k (the noise plus diffcp's earlier
steps: each step is compared on the same input) with the timestep diffcp dumped, and reports the
relative error max|v_diffcp - v_diffusers| / max|v_diffusers|; diffcp's timesteps (from the
folder's scheduler_config.json) must equal the sigmas FluxPipeline sets on diffusers' scheduler.

Needs torch and diffusers (PyPI) in a venv; CI does not install them (tools/flux_reference.py's
NumPy reference covers the same math there):

  python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch diffusers
  /tmp/venv/bin/python tools/diffusers_check.py --diffcp build/release/src/diffcp [--np 1,2,3,4]

Exit codes: 0 every case within --tol (default 1e-4), 1 a mismatch, 2 a run failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.utils import logging as diffusers_logging

WIDTH, HEIGHT = 64, 48  # 4 x 3 = 12 image tokens: divisible by P = 1..4
TEXT_TOKENS = 12


def tiny_flux(guidance: bool, seed: int) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                               num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=24,
                               guidance_embeds=guidance, axes_dims_rope=(4, 6, 6))
    # diffusers zero-initialises nothing that matters here, but its random init is small: scale the
    # weights up so that every block changes the output (a dropped block must show).
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.to(torch.float64).eval()


def save_pipeline(model: FluxTransformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler, root: Path) -> None:
    model.to(torch.float32).save_pretrained(root / "transformer")
    model.to(torch.float64)
    scheduler.save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps(
        {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "transformer": ["diffusers", "FluxTransformer2DModel"]}))


def pipeline_sigmas(scheduler: FlowMatchEulerDiscreteScheduler, steps: int, image_seq_len: int) -> np.ndarray:
    """The sigmas FluxPipeline.__call__ sets: linspace(1, 1/N, N) and mu from calculate_shift
    (pipeline_flux.py; retyped here because importing the pipeline module needs transformers)."""
    c = scheduler.config
    m = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (c.get("max_image_seq_len", 4096) - c.get("base_image_seq_len", 256))
    mu = image_seq_len * m + c.get("base_shift", 0.5) - m * c.get("base_image_seq_len", 256)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas.double().numpy()


def ids(n_txt: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, w = HEIGHT // 16, WIDTH // 16
    img = torch.zeros(h, w, 3, dtype=torch.float64)
    img[..., 1] += torch.arange(h, dtype=torch.float64)[:, None]
    img[..., 2] += torch.arange(w, dtype=torch.float64)[None, :]
    return img.reshape(h * w, 3), torch.zeros(n_txt, 3, dtype=torch.float64)


def run_case(a, model, root: Path, inputs: dict, P: int, mode: str, guidance: float | None) -> float:
    dump = root / f"dump_{P}_{mode}"
    cmd = ["mpirun", "-np", str(P), "--oversubscribe", a.diffcp, "dit", "--weights", str(root),
           "--text-embeddings", str(inputs["txt"]), "--pooled", str(inputs["pooled"]), "--noise", str(inputs["noise"]),
           "--width", str(WIDTH), "--height", str(HEIGHT), "--steps", str(a.steps), "--mode", mode,
           "--dump-velocity", str(dump), "--out", ""]
    if mode == "cocodiff":
        cmd += ["--cache-ratio", "0"]  # V-Major with nothing cached: exact; its ratio curve is bench material
    if mode == "usp":  # Ulysses x Ring with U = 1: Ring attention over all ranks
        cmd[cmd.index("--mode") + 1] = "flat"
        cmd += ["--ulysses-degree", "1", "--ring-degree", str(P)]
    if guidance is not None:
        cmd += ["--guidance", str(guidance)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(r.stdout + r.stderr, file=sys.stderr)
        raise RuntimeError(f"diffcp failed: {' '.join(cmd)}")
    ts = json.loads((dump / "timesteps.json").read_text())["timesteps"]
    want_ts = pipeline_sigmas(inputs["scheduler"], a.steps, (WIDTH // 16) * (HEIGHT // 16))
    if len(ts) != len(want_ts) or np.abs(np.array(ts) - want_ts).max() > 1e-6:  # diffusers' sigmas are float32
        raise RuntimeError(f"timesteps {ts} differ from FluxPipeline's {want_ts.tolist()}")
    x = torch.from_numpy(np.load(inputs["noise"]).astype(np.float64))
    txt = torch.from_numpy(np.load(inputs["txt"]).astype(np.float64))[None]
    pooled = torch.from_numpy(np.load(inputs["pooled"]).astype(np.float64))[None]
    img_ids, txt_ids = ids(txt.shape[1])
    worst = 0.0
    for k in range(a.steps):
        got = torch.from_numpy(np.load(dump / f"velocity_{k}.npy").astype(np.float64))
        with torch.no_grad():
            want = model(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled,
                         timestep=torch.tensor([ts[k]], dtype=torch.float64), img_ids=img_ids, txt_ids=txt_ids,
                         guidance=None if guidance is None else torch.tensor([guidance], dtype=torch.float64),
                         return_dict=False)[0]
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        x = x + (ts[k + 1] - ts[k]) * got  # diffcp's own trajectory: x_{k+1}
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--np", default="1,2,3,4")
    ap.add_argument("--modes", default="flat,tapa,vfirst,cocodiff,usp")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    diffusers_logging.set_verbosity_error()  # its note on casting a model with .to(): float64 is what we want
    ok = True
    print(f"diffusers FluxTransformer2DModel vs diffcp dit --weights <diffusers pipeline folder>; "
          f"{WIDTH}x{HEIGHT} px, {TEXT_TOKENS} text tokens, {a.steps} steps, f32 in diffcp, float64 in diffusers")
    print("| model | P | mode | max relative error over the steps | ok |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for guidance in (None, 3.5):  # FLUX.1-schnell-like (no guidance_in) and FLUX.1-dev-like
            root = Path(tmp) / ("dev" if guidance else "schnell")
            model = tiny_flux(guidance is not None, seed=7 if guidance else 3)
            # FLUX.1-dev's scheduler (dynamic shift) and FLUX.1-schnell's (shift 1, none)
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True) if guidance \
                else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
            save_pipeline(model, scheduler, root)
            rng = np.random.default_rng(11)
            inputs = {"txt": root / "txt.npy", "pooled": root / "pooled.npy", "noise": root / "noise.npy",
                      "scheduler": scheduler}
            np.save(inputs["txt"], rng.standard_normal((TEXT_TOKENS, 32)).astype(np.float32))
            np.save(inputs["pooled"], rng.standard_normal(24).astype(np.float32))
            np.save(inputs["noise"], rng.standard_normal((1, (WIDTH // 16) * (HEIGHT // 16), 16)).astype(np.float32))
            for P in [int(p) for p in a.np.split(",")]:
                for mode in a.modes.split(","):
                    if mode == "usp" and P == 1:
                        continue  # U = R = 1 is flat
                    err = run_case(a, model, root, inputs, P, mode, guidance)
                    good = err <= a.tol
                    ok &= good
                    name = "FLUX.1-dev-like (guidance_embeds)" if guidance else "FLUX.1-schnell-like"
                    print(f"| {name} | {P} | {mode} | {err:.2e} | {'ok' if good else 'MISMATCH'} |", flush=True)
        # The check can fail: the final modulation stored as BFL's (shift, scale) instead of
        # diffusers' (scale, shift) must show as a mismatch.
        from safetensors.torch import load_file, save_file
        f = root / "transformer" / "diffusion_pytorch_model.safetensors"
        sd = load_file(str(f))
        for n in ("norm_out.linear.weight", "norm_out.linear.bias"):
            sd[n] = torch.cat(sd[n].chunk(2, dim=0)[::-1]).contiguous()
        save_file(sd, str(f))
        err = run_case(a, model, root, inputs, 1, "flat", guidance)
        caught = err > a.tol
        ok &= caught
        print(f"negative control (norm_out's scale and shift swapped in the file): relative error {err:.2e}, "
              f"{'caught' if caught else 'NOT CAUGHT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
