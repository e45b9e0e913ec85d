#!/usr/bin/env python3
"""diffcp's DiT against diffusers' own models, from diffusers folders (issue #34).

Builds each family's transformer with a tiny random config (no hub: the class instantiated here):
FluxTransformer2DModel (FLUX.1-dev-like and -schnell-like), QwenImageTransformer2DModel
(Qwen-Image, with and without true classifier-free guidance) and Flux2Transformer2DModel (FLUX.2-dev-like
with its guidance embedding, and without one), SD3Transformer2DModel (SD3.5-large-like, with
classifier-free guidance and without) and WanTransformer3DModel (Wan 2.1-like text-to-video: its own
video sizes, steps and (P, mode) runs, see WAN); saves it as a diffusers pipeline
folder (model_index.json, transformer/, and scheduler/ with the published model's
FlowMatchEulerDiscreteScheduler config), and runs
`diffcp dit --weights FOLDER` under mpirun at each P and mode with `--dump-velocity`. For every
step k it computes diffusers' velocity at diffcp's own latent x_k (the noise plus diffcp's earlier
steps: each step is compared on the same input) with the timestep diffcp dumped, and reports the
relative error max|v_diffcp - v_diffusers| / max|v_diffusers|; diffcp's timesteps (from the
folder's scheduler_config.json) must equal the sigmas the family's pipeline sets on diffusers'
scheduler. Qwen-Image's guided velocity is QwenImagePipeline's: the negative prompt's pass, then
neg + g (cond - neg) rescaled per token to the conditional norm (retyped from pipeline_qwenimage.py,
whose module needs transformers to import); Wan's is WanPipeline's uncond + g (cond - uncond) at the
timestep 1000 sigma (float32, as the scheduler's timesteps), its sigmas set_timesteps(K)'s (static shift 3).

Needs torch and diffusers (PyPI) in a venv; CI does not install them (tools/flux_reference.py's
NumPy reference covers the same math there):

  python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch diffusers
  /tmp/venv/bin/python tools/diffusers_check.py --diffcp build/release/src/diffcp [--np 1,2,3,4] \
      [--families flux1,qwen_image,flux2,sd3,wan]

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
from diffusers import (Flux2Transformer2DModel, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel,
                       QwenImageTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel)
from diffusers.utils import logging as diffusers_logging

WIDTH, HEIGHT = 64, 48  # 4 x 3 = 12 image tokens: divisible by P = 1..4
TEXT_TOKENS = 12
NEG_TOKENS = 24  # Qwen-Image's negative prompt: another length than the prompt's
QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                      shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)


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


def tiny_qwen(seed: int) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.to(torch.float64).eval()


def tiny_flux2(guidance: bool, seed: int) -> Flux2Transformer2DModel:
    torch.manual_seed(seed)
    m = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                num_attention_heads=4, joint_attention_dim=48, timestep_guidance_channels=32,
                                mlp_ratio=3.0, axes_dims_rope=(2, 4, 6, 4), rope_theta=2000, guidance_embeds=guidance)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.to(torch.float64).eval()


def tiny_sd3(seed: int) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    m = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                              num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
                              pooled_projection_dim=24, out_channels=4, pos_embed_max_size=8, qk_norm="rms_norm")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.to(torch.float64).eval()


def tiny_wan(heads: int, cross_attn_norm: bool, seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    m = WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=12, in_channels=4, out_channels=4,
                              text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=cross_attn_norm)
    # its norms (attn's norm_q / norm_k, norm2) start at weight 1 and bias 0: perturb them more, so that
    # a dropped norm weight or bias shows
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.add_((0.3 if "norm" in n else 0.05) * torch.randn_like(p))
    return m.to(torch.float64).eval()


def save_pipeline(model, scheduler: FlowMatchEulerDiscreteScheduler, root: Path, pipeline: str) -> None:
    model.to(torch.float32).save_pretrained(root / "transformer")
    model.to(torch.float64)
    scheduler.save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps(
        {"_class_name": pipeline, "scheduler": ["diffusers", type(scheduler).__name__],
         "transformer": ["diffusers", type(model).__name__]}))


def flux2_mu(image_seq_len: int, steps: int) -> float:
    """Flux2Pipeline's compute_empirical_mu (pipeline_flux2.py), retyped."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return a2 * image_seq_len + b2
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return a * steps + (m_200 - 200.0 * a)


def pipeline_sigmas(scheduler: FlowMatchEulerDiscreteScheduler, steps: int, image_seq_len: int,
                    family: str = "flux1") -> np.ndarray:
    """The sigmas FluxPipeline.__call__ and QwenImagePipeline.__call__ set alike: linspace(1, 1/N, N)
    and mu from calculate_shift with the scheduler's config (pipeline_flux.py, pipeline_qwenimage.py;
    retyped here because importing the pipeline modules needs transformers)."""
    c = scheduler.config
    m = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (c.get("max_image_seq_len", 4096) - c.get("base_image_seq_len", 256))
    mu = image_seq_len * m + c.get("base_shift", 0.5) - m * c.get("base_image_seq_len", 256)
    if family == "flux2":
        mu = flux2_mu(image_seq_len, steps)
    if family in ("sd3", "wan"):  # StableDiffusion3Pipeline, WanPipeline: no sigmas (mu only with dynamic shifting)
        scheduler.set_timesteps(num_inference_steps=steps, mu=mu if c.get("use_dynamic_shifting") else None)
        return scheduler.sigmas.double().numpy()
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.sigmas.double().numpy()


def ids(n_txt: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, w = HEIGHT // 16, WIDTH // 16
    img = torch.zeros(h, w, 3, dtype=torch.float64)
    img[..., 1] += torch.arange(h, dtype=torch.float64)[:, None]
    img[..., 2] += torch.arange(w, dtype=torch.float64)[None, :]
    return img.reshape(h * w, 3), torch.zeros(n_txt, 3, dtype=torch.float64)


def diffusers_velocity(family: str, model, x: torch.Tensor, inputs: dict, t: float, guidance: float | None) -> torch.Tensor:
    """The velocity the family's pipeline steps with at latent x and sigma t."""
    tt = torch.tensor([t], dtype=torch.float64)
    if family == "flux1":
        img_ids, txt_ids = ids(inputs["txt_t"].shape[1])
        return model(hidden_states=x, encoder_hidden_states=inputs["txt_t"], pooled_projections=inputs["pooled_t"],
                     timestep=tt, img_ids=img_ids, txt_ids=txt_ids,
                     guidance=None if guidance is None else torch.tensor([guidance], dtype=torch.float64),
                     return_dict=False)[0]
    if family == "sd3":  # StableDiffusion3Pipeline: [uncond; cond] through the model, uncond + g (cond - uncond)
        def run(txt, pooled):
            return model(hidden_states=x, encoder_hidden_states=txt, pooled_projections=pooled, timestep=tt * 1000,
                         return_dict=False)[0]
        cond = run(inputs["txt_t"], inputs["pooled_t"])
        if guidance is None or guidance <= 1:
            return cond
        uncond = run(inputs["neg_t"], inputs["neg_pooled_t"])
        return uncond + guidance * (cond - uncond)
    if family == "wan":  # WanPipeline: the prompt's pass, then the negative prompt's; uncond + g (cond - uncond)
        def run_wan(txt):
            return model(hidden_states=x, timestep=torch.tensor([1000 * t], dtype=torch.float32),
                         encoder_hidden_states=txt, return_dict=False)[0]
        cond = run_wan(inputs["txt_t"])
        if guidance is None or guidance <= 1:
            return cond
        uncond = run_wan(inputs["neg_t"])
        return uncond + guidance * (cond - uncond)
    if family == "flux2":  # Flux2Pipeline's ids: text (0, 0, 0, l), image (0, h, w, 0)
        h, w, T = HEIGHT // 16, WIDTH // 16, inputs["txt_t"].shape[1]
        img_ids = torch.zeros(h * w, 4, dtype=torch.float64)
        img_ids[:, 1] = torch.arange(h, dtype=torch.float64).repeat_interleave(w)
        img_ids[:, 2] = torch.arange(w, dtype=torch.float64).repeat(h)
        txt_ids = torch.zeros(T, 4, dtype=torch.float64)
        txt_ids[:, 3] = torch.arange(T, dtype=torch.float64)
        return model(hidden_states=x, encoder_hidden_states=inputs["txt_t"], timestep=tt, img_ids=img_ids, txt_ids=txt_ids,
                     guidance=None if guidance is None else torch.tensor([guidance], dtype=torch.float64),
                     return_dict=False)[0]
    shapes = [[(1, HEIGHT // 16, WIDTH // 16)]]  # QwenImagePipeline's img_shapes for one image
    cond = model(hidden_states=x, encoder_hidden_states=inputs["txt_t"], timestep=tt, img_shapes=shapes,
                 return_dict=False)[0]
    if guidance is None or guidance <= 1:
        return cond
    neg = model(hidden_states=x, encoder_hidden_states=inputs["neg_t"], timestep=tt, img_shapes=shapes,
                return_dict=False)[0]
    comb = neg + guidance * (cond - neg)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def run_case(a, family: str, model, root: Path, inputs: dict, P: int, mode: str, guidance: float | None) -> list[float]:
    """The relative error of each step."""
    dump = root / f"dump_{P}_{mode}"
    width, height, steps = inputs.get("width", WIDTH), inputs.get("height", HEIGHT), inputs.get("steps", a.steps)
    cmd = ["mpirun", "-np", str(P), "--oversubscribe", a.diffcp, "dit", "--weights", str(root),
           "--text-embeddings", str(inputs["txt"]), "--noise", str(inputs["noise"]),
           "--width", str(width), "--height", str(height), "--steps", str(steps), "--mode", mode,
           "--dump-velocity", str(dump), "--out", ""]
    if family in ("flux1", "sd3"):
        cmd += ["--pooled", str(inputs["pooled"])]
    if family == "wan":
        cmd += ["--frames", str(inputs["frames"]), "--weights-dtype", "f32", "--group-size", "1"]
    if family in ("qwen_image", "sd3", "wan") and guidance is not None and guidance > 1:
        cmd += ["--negative-text-embeddings", str(inputs["neg"])]
        if family == "sd3":
            cmd += ["--negative-pooled", str(inputs["neg_pooled"])]
    if mode == "cocodiff":
        # V-Major's selective exchange from the second step (no warm-up steps, which run the full one;
        # step 0 always does), nothing cached: exact; its ratio curve is bench material
        cmd += ["--cache-schedule", "fixed", "--warmup", "0", "--cache-ratio", "0"]
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
    want_ts = pipeline_sigmas(inputs["scheduler"], steps, (width // 16) * (height // 16), family)
    if len(ts) != len(want_ts) or np.abs(np.array(ts) - want_ts).max() > 1e-6:  # diffusers' sigmas are float32
        raise RuntimeError(f"timesteps {ts} differ from the pipeline's {want_ts.tolist()}")
    x = torch.from_numpy(np.load(inputs["noise"]).astype(np.float64))
    sched = inputs["scheduler"]
    unipc = type(sched).__name__ == "UniPCMultistepScheduler"  # set_timesteps ran in pipeline_sigmas: a fresh state
    errs = []
    for k in range(steps):
        got = torch.from_numpy(np.load(dump / f"velocity_{k}.npy").astype(np.float64))
        # UniPC: the pipeline calls the transformer at the scheduler's int64 timestep
        t_model = float(sched.timesteps[k]) / 1000.0 if unipc else ts[k]
        with torch.no_grad():
            want = diffusers_velocity(family, model, x, inputs, t_model, guidance)
        errs.append(float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        if unipc:  # diffusers' own UniPC step on diffcp's velocity: diffcp's update must land where it does
            x = sched.step(got, sched.timesteps[k], x, return_dict=False)[0]
        else:
            x = x + (ts[k + 1] - ts[k]) * got  # diffcp's own trajectory: x_{k+1}
    return errs


# (family, case name, guidance, seed): FLUX.1-schnell-like (no guidance_in), FLUX.1-dev-like; Qwen-Image
# with true CFG at QwenImagePipeline's default scale 4 and a negative prompt, and one conditional pass.
CASES = [("flux1", "FLUX.1-schnell-like", None, 3), ("flux1", "FLUX.1-dev-like (guidance_embeds)", 3.5, 7),
         ("qwen_image", "Qwen-Image, true CFG 4 (negative prompt)", 4.0, 5), ("qwen_image", "Qwen-Image, guidance 1", 1.0, 9),
         ("flux2", "FLUX.2-dev-like (guidance_embeds, guidance 4)", 4.0, 13), ("flux2", "FLUX.2, no guidance embedding", None, 17),
         ("sd3", "SD3.5-large-like, CFG 7 (negative prompt)", 7.0, 19), ("sd3", "SD3.5-large-like, guidance 1", 1.0, 23),
         ("wan", "Wan 2.1-like, CFG 5 (negative prompt)", 5.0, 29), ("wan", "Wan, 6 heads, 20 tokens, CFG 5", 5.0, 31),
         ("wan", "Wan, cross_attn_norm false, guidance 1", 1.0, 37),
         ("wan", "Wan, UniPC (Wan's folder scheduler), CFG 5", 5.0, 41)]
# Wan's cases by name: heads, cross_attn_norm, (latent frames, width, height in px), steps, and the (P, mode)
# runs in place of --np x --modes (those of them that --np and --modes list). The 6-head case has
# 2 x (80/16) x (32/16) = 20 tokens, which P = 3 does not divide.
WAN = {"Wan 2.1-like, CFG 5 (negative prompt)": (4, True, (3, 64, 48), 3, [(1, "flat"), (2, "tapa")]),
       "Wan, 6 heads, 20 tokens, CFG 5": (6, True, (2, 32, 80), 2, [(3, "vfirst"), (3, "cocodiff")]),
       "Wan, cross_attn_norm false, guidance 1": (4, False, (3, 64, 48), 3, [(2, "flat")]),
       "Wan, UniPC (Wan's folder scheduler), CFG 5": (4, True, (3, 64, 48), 5, [(1, "flat"), (2, "tapa"),
                                                                              (3, "vfirst")])}


def build_case(family: str, name: str, guidance: float | None, seed: int, root: Path):
    rng = np.random.default_rng(11)
    inputs = {"txt": root / "txt.npy", "pooled": root / "pooled.npy", "neg": root / "neg.npy", "noise": root / "noise.npy"}
    if family == "wan":
        heads, cross_attn_norm, (inputs["frames"], inputs["width"], inputs["height"]), inputs["steps"], _ = WAN[name]
        model = tiny_wan(heads, cross_attn_norm, seed)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)  # Wan 2.1 T2V's flow shift
        if "UniPC" in name:  # what Wan2.1-T2V-*-Diffusers/scheduler holds
            from diffusers import UniPCMultistepScheduler
            scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                                num_train_timesteps=1000, solver_order=2)
        save_pipeline(model, scheduler, root, "WanPipeline")
        np.save(inputs["neg"], rng.standard_normal((NEG_TOKENS, 32)).astype(np.float32))
        inputs["neg_t"] = torch.from_numpy(np.load(inputs["neg"]).astype(np.float64))[None]
    elif family == "sd3":
        model = tiny_sd3(seed)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's
        save_pipeline(model, scheduler, root, "StableDiffusion3Pipeline")
        np.save(inputs["pooled"], rng.standard_normal(24).astype(np.float32))
        np.save(inputs["neg"], rng.standard_normal((NEG_TOKENS, 32)).astype(np.float32))
        np.save(root / "neg_pooled.npy", rng.standard_normal(24).astype(np.float32))
        inputs["neg_pooled"] = root / "neg_pooled.npy"
        for k in ("pooled", "neg", "neg_pooled"):
            inputs[k + "_t"] = torch.from_numpy(np.load(inputs[k]).astype(np.float64))[None]
    elif family == "flux2":
        model = tiny_flux2(guidance is not None, seed)
        # FLUX.2-dev's scheduler (Flux2Pipeline computes mu itself)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
        save_pipeline(model, scheduler, root, "Flux2Pipeline")
        np.save(inputs["txt"], rng.standard_normal((TEXT_TOKENS, 48)).astype(np.float32))
    elif family == "flux1":
        model = tiny_flux(guidance is not None, seed)
        # FLUX.1-dev's scheduler (dynamic shift) and FLUX.1-schnell's (shift 1, none)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True) if guidance \
            else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
        save_pipeline(model, scheduler, root, "FluxPipeline")
        np.save(inputs["pooled"], rng.standard_normal(24).astype(np.float32))
        inputs["pooled_t"] = torch.from_numpy(np.load(inputs["pooled"]).astype(np.float64))[None]
    else:
        model = tiny_qwen(seed)
        scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)  # Qwen/Qwen-Image's
        save_pipeline(model, scheduler, root, "QwenImagePipeline")
        np.save(inputs["neg"], rng.standard_normal((NEG_TOKENS, 32)).astype(np.float32))
        inputs["neg_t"] = torch.from_numpy(np.load(inputs["neg"]).astype(np.float64))[None]
    if family != "flux2":
        np.save(inputs["txt"], rng.standard_normal((TEXT_TOKENS, 32)).astype(np.float32))
    noise_shape = (1, 4, HEIGHT // 8, WIDTH // 8) if family == "sd3" else (1, (WIDTH // 16) * (HEIGHT // 16), 16)
    if family == "wan":
        noise_shape = (1, 4, inputs["frames"], inputs["height"] // 8, inputs["width"] // 8)
    np.save(inputs["noise"], rng.standard_normal(noise_shape).astype(np.float32))
    inputs["txt_t"] = torch.from_numpy(np.load(inputs["txt"]).astype(np.float64))[None]
    inputs["scheduler"] = scheduler
    return model, inputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--diffcp", default="build/release/src/diffcp")
    ap.add_argument("--np", default="1,2,3,4")
    ap.add_argument("--modes", default="flat,tapa,vfirst,cocodiff,usp")
    ap.add_argument("--families", default="flux1,qwen_image,flux2,sd3,wan")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    diffusers_logging.set_verbosity_error()  # its note on casting a model with .to(): float64 is what we want
    ok = True
    print(f"diffusers' transformers vs diffcp dit --weights <diffusers pipeline folder>; "
          f"{WIDTH}x{HEIGHT} px, {TEXT_TOKENS} text tokens (Qwen-Image's negative prompt: {NEG_TOKENS}), "
          f"{a.steps} steps (Wan: its cases' own), f32 in diffcp, float64 in diffusers")
    print("| model | P | mode | max relative error over the steps | per step | ok |")
    print("|---|---|---|---|---|---|")
    families, nps, modes = a.families.split(","), [int(p) for p in a.np.split(",")], a.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for k, (family, name, guidance, seed) in enumerate(CASES):
            if family not in families:
                continue
            root = Path(tmp) / f"case{k}"
            model, inputs = build_case(family, name, guidance, seed, root)
            runs = [(P, mode) for P in nps for mode in modes if not (mode == "usp" and P == 1)]  # U = R = 1 is flat
            if family == "wan":
                runs = [(P, mode) for P, mode in WAN[name][4] if P in nps and mode in modes]
            for P, mode in runs:
                errs = run_case(a, family, model, root, inputs, P, mode, guidance)
                good = max(errs) <= a.tol
                ok &= good
                print(f"| {name} | {P} | {mode} | {max(errs):.2e} | {' '.join(f'{e:.1e}' for e in errs)} | "
                      f"{'ok' if good else 'MISMATCH'} |", flush=True)
            # The check can fail: the final modulation stored as BFL's (shift, scale) instead of
            # diffusers' (scale, shift) must show as a mismatch (Wan's, scale_shift_table's rows, the other way).
            from safetensors.torch import load_file, save_file
            f = root / "transformer" / "diffusion_pytorch_model.safetensors"
            sd = load_file(str(f))
            for n in ("norm_out.linear.weight", "norm_out.linear.bias"):
                if n in sd:  # FLUX.2 has no biases
                    sd[n] = torch.cat(sd[n].chunk(2, dim=0)[::-1]).contiguous()
            if family == "wan":  # [1, 2, D]: (shift, scale)
                sd["scale_shift_table"] = sd["scale_shift_table"].flip(1).contiguous()
            save_file(sd, str(f))
            err = max(run_case(a, family, model, root, inputs, 1, "flat", guidance))
            caught = err > a.tol
            ok &= caught
            print(f"negative control, {name} (norm_out's scale and shift swapped in the file): relative error "
                  f"{err:.2e}, {'caught' if caught else 'NOT CAUGHT'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
