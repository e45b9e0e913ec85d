#!/usr/bin/env python3
"""Independent float64 NumPy reference of Stable Diffusion 3.5's transformer and its pipeline's sampler.

Re-expressed from diffusers' public sources (models/transformers/transformer_sd3.py:
SD3Transformer2DModel; models/attention.py: JointTransformerBlock; models/attention_processor.py:
JointAttnProcessor2_0; models/embeddings.py: PatchEmbed with its cropped sincos table,
CombinedTimestepTextProjEmbeddings; models/normalization.py: AdaLayerNormZero,
AdaLayerNormContinuous; pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py and
schedulers/scheduling_flow_match_euler_discrete.py: the sigmas, classifier-free guidance); it
shares no code with diffcp's C++ DiT and works directly on diffusers' tensor names and the latent
image layout. File helpers are flux_reference.py's. Shapes: B batch, C latent channels, latent
[B, C, H/8, W/8], N = (H/16)*(W/16) tokens, T text tokens, D = heads * head_dim.

  x    = conv_p(latent) + pos_embed[crop]                       (patch 2, the table centre-cropped)
  temb = timestep_embedder(sinusoid(1000 t)) + text_embedder(pooled)
  ctx  = context_embedder(encoder_hidden_states)
  blocks: AdaLayerNormZero per stream (shift, scale, gate) x 2; joint attention over [img; ctx] with
          RMS QK-norm, no RoPE; GELU-tanh FF. The last block's ctx stream is context-pre-only
          (AdaLayerNormContinuous: (scale, shift); no to_add_out, no FF).
  out  = unpatchify(proj_out(AdaLayerNormContinuous(x)))       -> [B, C, H/8, W/8]
  CFG  = uncond + g (cond - uncond)                              (StableDiffusion3Pipeline, g > 1)

  sd3_reference.py make   --out DIR [--dtype f32|bf16|f16] [--shards N] [--layers L] ...
  sd3_reference.py check  --weights DIR --txt T --pooled Y [--neg N --neg-pooled NY] --noise X
                          --width W --height H --steps K [--guidance G] --dump DIR [--tol 1e-4]
  sd3_reference.py header --config C --out DIR   (a data-less, real-shape transformer folder)

Exit codes: 0 pass, 1 mismatch, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusers_folder import (check_sampler_run, load_pipeline, random_tensors, rng,  # noqa: E402
                              write_header, write_pipeline)
from flux_reference import InputError, gelu_tanh, layer_norm, load_npy, silu  # noqa: E402

CLASS = "SD3Transformer2DModel"
EPS = 1e-6
DEFAULTS = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 18, "attention_head_dim": 64,
            "num_attention_heads": 18, "joint_attention_dim": 4096, "caption_projection_dim": 1152,
            "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 96,
            "dual_attention_layers": [], "qk_norm": None}
# stabilityai/stable-diffusion-3.5-large's scheduler/scheduler_config.json
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def read_config(c: dict, where: str) -> dict:
    if c.get("_class_name") != CLASS:
        raise InputError(f"{where}: _class_name {c.get('_class_name')!r}, expected {CLASS}")
    a = dict(DEFAULTS)
    for k, v in c.items():
        if k.startswith("_"):
            continue
        if k not in a:
            raise InputError(f"{where}: unknown field {k!r}")
        a[k] = v
    if a["dual_attention_layers"] or a["qk_norm"] != "rms_norm" or a["patch_size"] != 2 \
            or a["out_channels"] != a["in_channels"] \
            or a["caption_projection_dim"] != a["num_attention_heads"] * a["attention_head_dim"]:
        raise InputError(f"{where}: the reference models SD3.5-large's variant (no dual attention, rms_norm, patch 2, "
                         "out = in channels, caption projection = hidden size)")
    return a


def weight_shapes(a: dict) -> dict[str, tuple[int, ...]]:
    D, d, C, p = a["num_attention_heads"] * a["attention_head_dim"], a["attention_head_dim"], a["in_channels"], 2
    mx, L = a["pos_embed_max_size"], a["num_layers"]
    s: dict[str, tuple[int, ...]] = {}

    def lin(name: str, i: int, o: int) -> None:
        s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

    s["pos_embed.proj.weight"], s["pos_embed.proj.bias"] = (D, C, p, p), (D,)
    s["pos_embed.pos_embed"] = (1, mx * mx, D)
    lin("time_text_embed.timestep_embedder.linear_1", 256, D)
    lin("time_text_embed.timestep_embedder.linear_2", D, D)
    lin("time_text_embed.text_embedder.linear_1", a["pooled_projection_dim"], D)
    lin("time_text_embed.text_embedder.linear_2", D, D)
    lin("context_embedder", a["joint_attention_dim"], D)
    for i in range(L):
        b, last = f"transformer_blocks.{i}.", i == L - 1
        lin(b + "norm1.linear", D, 6 * D)
        lin(b + "norm1_context.linear", D, (2 if last else 6) * D)
        for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0"):
            lin(b + "attn." + n, D, D)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            s[b + "attn." + n + ".weight"] = (d,)
        lin(b + "ff.net.0.proj", D, 4 * D)
        lin(b + "ff.net.2", 4 * D, D)
        if not last:
            lin(b + "attn.to_add_out", D, D)
            lin(b + "ff_context.net.0.proj", D, 4 * D)
            lin(b + "ff_context.net.2", 4 * D, D)
    lin("norm_out.linear", D, 2 * D)
    lin("proj_out", D, p * p * C)
    return s


def sinusoid(t: float, dim: int = 256) -> np.ndarray:
    """Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0) of the timestep 1000 t: [cos, sin]."""
    half = dim // 2
    arg = 1000.0 * t * np.exp(-math.log(10000.0) * np.arange(half) / half)
    return np.concatenate([np.cos(arg), np.sin(arg)])


class SD3Reference:
    def __init__(self, a: dict, w: dict[str, np.ndarray]):
        self.a, self.w = a, w
        self.h, self.d = a["num_attention_heads"], a["attention_head_dim"]

    def lin(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def rms(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * self.w[name + ".weight"]

    def forward(self, lat: np.ndarray, enc: np.ndarray, pooled: np.ndarray, t: float) -> np.ndarray:
        """lat [B, C, H8, W8], enc [T, J], pooled [P] -> velocity [B, C, H8, W8]."""
        B, C, H8, W8 = lat.shape
        gh, gw, D, mx = H8 // 2, W8 // 2, self.h * self.d, self.a["pos_embed_max_size"]
        if gh > mx or gw > mx:
            raise InputError(f"a {gw} x {gh} token grid exceeds pos_embed_max_size {mx}")
        # conv with kernel = stride = 2 as patches [B, gh, gw, C, 2, 2] against W [D, C, 2, 2]
        patches = lat.reshape(B, C, gh, 2, gw, 2).transpose(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * 4)
        x = patches @ self.w["pos_embed.proj.weight"].reshape(D, -1).T + self.w["pos_embed.proj.bias"]
        top, left = (mx - gh) // 2, (mx - gw) // 2
        table = self.w["pos_embed.pos_embed"].reshape(mx, mx, D)
        x = x + table[top:top + gh, left:left + gw].reshape(1, gh * gw, D)
        temb = self.lin("time_text_embed.timestep_embedder.linear_2",
                        silu(self.lin("time_text_embed.timestep_embedder.linear_1", sinusoid(t))))
        temb = temb + self.lin("time_text_embed.text_embedder.linear_2",
                               silu(self.lin("time_text_embed.text_embedder.linear_1", pooled)))
        st = silu(temb)
        c = np.repeat(self.lin("context_embedder", enc)[None], B, 0)
        N, T, L = gh * gw, enc.shape[0], self.a["num_layers"]
        for i in range(L):
            b, last = f"transformer_blocks.{i}.", i == L - 1
            m = self.lin(b + "norm1.linear", st).reshape(6, D)  # shift, scale, gate (msa), shift, scale, gate (mlp)
            xn = layer_norm(x) * (1 + m[1]) + m[0]
            if last:
                scale, shift = self.lin(b + "norm1_context.linear", st).reshape(2, D)
                cn = layer_norm(c) * (1 + scale) + shift
            else:
                mc = self.lin(b + "norm1_context.linear", st).reshape(6, D)
                cn = layer_norm(c) * (1 + mc[1]) + mc[0]

            def heads(name, y):
                return self.lin(b + "attn." + name, y).reshape(B, y.shape[1], self.h, self.d)

            q = np.concatenate([self.rms(heads("to_q", xn), b + "attn.norm_q"),
                                self.rms(heads("add_q_proj", cn), b + "attn.norm_added_q")], 1).transpose(0, 2, 1, 3)
            k = np.concatenate([self.rms(heads("to_k", xn), b + "attn.norm_k"),
                                self.rms(heads("add_k_proj", cn), b + "attn.norm_added_k")], 1).transpose(0, 2, 1, 3)
            v = np.concatenate([heads("to_v", xn), heads("add_v_proj", cn)], 1).transpose(0, 2, 1, 3)
            s = q @ k.swapaxes(-1, -2) / math.sqrt(self.d)
            pr = np.exp(s - s.max(-1, keepdims=True))
            o = ((pr / pr.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, N + T, D)  # [img; ctx]
            x = x + m[2] * self.lin(b + "attn.to_out.0", o[:, :N])
            x = x + m[5] * self.lin(b + "ff.net.2", gelu_tanh(self.lin(b + "ff.net.0.proj", layer_norm(x) * (1 + m[4]) + m[3])))
            if not last:
                c = c + mc[2] * self.lin(b + "attn.to_add_out", o[:, N:])
                c = c + mc[5] * self.lin(b + "ff_context.net.2",
                                         gelu_tanh(self.lin(b + "ff_context.net.0.proj", layer_norm(c) * (1 + mc[4]) + mc[3])))
        scale, shift = self.lin("norm_out.linear", st).reshape(2, D)
        y = self.lin("proj_out", layer_norm(x) * (1 + scale) + shift)  # [B, N, (p, q, c)]
        return y.reshape(B, gh, gw, 2, 2, C).transpose(0, 5, 1, 3, 2, 4).reshape(B, C, H8, W8)


def sd3_sigmas(sched: dict, steps: int) -> list[float]:
    """StableDiffusion3Pipeline's sigmas (no explicit sigmas; static shift): the scheduler spaces
    linspace(sigma_max, sigma_min, N) over its shifted training sigmas, then shifts them, then 0."""
    if sched.get("use_dynamic_shifting") or sched.get("shift_terminal") or sched.get("num_train_timesteps", 1000) != 1000:
        raise InputError("the reference models SD3.5's scheduler (static shift, 1000 training steps)")
    shift = sched.get("shift", 1.0)

    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    grid = np.linspace(shifted(1.0), shifted(1.0 / 1000), steps)
    return [float(v) for v in shifted(grid)] + [0.0]


def load_folder(path: Path, header_only: bool = False) -> tuple[dict, dict[str, np.ndarray], dict | None]:
    a, w, sched = load_pipeline(path, read_config, weight_shapes, header_only)
    return a, w, json.loads(sched.read_text()) if sched else None


def cmd_make(a: argparse.Namespace) -> int:
    D = a.heads * a.head_dim
    cfg = {"_class_name": CLASS, "sample_size": 8, "patch_size": 2, "in_channels": a.channels, "num_layers": a.layers,
           "attention_head_dim": a.head_dim, "num_attention_heads": a.heads, "joint_attention_dim": a.joint_dim,
           "caption_projection_dim": D, "pooled_projection_dim": a.pooled_dim, "out_channels": a.channels,
           "pos_embed_max_size": a.pos_max, "dual_attention_layers": [], "qk_norm": "rms_norm"}
    try:
        p = read_config(cfg, "make")
        if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or min(a.text_tokens, a.neg_tokens, a.batch) <= 0:
            raise InputError("width / height must be positive multiples of 16; token counts and batch positive")
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 2

    tensors = random_tensors(weight_shapes(p), a.seed)
    out, dtype = Path(a.out), a.dtype.upper()
    try:
        write_pipeline(out, cfg, "StableDiffusion3Pipeline", SCHEDULER, tensors, dtype, a.shards, read_config, weight_shapes)
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 1
    J, P = a.joint_dim, a.pooled_dim
    np.save(out / "txt.npy", rng(a.seed, "input.txt").standard_normal((a.text_tokens, J)).astype(np.float32))
    np.save(out / "pooled.npy", rng(a.seed, "input.pooled").standard_normal(P).astype(np.float32))
    np.save(out / "neg.npy", rng(a.seed, "input.neg").standard_normal((a.neg_tokens, J)).astype(np.float32))
    np.save(out / "neg_pooled.npy", rng(a.seed, "input.neg_pooled").standard_normal(P).astype(np.float32))
    np.save(out / "noise.npy", rng(a.seed, "input.noise").standard_normal(
        (a.batch, a.channels, a.height // 8, a.width // 8)).astype(np.float32))
    print(f"make: {len(tensors)} tensors ({dtype}, {a.shards} file(s)), {(a.height // 16) * (a.width // 16)} tokens -> {out}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    p, w, sched = load_folder(Path(a.weights))
    if sched is None:
        raise InputError(f"{a.weights}: a pipeline folder with scheduler/scheduler_config.json is needed")
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or a.steps <= 0:
        raise InputError(f"width {a.width} / height {a.height} must be multiples of 16, steps > 0")
    J, P, C = p["joint_attention_dim"], p["pooled_projection_dim"], p["in_channels"]
    txt = load_npy(Path(a.txt), [(None, J), (1, None, J)]).reshape(-1, J)
    pooled = load_npy(Path(a.pooled), [(P,), (1, P)]).reshape(-1)
    cfg = a.neg is not None and a.guidance > 1
    if cfg:
        neg = load_npy(Path(a.neg), [(None, J), (1, None, J)]).reshape(-1, J)
        neg_pooled = load_npy(Path(a.neg_pooled), [(P,), (1, P)]).reshape(-1)
    x = load_npy(Path(a.noise), [(None, C, a.height // 8, a.width // 8)])
    model = SD3Reference(p, w)

    def velocity(x, s):
        v = model.forward(x, txt, pooled, s)
        if not cfg:
            return v
        vu = model.forward(x, neg, neg_pooled, s)
        return vu + a.guidance * (v - vu)
    return check_sampler_run(Path(a.dump), x, sd3_sigmas(sched, a.steps), velocity, a.tol,
                             f"CFG {a.guidance}" if cfg else "no CFG")


def cmd_header(a: argparse.Namespace) -> int:
    return write_header(a.config, Path(a.out), read_config, weight_shapes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random tiny SD3.5 pipeline folder and inputs")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    for name, default in (("shards", 1), ("layers", 2), ("heads", 4), ("head-dim", 16), ("joint-dim", 32),
                          ("pooled-dim", 24), ("channels", 4), ("pos-max", 8), ("width", 64), ("height", 48),
                          ("text-tokens", 8), ("neg-tokens", 4), ("batch", 1), ("seed", 0)):
        m.add_argument(f"--{name}", type=int, default=default)
    c = sub.add_parser("check", help="compare diffcp's dumped sampler run with the reference")
    for name in ("weights", "txt", "pooled", "noise", "dump"):
        c.add_argument(f"--{name}", required=True)
    c.add_argument("--neg")
    c.add_argument("--neg-pooled")
    for name in ("width", "height", "steps"):
        c.add_argument(f"--{name}", type=int, required=True)
    c.add_argument("--guidance", type=float, default=7.0)
    c.add_argument("--tol", type=float, default=1e-4)
    hd = sub.add_parser("header", help="write a data-less BF16 transformer folder of a config's real shape")
    hd.add_argument("--config", required=True)
    hd.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        return {"make": cmd_make, "check": cmd_check, "header": cmd_header}[a.cmd](a)
    except InputError as e:
        print(f"{a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
