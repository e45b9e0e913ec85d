#!/usr/bin/env python3
"""Independent float64 NumPy reference of Qwen-Image's transformer and its pipeline's sampler.

Re-expressed from diffusers' public sources (models/transformers/transformer_qwenimage.py:
QwenImageTransformer2DModel, QwenImageTransformerBlock, QwenDoubleStreamAttnProcessor2_0,
QwenEmbedRope, QwenTimestepProjEmbeddings; pipelines/qwenimage/pipeline_qwenimage.py: the sigmas,
mu, true classifier-free guidance); it shares no code with diffcp's C++ DiT and works directly on
diffusers' tensor names. The file format helpers (safetensors, .npy, the FlowMatchEulerDiscrete
sigmas) are flux_reference.py's. Shapes: B batch, T text tokens, N = (H/16)*(W/16) image tokens,
D = heads * head_dim hidden, C = out_channels * 4 packed latent channels.

  temb = timestep_embedder(sinusoid(1000 sigma, 256, cos first))                  # [D]
  txt  = txt_in(RMSNorm(encoder_hidden_states; txt_norm))  img = img_in(latents)
  60 (here: --layers) double-stream blocks: per stream (shift, scale, gate) x 2 from
    img_mod / txt_mod(silu(temb)); joint attention over [txt; img] with RMS QK-norm and RoPE
    (complex rotation of adjacent pairs; image rows / columns centred, text on the diagonal after
    max(h/2, w/2)); FeedForward GELU-tanh MLP
  out  = proj_out(AdaLayerNormContinuous(img; norm_out: scale, shift))          # [B, N, C]
  CFG  = neg + g (cond - neg), rescaled per token to |cond| (QwenImagePipeline, true_cfg_scale g > 1)

  qwenimage_reference.py make   --out DIR [--dtype f32|bf16|f16] [--shards N] [--layers L] ...
  qwenimage_reference.py check  --weights DIR --txt T [--neg N] --noise X --width W --height H
                                --steps K [--guidance G] --dump DIR [--tol 1e-4]
  qwenimage_reference.py header --config C --out DIR   (a data-less, real-shape transformer folder)

make writes a diffusers pipeline folder (model_index.json, transformer/config.json +
diffusion_pytorch_model safetensors, scheduler/scheduler_config.json of Qwen/Qwen-Image) and
txt.npy [T, joint_attention_dim], neg.npy [T_neg, joint_attention_dim], noise.npy [B, N, C].
check computes the pipeline's sigmas from the folder's scheduler_config.json and compares each
step's (guided) velocity with diffcp's --dump-velocity. Exit codes: 0 pass, 1 mismatch, 2 bad input.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusers_folder import (check_sampler_run, load_pipeline, random_tensors, rng,  # noqa: E402
                              write_header, write_pipeline)
from flux_reference import InputError, diffusers_sigmas, gelu_tanh, layer_norm, load_npy, silu  # noqa: E402

EPS = 1e-6  # every LayerNorm and RMSNorm of the class
CLASS = "QwenImageTransformer2DModel"
# The class's constructor arguments and defaults (the flags that select the edit / layered variants
# must stay false here); Qwen/Qwen-Image's published config also carries pooled_projection_dim,
# which the class ignores.
DEFAULTS = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
            "axes_dims_rope": [16, 56, 56], "zero_cond_t": False, "use_additional_t_cond": False,
            "use_layer3d_rope": False}
# Qwen/Qwen-Image's scheduler/scheduler_config.json
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
             "invert_sigmas": False, "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
             "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
             "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
             "use_karras_sigmas": False}


def read_config(c: dict, where: str) -> dict:
    """A config.json's fields over the class's defaults; refuses what the reference does not model."""
    if c.get("_class_name") != CLASS:
        raise InputError(f"{where}: _class_name {c.get('_class_name')!r}, expected {CLASS}")
    a = dict(DEFAULTS)
    for k, v in c.items():
        if k.startswith("_") or k == "pooled_projection_dim":
            continue
        if k not in a:
            raise InputError(f"{where}: unknown field {k!r}")
        a[k] = v
    for k in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        if a[k]:
            raise InputError(f"{where}: {k} = true is not modelled")
    if a["out_channels"] is None:
        a["out_channels"] = a["in_channels"]
    if a["in_channels"] != a["out_channels"] * a["patch_size"] ** 2:
        raise InputError(f"{where}: in_channels != out_channels * patch_size^2")
    if sum(a["axes_dims_rope"]) != a["attention_head_dim"] or any(x % 2 for x in a["axes_dims_rope"]):
        raise InputError(f"{where}: axes_dims_rope must be even and sum to attention_head_dim")
    return a


def weight_shapes(a: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the class's state dict (diffusers' names) and its shape."""
    D, J = a["num_attention_heads"] * a["attention_head_dim"], a["joint_attention_dim"]
    M = 4 * D  # FeedForward(dim, dim_out=dim): mult 4
    d, C = a["attention_head_dim"], a["patch_size"] ** 2 * a["out_channels"]
    s: dict[str, tuple[int, ...]] = {}

    def lin(name: str, i: int, o: int) -> None:
        s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

    lin("img_in", a["in_channels"], D)
    s["txt_norm.weight"] = (J,)
    lin("txt_in", J, D)
    lin("time_text_embed.timestep_embedder.linear_1", 256, D)
    lin("time_text_embed.timestep_embedder.linear_2", D, D)
    for i in range(a["num_layers"]):
        b = f"transformer_blocks.{i}."
        lin(b + "img_mod.1", D, 6 * D)
        lin(b + "txt_mod.1", D, 6 * D)
        for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            lin(b + "attn." + p, D, D)
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            s[b + "attn." + n + ".weight"] = (d,)
        for st in ("img_mlp", "txt_mlp"):
            lin(b + st + ".net.0.proj", D, M)
            lin(b + st + ".net.2", M, D)
    lin("norm_out.linear", D, 2 * D)
    lin("proj_out", D, C)
    return s


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def sinusoid(t: float, dim: int = 256) -> np.ndarray:
    """Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000) of sigma t: [dim]."""
    half = dim // 2
    arg = 1000.0 * t * np.exp(-math.log(10000.0) * np.arange(half) / half)
    return np.concatenate([np.cos(arg), np.sin(arg)])


def rope_angles(a: dict, gh: int, gw: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """QwenEmbedRope(theta 10000, scale_rope=True) for one image of gh x gw tokens and T text
    tokens: angles [N, d/2] (frame, height, width axes) and [T, d/2]."""
    axes = a["axes_dims_rope"]

    def freqs(pos: np.ndarray, dim: int) -> np.ndarray:  # rope_params: outer(pos, theta^(-2j/dim))
        return np.outer(pos, 1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim))

    rows = np.concatenate([np.arange(-(gh - gh // 2), 0), np.arange(gh // 2)])
    cols = np.concatenate([np.arange(-(gw - gw // 2), 0), np.arange(gw // 2)])
    r, c = np.meshgrid(rows, cols, indexing="ij")
    img = np.concatenate([freqs(np.zeros(gh * gw), axes[0]), freqs(r.reshape(-1), axes[1]),
                          freqs(c.reshape(-1), axes[2])], axis=1)
    m = max(gh // 2, gw // 2)
    tpos = np.arange(m, m + T)
    txt = np.concatenate([freqs(tpos, ax) for ax in axes], axis=1)
    return img, txt


def rotate(x: np.ndarray, ang: np.ndarray) -> np.ndarray:
    """apply_rotary_emb_qwen(use_real=False): x [B, L, h, d] as complex pairs (2j, 2j+1) times
    exp(i ang[L, d/2])."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * ang)[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


class QwenImageReference:
    def __init__(self, a: dict, w: dict[str, np.ndarray]):
        self.a, self.w = a, w
        self.h, self.d = a["num_attention_heads"], a["attention_head_dim"]

    def lin(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def forward(self, x: np.ndarray, enc: np.ndarray, sigma: float, gh: int, gw: int) -> np.ndarray:
        """x [B, N, C] latents, enc [T, J] one prompt's encoder_hidden_states -> velocity [B, N, C]."""
        B, N, _ = x.shape
        T = enc.shape[0]
        w = self.w
        temb = self.lin("time_text_embed.timestep_embedder.linear_2",
                        silu(self.lin("time_text_embed.timestep_embedder.linear_1", sinusoid(sigma))))
        st = silu(temb)
        img = self.lin("img_in", x)
        txt = np.repeat(self.lin("txt_in", rms(enc, w["txt_norm.weight"]))[None], B, 0)
        img_ang, txt_ang = rope_angles(self.a, gh, gw, T)
        for i in range(self.a["num_layers"]):
            b = f"transformer_blocks.{i}."
            im = self.lin(b + "img_mod.1", st).reshape(6, -1)  # shift1, scale1, gate1, shift2, scale2, gate2
            tm = self.lin(b + "txt_mod.1", st).reshape(6, -1)
            img_n = layer_norm(img) * (1 + im[1]) + im[0]
            txt_n = layer_norm(txt) * (1 + tm[1]) + tm[0]

            def heads(name: str, y: np.ndarray) -> np.ndarray:
                return self.lin(b + "attn." + name, y).reshape(B, y.shape[1], self.h, self.d)

            q_i = rotate(rms(heads("to_q", img_n), w[b + "attn.norm_q.weight"]), img_ang)
            k_i = rotate(rms(heads("to_k", img_n), w[b + "attn.norm_k.weight"]), img_ang)
            q_t = rotate(rms(heads("add_q_proj", txt_n), w[b + "attn.norm_added_q.weight"]), txt_ang)
            k_t = rotate(rms(heads("add_k_proj", txt_n), w[b + "attn.norm_added_k.weight"]), txt_ang)
            q = np.concatenate([q_t, q_i], 1).transpose(0, 2, 1, 3)  # [B, h, T + N, d]: order [text, image]
            k = np.concatenate([k_t, k_i], 1).transpose(0, 2, 1, 3)
            v = np.concatenate([heads("add_v_proj", txt_n), heads("to_v", img_n)], 1).transpose(0, 2, 1, 3)
            s = q @ k.swapaxes(-1, -2) / math.sqrt(self.d)
            p = np.exp(s - s.max(-1, keepdims=True))
            o = ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T + N, -1)
            img = img + im[2] * self.lin(b + "attn.to_out.0", o[:, T:])
            txt = txt + tm[2] * self.lin(b + "attn.to_add_out", o[:, :T])
            for name, y, m in (("img_mlp", img, im), ("txt_mlp", txt, tm)):
                yn = layer_norm(y) * (1 + m[4]) + m[3]
                out = y + m[5] * self.lin(b + name + ".net.2", gelu_tanh(self.lin(b + name + ".net.0.proj", yn)))
                if name == "img_mlp":
                    img = out
                else:
                    txt = out
        scale, shift = self.lin("norm_out.linear", st).reshape(2, -1)  # AdaLayerNormContinuous: (scale, shift)
        return self.lin("proj_out", layer_norm(img) * (1 + scale) + shift)


def load_folder(path: Path, header_only: bool = False) -> tuple[dict, dict[str, np.ndarray], Path | None]:
    return load_pipeline(path, read_config, weight_shapes, header_only)


def cmd_make(a: argparse.Namespace) -> int:
    try:
        axes = [int(v) for v in a.axes_dim.split(",")]
    except ValueError:
        axes = []
    cfg = {"_class_name": CLASS, "patch_size": 2, "in_channels": 4 * a.out_channels, "out_channels": a.out_channels,
           "num_layers": a.layers, "attention_head_dim": a.head_dim, "num_attention_heads": a.heads,
           "joint_attention_dim": a.joint_dim, "guidance_embeds": False, "axes_dims_rope": axes,
           "pooled_projection_dim": 768}  # as Qwen/Qwen-Image's file: a field the class ignores
    try:
        p = read_config(cfg, "make")
        if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16:
            raise InputError(f"width {a.width} / height {a.height} must be positive multiples of 16")
        if min(a.text_tokens, a.neg_tokens, a.batch) <= 0:
            raise InputError("text-tokens, neg-tokens and batch must be positive")
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 2
    tensors = random_tensors(weight_shapes(p), a.seed)
    out, dtype = Path(a.out), a.dtype.upper()
    try:
        write_pipeline(out, cfg, "QwenImagePipeline", SCHEDULER, tensors, dtype, a.shards, read_config, weight_shapes)
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 1
    n_img = (a.height // 16) * (a.width // 16)
    np.save(out / "txt.npy", rng(a.seed, "input.txt").standard_normal((a.text_tokens, a.joint_dim)).astype(np.float32))
    np.save(out / "neg.npy", rng(a.seed, "input.neg").standard_normal((a.neg_tokens, a.joint_dim)).astype(np.float32))
    np.save(out / "noise.npy", rng(a.seed, "input.noise").standard_normal((a.batch, n_img, 4 * a.out_channels)).astype(np.float32))
    print(f"make: {len(tensors)} tensors ({dtype}, {a.shards} file(s)), {n_img} image tokens -> {out}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    p, w, sched = load_folder(Path(a.weights))
    if sched is None:
        raise InputError(f"{a.weights}: a pipeline folder with scheduler/scheduler_config.json is needed")
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or a.steps <= 0:
        raise InputError(f"width {a.width} / height {a.height} must be multiples of 16, steps > 0")
    gh, gw = a.height // 16, a.width // 16
    J, C = p["joint_attention_dim"], p["in_channels"]
    txt = load_npy(Path(a.txt), [(None, J), (1, None, J)]).reshape(-1, J)
    neg = load_npy(Path(a.neg), [(None, J), (1, None, J)]).reshape(-1, J) if a.neg else None
    x = load_npy(Path(a.noise), [(None, gh * gw, C)])
    cfg = neg is not None and a.guidance > 1
    model = QwenImageReference(p, w)

    def velocity(x, s):
        v = model.forward(x, txt, s, gh, gw)
        if not cfg:
            return v
        vn = model.forward(x, neg, s, gh, gw)  # QwenImagePipeline: true CFG, the conditional norm kept per token
        comb = vn + a.guidance * (v - vn)
        return comb * (np.linalg.norm(v, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True))
    return check_sampler_run(Path(a.dump), x, diffusers_sigmas(sched, a.steps, gh * gw), velocity, a.tol,
                             f"CFG {a.guidance}" if cfg else "no CFG")


def cmd_header(a: argparse.Namespace) -> int:
    return write_header(a.config, Path(a.out), read_config, weight_shapes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random tiny Qwen-Image pipeline folder and inputs")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    for name, default in (("shards", 1), ("layers", 2), ("heads", 4), ("head-dim", 16), ("joint-dim", 32),
                          ("out-channels", 4), ("width", 64), ("height", 48), ("text-tokens", 8),
                          ("neg-tokens", 4), ("batch", 1), ("seed", 0)):
        m.add_argument(f"--{name}", type=int, default=default)
    m.add_argument("--axes-dim", default="4,6,6")
    c = sub.add_parser("check", help="compare diffcp's dumped sampler run with the reference")
    for name in ("weights", "txt", "noise", "dump"):
        c.add_argument(f"--{name}", required=True)
    c.add_argument("--neg")
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
