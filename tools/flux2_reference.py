#!/usr/bin/env python3
"""Independent float64 NumPy reference of FLUX.2's transformer and its pipeline's sampler.

Re-expressed from diffusers' public sources (models/transformers/transformer_flux2.py:
Flux2Transformer2DModel, Flux2TransformerBlock, Flux2SingleTransformerBlock, Flux2Attention,
Flux2ParallelSelfAttention, Flux2FeedForward / Flux2SwiGLU, Flux2PosEmbed, Flux2Modulation,
Flux2TimestepGuidanceEmbeddings; pipelines/flux2/pipeline_flux2.py: the position ids, the sigmas
with compute_empirical_mu, the distilled guidance); it shares no code with diffcp's C++ DiT and
works directly on diffusers' tensor names. File format helpers are flux_reference.py's. Shapes: B
batch, T text tokens, N = (H/16)*(W/16) image tokens, D = heads * head_dim, M = int(D * mlp_ratio).

  temb = timestep_embedder(sinusoid(1000 t)) [+ guidance_embedder(sinusoid(1000 g))]   (no biases)
  mods = double_stream_modulation_img / _txt (6D each), single_stream_modulation (3D) of silu(temb),
         shared by every block
  double blocks: per stream LN -> (1 + scale) x + shift; q, k, v (no bias), RMS QK-norm; joint
         attention over [txt; img] with RoPE on both (4 axes, theta 2000: text (0, 0, 0, i), image
         (0, r, c, 0); adjacent pairs); SwiGLU FF (linear_in -> silu(first half) * second half)
  single blocks: to_qkv_mlp_proj -> [q | k | v | gate | up]; attention; to_out([attn | swiglu])
  out  = proj_out(AdaLayerNormContinuous(img; norm_out: scale, shift))

  flux2_reference.py make   --out DIR [--dtype f32|bf16|f16] [--shards N] [--layers L] [--single-layers S] ...
  flux2_reference.py check  --weights DIR --txt T --noise X --width W --height H --steps K [--guidance G]
                            --dump DIR [--tol 1e-4]
  flux2_reference.py header --config C --out DIR   (a data-less, real-shape transformer folder)

make writes a diffusers pipeline folder (model_index.json, transformer/config.json +
diffusion_pytorch_model safetensors, scheduler/scheduler_config.json as FLUX.2-dev's) and txt.npy
[T, joint_attention_dim], noise.npy [B, N, in_channels]. check computes Flux2Pipeline's sigmas and
compares each step's velocity with diffcp's --dump-velocity. Exit codes: 0 pass, 1 mismatch, 2 bad input.
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
from flux_reference import InputError, load_npy, silu  # noqa: E402

CLASS = "Flux2Transformer2DModel"
DEFAULTS = {"patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 8, "num_single_layers": 48,
            "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
            "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32],
            "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": True}
# FLUX.2-dev's scheduler/scheduler_config.json (Flux2Pipeline computes mu itself)
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
             "invert_sigmas": False, "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000,
             "shift": 3.0, "shift_terminal": None, "stochastic_sampling": False, "time_shift_type": "exponential",
             "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
             "use_karras_sigmas": False}


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
    a["out_channels"] = a["out_channels"] or a["in_channels"]
    if a["patch_size"] != 1 or a["out_channels"] != a["in_channels"]:
        raise InputError(f"{where}: patch_size 1 and out_channels = in_channels expected")
    if sum(a["axes_dims_rope"]) != a["attention_head_dim"] or len(a["axes_dims_rope"]) != 4:
        raise InputError(f"{where}: axes_dims_rope must be 4 axes summing to attention_head_dim")
    return a


def weight_shapes(a: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the class's state dict (diffusers' names; no biases) and its shape."""
    D, d = a["num_attention_heads"] * a["attention_head_dim"], a["attention_head_dim"]
    M, C, G = int(D * a["mlp_ratio"]), a["in_channels"], a["timestep_guidance_channels"]
    s: dict[str, tuple[int, ...]] = {}
    s["time_guidance_embed.timestep_embedder.linear_1.weight"] = (D, G)
    s["time_guidance_embed.timestep_embedder.linear_2.weight"] = (D, D)
    if a["guidance_embeds"]:
        s["time_guidance_embed.guidance_embedder.linear_1.weight"] = (D, G)
        s["time_guidance_embed.guidance_embedder.linear_2.weight"] = (D, D)
    s["double_stream_modulation_img.linear.weight"] = (6 * D, D)
    s["double_stream_modulation_txt.linear.weight"] = (6 * D, D)
    s["single_stream_modulation.linear.weight"] = (3 * D, D)
    s["x_embedder.weight"] = (D, C)
    s["context_embedder.weight"] = (D, a["joint_attention_dim"])
    for i in range(a["num_layers"]):
        b = f"transformer_blocks.{i}."
        for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            s[b + "attn." + p + ".weight"] = (D, D)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            s[b + "attn." + n + ".weight"] = (d,)
        for f in ("ff", "ff_context"):
            s[b + f + ".linear_in.weight"] = (2 * M, D)
            s[b + f + ".linear_out.weight"] = (D, M)
    for i in range(a["num_single_layers"]):
        b = f"single_transformer_blocks.{i}.attn."
        s[b + "to_qkv_mlp_proj.weight"] = (3 * D + 2 * M, D)
        s[b + "norm_q.weight"] = (d,)
        s[b + "norm_k.weight"] = (d,)
        s[b + "to_out.weight"] = (D, D + M)
    s["norm_out.linear.weight"] = (2 * D, D)
    s["proj_out.weight"] = (C, D)
    return s


def sinusoid(t: float, dim: int) -> np.ndarray:
    """Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0) of 1000 t: [cos, sin]."""
    half = dim // 2
    arg = 1000.0 * t * np.exp(-math.log(10000.0) * np.arange(half) / half)
    return np.concatenate([np.cos(arg), np.sin(arg)])


def swiglu(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return silu(x[..., :h]) * x[..., h:]


class Flux2Reference:
    def __init__(self, a: dict, w: dict[str, np.ndarray]):
        self.a, self.w = a, w
        self.h, self.d = a["num_attention_heads"], a["attention_head_dim"]
        self.eps = a["eps"]

    def lin(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[name + ".weight"].T

    def rms(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name + ".weight"]

    def ln(self, x: np.ndarray) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + self.eps)

    def angles(self, ids: np.ndarray) -> np.ndarray:
        """Flux2PosEmbed: ids [L, 4] -> angles [L, d/2], axis i's pairs after axis i-1's."""
        th = self.a["rope_theta"]
        return np.concatenate([np.outer(ids[:, i], 1.0 / th ** (np.arange(0, ax, 2) / ax))
                               for i, ax in enumerate(self.a["axes_dims_rope"])], axis=1)

    def attend(self, q, k, v, ang):
        """q, k, v [B, L, h, d]; rotate adjacent pairs of q, k by ang [L, d/2]; -> [B, L, h*d]."""
        def rot(x):
            c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
            out = np.empty_like(x)
            out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
            out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
            return out
        q, k = rot(q).transpose(0, 2, 1, 3), rot(k).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        sc = q @ k.swapaxes(-1, -2) / math.sqrt(self.d)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ v
        B, h, L, d = o.shape
        return o.transpose(0, 2, 1, 3).reshape(B, L, h * d)

    def forward(self, x: np.ndarray, enc: np.ndarray, t: float, g: float, gh: int, gw: int) -> np.ndarray:
        B, N, _ = x.shape
        T, D = enc.shape[0], self.h * self.d
        G = self.a["timestep_guidance_channels"]
        temb = self.lin("time_guidance_embed.timestep_embedder.linear_2",
                        silu(self.lin("time_guidance_embed.timestep_embedder.linear_1", sinusoid(t, G))))
        if self.a["guidance_embeds"]:
            temb = temb + self.lin("time_guidance_embed.guidance_embedder.linear_2",
                                   silu(self.lin("time_guidance_embed.guidance_embedder.linear_1", sinusoid(g, G))))
        st = silu(temb)
        mi = self.lin("double_stream_modulation_img.linear", st).reshape(6, D)  # (shift, scale, gate) x 2
        mt = self.lin("double_stream_modulation_txt.linear", st).reshape(6, D)
        ms = self.lin("single_stream_modulation.linear", st).reshape(3, D)
        img = self.lin("x_embedder", x)
        txt = np.repeat(self.lin("context_embedder", enc)[None], B, 0)
        txt_ids = np.zeros((T, 4))
        txt_ids[:, 3] = np.arange(T)
        r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        img_ids = np.zeros((N, 4))
        img_ids[:, 1], img_ids[:, 2] = r.reshape(-1), c.reshape(-1)
        ang = np.concatenate([self.angles(txt_ids), self.angles(img_ids)])  # [txt; img]
        for i in range(self.a["num_layers"]):
            b = f"transformer_blocks.{i}."
            xi = self.ln(img) * (1 + mi[1]) + mi[0]
            xt = self.ln(txt) * (1 + mt[1]) + mt[0]

            def heads(name, y):
                return self.lin(b + "attn." + name, y).reshape(B, y.shape[1], self.h, self.d)

            q = np.concatenate([self.rms(heads("add_q_proj", xt), b + "attn.norm_added_q"),
                                self.rms(heads("to_q", xi), b + "attn.norm_q")], 1)
            k = np.concatenate([self.rms(heads("add_k_proj", xt), b + "attn.norm_added_k"),
                                self.rms(heads("to_k", xi), b + "attn.norm_k")], 1)
            v = np.concatenate([heads("add_v_proj", xt), heads("to_v", xi)], 1)
            o = self.attend(q, k, v, ang)
            img = img + mi[2] * self.lin(b + "attn.to_out.0", o[:, T:])
            img = img + mi[5] * self.lin(b + "ff.linear_out",
                                         swiglu(self.lin(b + "ff.linear_in", self.ln(img) * (1 + mi[4]) + mi[3])))
            txt = txt + mt[2] * self.lin(b + "attn.to_add_out", o[:, :T])
            txt = txt + mt[5] * self.lin(b + "ff_context.linear_out",
                                         swiglu(self.lin(b + "ff_context.linear_in", self.ln(txt) * (1 + mt[4]) + mt[3])))
        h = np.concatenate([txt, img], 1)
        for i in range(self.a["num_single_layers"]):
            b = f"single_transformer_blocks.{i}.attn."
            y = self.lin(b + "to_qkv_mlp_proj", self.ln(h) * (1 + ms[1]) + ms[0])
            q, k, v = (y[..., j * D:(j + 1) * D].reshape(B, T + N, self.h, self.d) for j in range(3))
            o = self.attend(self.rms(q, b + "norm_q"), self.rms(k, b + "norm_k"), v, ang)
            h = h + ms[2] * self.lin(b + "to_out", np.concatenate([o, swiglu(y[..., 3 * D:])], -1))
        img = h[:, T:]
        scale, shift = self.lin("norm_out.linear", st).reshape(2, D)
        return self.lin("proj_out", self.ln(img) * (1 + scale) + shift)


def flux2_sigmas(sched: dict, steps: int, n_img: int) -> list[float]:
    """Flux2Pipeline: sigmas linspace(1, 1/N, N), mu = compute_empirical_mu(n_img, N), then the
    scheduler's dynamic exponential time shift (FLUX.2-dev's config), a final 0."""
    if not sched.get("use_dynamic_shifting") or sched.get("time_shift_type", "exponential") != "exponential" \
            or sched.get("shift_terminal"):
        raise InputError("the reference models FLUX.2-dev's scheduler (dynamic exponential shift, no terminal)")
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    m200 = a2 * n_img + b2
    if n_img > 4300:
        mu = m200
    else:
        m10 = a1 * n_img + b1
        slope = (m200 - m10) / 190.0
        mu = slope * steps + (m200 - 200.0 * slope)
    s = np.linspace(1.0, 1.0 / steps, steps)
    return [float(v) for v in math.exp(mu) / (math.exp(mu) + (1 / s - 1))] + [0.0]


def load_folder(path: Path, header_only: bool = False) -> tuple[dict, dict[str, np.ndarray], dict | None]:
    a, w, sched = load_pipeline(path, read_config, weight_shapes, header_only)
    return a, w, json.loads(sched.read_text()) if sched else None


def cmd_make(a: argparse.Namespace) -> int:
    cfg = {"_class_name": CLASS, "patch_size": 1, "in_channels": a.in_channels, "num_layers": a.layers,
           "num_single_layers": a.single_layers, "attention_head_dim": a.head_dim, "num_attention_heads": a.heads,
           "joint_attention_dim": a.joint_dim, "timestep_guidance_channels": a.time_channels,
           "mlp_ratio": a.mlp_ratio, "axes_dims_rope": [int(v) for v in a.axes_dim.split(",")],
           "rope_theta": a.theta, "eps": 1e-6, "guidance_embeds": bool(a.guidance_embed)}
    try:
        p = read_config(cfg, "make")
        if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or min(a.text_tokens, a.batch) <= 0:
            raise InputError("width / height must be positive multiples of 16; text-tokens, batch positive")
    except (InputError, ValueError) as e:
        print(f"make: {e}", file=sys.stderr)
        return 2

    tensors = random_tensors(weight_shapes(p), a.seed)
    out, dtype = Path(a.out), a.dtype.upper()
    try:
        write_pipeline(out, cfg, "Flux2Pipeline", SCHEDULER, tensors, dtype, a.shards, read_config, weight_shapes)
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 1
    n_img = (a.height // 16) * (a.width // 16)
    np.save(out / "txt.npy", rng(a.seed, "input.txt").standard_normal((a.text_tokens, a.joint_dim)).astype(np.float32))
    np.save(out / "noise.npy", rng(a.seed, "input.noise").standard_normal((a.batch, n_img, a.in_channels)).astype(np.float32))
    print(f"make: {len(tensors)} tensors ({dtype}, {a.shards} file(s)), {n_img} image tokens -> {out}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    p, w, sched = load_folder(Path(a.weights))
    if sched is None:
        raise InputError(f"{a.weights}: a pipeline folder with scheduler/scheduler_config.json is needed")
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or a.steps <= 0:
        raise InputError(f"width {a.width} / height {a.height} must be multiples of 16, steps > 0")
    gh, gw = a.height // 16, a.width // 16
    J = p["joint_attention_dim"]
    txt = load_npy(Path(a.txt), [(None, J), (1, None, J)]).reshape(-1, J)
    x = load_npy(Path(a.noise), [(None, gh * gw, p["in_channels"])])
    model = Flux2Reference(p, w)
    return check_sampler_run(Path(a.dump), x, flux2_sigmas(sched, a.steps, gh * gw),
                             lambda x, s: model.forward(x, txt, s, a.guidance, gh, gw), a.tol, f"guidance {a.guidance}")


def cmd_header(a: argparse.Namespace) -> int:
    return write_header(a.config, Path(a.out), read_config, weight_shapes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random tiny FLUX.2 pipeline folder and inputs")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    for name, default in (("shards", 1), ("layers", 1), ("single-layers", 2), ("heads", 4), ("head-dim", 16),
                          ("joint-dim", 48), ("in-channels", 16), ("time-channels", 32), ("theta", 2000),
                          ("guidance-embed", 1), ("width", 64), ("height", 48), ("text-tokens", 8), ("batch", 1),
                          ("seed", 0)):
        m.add_argument(f"--{name}", type=int, default=default)
    m.add_argument("--mlp-ratio", type=float, default=3.0)
    m.add_argument("--axes-dim", default="2,4,6,4")
    c = sub.add_parser("check", help="compare diffcp's dumped sampler run with the reference")
    for name in ("weights", "txt", "noise", "dump"):
        c.add_argument(f"--{name}", required=True)
    for name in ("width", "height", "steps"):
        c.add_argument(f"--{name}", type=int, required=True)
    c.add_argument("--guidance", type=float, default=4.0)
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
