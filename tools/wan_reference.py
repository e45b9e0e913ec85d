#!/usr/bin/env python3
"""Independent float64 NumPy reference of Wan 2.1's transformer (text- and image-to-video) and its pipeline's sampler.

Re-expressed from diffusers' public sources (models/transformers/transformer_wan.py:
WanTransformer3DModel, WanTransformerBlock, WanAttention + WanAttnProcessor, WanRotaryPosEmbed,
WanTimeTextImageEmbedding; models/embeddings.py: Timesteps, TimestepEmbedding,
PixArtAlphaTextProjection, get_1d_rotary_pos_embed; models/normalization.py: FP32LayerNorm;
models/attention.py: FeedForward; pipelines/wan/pipeline_wan.py and
schedulers/scheduling_flow_match_euler_discrete.py: the sigmas, classifier-free guidance; WanImageEmbedding
and the added_kv_proj attention for image-to-video). It shares no code with diffcp's C++ DiT and works
directly on diffusers' tensor names and the latent video layout. File helpers are
diffusers_folder.py's. Shapes: B batch, C latent channels, latent [B, C, F, h, w] (F latent frames,
h = H/8, w = W/8), N = F * (h/2) * (w/2) tokens in (frame, row, col) order, T text tokens, E text_dim,
D = heads * head_dim.

  x    = conv3d_(1,2,2)(latent)                                   (no position table; RoPE in attn1)
  temb = time_embedder(sinusoid(1000 sigma)) [B, D];  mod = time_proj(silu(temb)) -> [B, 6, D]
  ctx  = text_embedder(encoder_hidden_states)                     (linear, GELU-tanh, linear)
  blocks: shift, scale, gate, c_shift, c_scale, c_gate = scale_shift_table + mod
          x += gate * attn1(LN(x) (1 + scale) + shift)             self-attention, 3-D RoPE on q, k
          x += attn2(norm2(x), ctx)                                cross-attention, no RoPE
          x += c_gate * ffn(LN(x) (1 + c_scale) + c_shift)         GELU-tanh FF
          attn: RMSNorm(q), RMSNorm(k) over all D (weight [D]) before the head split; norm2 is a
          LayerNorm with weight + bias when cross_attn_norm, else the identity
  out  = unpatchify(proj_out(LN(x) (1 + scale) + shift))          shift, scale = table[2] + temb
  I2V: the latent's input channels are followed by the condition's (in_channels > out_channels); with
          image_dim, ictx = LN_1e-5(ff.net.2(GELU(ff.net.0(LN_1e-5(image [+ pos_embed]))))) and attn2 adds
          softmax(q RMS(add_k_proj(ictx))^T) add_v_proj(ictx) to its text attention before to_out
  CFG  = uncond + g (cond - uncond)                               (WanPipeline, g > 1)
  sampler: FlowMatchEulerDiscreteScheduler (Euler), or UniPCMultistepScheduler's flow configuration
          (Wan's folders: class UniPC below, written from the UniPC paper's update as diffusers runs it)

  wan_reference.py make   --out DIR [--dtype f32|bf16|f16] [--shards N] [--layers L] [--heads N]
                          [--scheduler euler|unipc] [--solver-order P]
                          [--head-dim D] [--ffn M] [--channels C] [--text-dim E] [--text-tokens T]
                          [--neg-tokens T2] [--frames F] [--width W] [--height H] [--seed S]
                          [--no-cross-attn-norm] [--condition-channels C2] [--image-dim DI]
                          [--image-tokens I] [--pos-embed]
  wan_reference.py check  --weights DIR --txt T [--neg N] --noise X --frames F --width W --height H
                          --steps K [--guidance G] --dump DIR [--latent L] [--tol 2e-5]
  wan_reference.py header --config C --out DIR   (a data-less, real-shape transformer folder)
  Python: WanRef(config, weights).forward(latent [B, C_in, F, h, w], enc [B, T, E], sigma,
          image [B, I, DI] or None) -> velocity [B, C_out, F, h, w]

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
from flux_reference import InputError, gelu_tanh, load_npy, silu  # noqa: E402

CLASS = "WanTransformer3DModel"
# WanTransformer3DModel.__init__'s arguments and defaults (out_channels None means in_channels)
DEFAULTS = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
            "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
             "use_dynamic_shifting": False}
# What Wan's folders ship (Wan2.1-T2V-*-Diffusers/scheduler): UniPC in its flow-matching configuration.
UNIPC = {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "flow_shift": 3.0,
         "prediction_type": "flow_prediction", "use_flow_sigmas": True, "predict_x0": True, "solver_order": 2,
         "solver_type": "bh2", "lower_order_final": True, "final_sigmas_type": "zero", "disable_corrector": [],
         "thresholding": False, "use_karras_sigmas": False, "solver_p": None, "timestep_spacing": "linspace"}


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
    D = a["num_attention_heads"] * a["attention_head_dim"]
    if (a["image_dim"] is None) != (a["added_kv_proj_dim"] is None) or a["added_kv_proj_dim"] not in (None, D) \
            or (a["pos_embed_seq_len"] is not None and a["image_dim"] is None):
        raise InputError(f"{where}: image_dim and added_kv_proj_dim (= {D}) together, pos_embed_seq_len only with them")
    if list(a["patch_size"]) != [1, 2, 2] or a["qk_norm"] != "rms_norm_across_heads" \
            or a["out_channels"] > a["in_channels"] or not isinstance(a["cross_attn_norm"], bool):
        raise InputError(f"{where}: the reference models patch_size [1, 2, 2], qk_norm rms_norm_across_heads, "
                         "out_channels <= in_channels and a boolean cross_attn_norm")
    if a["attention_head_dim"] % 2 or a["freq_dim"] % 2:
        raise InputError(f"{where}: attention_head_dim and freq_dim must be even (RoPE pairs, [cos | sin])")
    return a


def weight_shapes(a: dict) -> dict[str, tuple[int, ...]]:
    D, C, E, M = a["num_attention_heads"] * a["attention_head_dim"], a["in_channels"], a["text_dim"], a["ffn_dim"]
    s: dict[str, tuple[int, ...]] = {}

    def lin(name: str, i: int, o: int) -> None:
        s[name + ".weight"], s[name + ".bias"] = (o, i), (o,)

    s["patch_embedding.weight"], s["patch_embedding.bias"] = (D, C, 1, 2, 2), (D,)
    lin("condition_embedder.time_embedder.linear_1", a["freq_dim"], D)
    lin("condition_embedder.time_embedder.linear_2", D, D)
    lin("condition_embedder.time_proj", D, 6 * D)
    lin("condition_embedder.text_embedder.linear_1", E, D)
    lin("condition_embedder.text_embedder.linear_2", D, D)
    for i in range(a["num_layers"]):
        b = f"blocks.{i}."
        s[b + "scale_shift_table"] = (1, 6, D)
        for at in ("attn1.", "attn2."):
            for n in ("to_q", "to_k", "to_v", "to_out.0"):
                lin(b + at + n, D, D)
            s[b + at + "norm_q.weight"], s[b + at + "norm_k.weight"] = (D,), (D,)
        if a["cross_attn_norm"]:
            s[b + "norm2.weight"], s[b + "norm2.bias"] = (D,), (D,)
        if a["image_dim"] is not None:
            lin(b + "attn2.add_k_proj", D, D)
            lin(b + "attn2.add_v_proj", D, D)
            s[b + "attn2.norm_added_k.weight"] = (D,)
        lin(b + "ffn.net.0.proj", D, M)
        lin(b + "ffn.net.2", M, D)
    if a["image_dim"] is not None:
        DI, ie = a["image_dim"], "condition_embedder.image_embedder."
        s[ie + "norm1.weight"], s[ie + "norm1.bias"] = (DI,), (DI,)
        lin(ie + "ff.net.0.proj", DI, DI)
        lin(ie + "ff.net.2", DI, D)
        s[ie + "norm2.weight"], s[ie + "norm2.bias"] = (D,), (D,)
        if a["pos_embed_seq_len"] is not None:
            s[ie + "pos_embed"] = (1, a["pos_embed_seq_len"], DI)
    s["scale_shift_table"] = (1, 2, D)
    lin("proj_out", D, a["out_channels"] * 4)
    return s


def sinusoid(timestep: float, dim: int) -> np.ndarray:
    """Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0) of a timestep (1000 sigma): [cos | sin]."""
    half = dim // 2
    arg = timestep * np.exp(-math.log(10000.0) * np.arange(half) / half)
    return np.concatenate([np.cos(arg), np.sin(arg)])


def rope_angles(d: int, F: int, gh: int, gw: int) -> np.ndarray:
    """WanRotaryPosEmbed's angles [N, d/2], one per (x[2i], x[2i+1]) pair of a head: head dims split
    [t | h | w] with h = w = 2 (d // 6), t = d - h - w; axis frequencies 1 / 10000^(2j / axis_dim)
    times the position (frame f, row r, col c, from 0)."""
    hd = 2 * (d // 6)
    parts = []
    for dim, n, shape in ((d - 2 * hd, F, (F, 1, 1, -1)), (hd, gh, (1, gh, 1, -1)), (hd, gw, (1, 1, gw, -1))):
        ang = np.arange(n)[:, None] * (1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim))[None]
        parts.append(np.broadcast_to(ang.reshape(shape), (F, gh, gw, dim // 2)))
    return np.concatenate(parts, -1).reshape(F * gh * gw, d // 2)


def rotate(x: np.ndarray, ang: np.ndarray) -> np.ndarray:
    """x [B, N, heads, d] with pairs (x[2i], x[2i+1]) times exp(i ang) (ang [N, d/2])."""
    re, im = x[..., 0::2], x[..., 1::2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    return np.stack([re * cos - im * sin, re * sin + im * cos], -1).reshape(x.shape)


class WanRef:
    def __init__(self, a: dict, w: dict[str, np.ndarray]):
        self.a, self.w = a, {k: v.astype(np.float64) for k, v in w.items()}
        self.h, self.d, self.eps = a["num_attention_heads"], a["attention_head_dim"], a["eps"]

    def lin(self, name: str, x: np.ndarray) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def ln(self, x: np.ndarray, name: str | None = None, eps: float | None = None) -> np.ndarray:
        """LayerNorm over the last axis (biased variance, eps); with name's weight and bias if given."""
        mu = x.mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + (self.eps if eps is None else eps))
        return y if name is None else y * self.w[name + ".weight"] + self.w[name + ".bias"]

    def rms(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name + ".weight"]

    def sdpa(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [B, N, heads, d], k, v [B, S, heads, d] -> softmax(q k^T / sqrt d) v [B, heads, N, d]."""
        s = q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1) / math.sqrt(self.d)  # [B, heads, N, S]
        pr = np.exp(s - s.max(-1, keepdims=True))
        return (pr / pr.sum(-1, keepdims=True)) @ v.transpose(0, 2, 1, 3)

    def attn(self, p: str, x: np.ndarray, ctx: np.ndarray, ang: np.ndarray | None,
             ictx: np.ndarray | None = None) -> np.ndarray:
        """WanAttention: x [B, N, D] attends to ctx [B, S, D]; RMS over all D, then heads, then RoPE;
        with ictx [B, I, D] (I2V) the same queries attend to it too, a softmax of its own, summed."""
        B, N, D = x.shape
        q = self.rms(self.lin(p + "to_q", x), p + "norm_q").reshape(B, N, self.h, self.d)
        k = self.rms(self.lin(p + "to_k", ctx), p + "norm_k").reshape(B, -1, self.h, self.d)
        v = self.lin(p + "to_v", ctx).reshape(B, -1, self.h, self.d)
        if ang is not None:
            q, k = rotate(q, ang), rotate(k, ang)
        o = self.sdpa(q, k, v)
        if ictx is not None:
            ki = self.rms(self.lin(p + "add_k_proj", ictx), p + "norm_added_k").reshape(B, -1, self.h, self.d)
            o = o + self.sdpa(q, ki, self.lin(p + "add_v_proj", ictx).reshape(B, -1, self.h, self.d))
        return self.lin(p + "to_out.0", o.transpose(0, 2, 1, 3).reshape(B, N, D))

    def image_context(self, image: np.ndarray) -> np.ndarray:
        """WanImageEmbedding: image [B, I, DI] (FLF2V: + pos_embed) -> [B, I, D]; FP32LayerNorm's eps 1e-5,
        FeedForward's exact GELU."""
        ie = "condition_embedder.image_embedder."
        if self.a["pos_embed_seq_len"] is not None:
            if image.shape[1] != self.a["pos_embed_seq_len"]:
                raise InputError(f"image context of {image.shape[1]} tokens, the position table has "
                                 f"{self.a['pos_embed_seq_len']}")
            image = image + self.w[ie + "pos_embed"][0]
        y = self.lin(ie + "ff.net.0.proj", self.ln(image, ie + "norm1", 1e-5))
        y = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2.0)))
        return self.ln(self.lin(ie + "ff.net.2", y), ie + "norm2", 1e-5)

    def forward(self, lat: np.ndarray, enc: np.ndarray, sigma: float, image: np.ndarray | None = None) -> np.ndarray:
        """lat [B, C_in, F, h, w] (I2V: the latent's channels, then the condition's), enc [B, T, E], sigma
        (timestep 1000 sigma), image [B, I, DI] (with image_dim) -> velocity [B, C_out, F, h, w]."""
        B, C, F, h, w = lat.shape
        if C != self.a["in_channels"] or (image is None) != (self.a["image_dim"] is None):
            raise InputError(f"latent of {C} channels (in_channels {self.a['in_channels']}); an image context "
                             f"{'needed' if self.a['image_dim'] is not None else 'not taken'}")
        ictx = None if image is None else self.image_context(image)
        gh, gw, D, mx = h // 2, w // 2, self.h * self.d, self.a["rope_max_seq_len"]
        if h % 2 or w % 2 or max(F, gh, gw) > mx:
            raise InputError(f"latent {F} x {h} x {w}: h, w must be even and F, h/2, w/2 <= rope_max_seq_len {mx}")
        N = F * gh * gw
        # Conv3d, kernel = stride = (1, 2, 2): patches [B, (f, r, c), (ch, ph, pw)] against W [D, C, 1, 2, 2]
        patches = lat.reshape(B, C, F, gh, 2, gw, 2).transpose(0, 2, 3, 5, 1, 4, 6).reshape(B, N, C * 4)
        x = patches @ self.w["patch_embedding.weight"].reshape(D, -1).T + self.w["patch_embedding.bias"]
        ce = "condition_embedder."
        # sigma: one for every token, or one per token [N] (TI2V's image conditioning: the modulation per token)
        sig = np.atleast_1d(np.asarray(sigma, dtype=np.float64))
        if sig.shape not in ((1,), (N,)):
            raise InputError(f"{sig.shape[0]} timesteps for {N} tokens")
        feats = np.stack([sinusoid(1000.0 * s, self.a["freq_dim"]) for s in sig])
        temb = self.lin(ce + "time_embedder.linear_2", silu(self.lin(ce + "time_embedder.linear_1", feats)))  # [1 or N, D]
        mod = self.lin(ce + "time_proj", silu(temb)).reshape(-1, 6, D)  # [1 or N, 6, D], shared by the batch
        ctx = self.lin(ce + "text_embedder.linear_2", gelu_tanh(self.lin(ce + "text_embedder.linear_1", enc)))
        ang = rope_angles(self.d, F, gh, gw)
        for i in range(self.a["num_layers"]):
            b = f"blocks.{i}."
            m = (self.w[b + "scale_shift_table"].reshape(6, D) + mod).transpose(1, 0, 2)  # [6, 1 or N, D]: shift,
            y = self.ln(x) * (1 + m[1]) + m[0]                                     # scale, gate, c_shift, c_scale, c_gate
            x = x + m[2] * self.attn(b + "attn1.", y, y, ang)
            x = x + self.attn(b + "attn2.", self.ln(x, b + "norm2") if self.a["cross_attn_norm"] else x, ctx, None, ictx)
            y = self.ln(x) * (1 + m[4]) + m[3]
            x = x + m[5] * self.lin(b + "ffn.net.2", gelu_tanh(self.lin(b + "ffn.net.0.proj", y)))
        shift, scale = (self.w["scale_shift_table"].reshape(2, D) + temb[:, None]).transpose(1, 0, 2)  # temb not silu'd
        y = self.lin("proj_out", self.ln(x) * (1 + scale) + shift)  # [B, N, (ph, pw, c)], c fastest
        Co = self.a["out_channels"]
        return y.reshape(B, F, gh, gw, 2, 2, Co).transpose(0, 6, 1, 2, 4, 3, 5).reshape(B, Co, F, h, w)


def wan_sigmas(sched: dict, steps: int) -> list[float]:
    """FlowMatchEulerDiscreteScheduler.set_timesteps(steps) as WanPipeline calls it (no explicit sigmas,
    static shift): linspace(sigma_max, sigma_min, steps) over the scheduler's shifted training sigmas
    (1, ..., 1/Ntrain), shifted once more, then a final 0."""
    cls = sched.get("_class_name", SCHEDULER["_class_name"])
    if cls != SCHEDULER["_class_name"] or any(sched.get(k) for k in (
            "use_dynamic_shifting", "shift_terminal", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
            "use_beta_sigmas", "stochastic_sampling")):
        raise InputError(f"scheduler {cls}: the reference models FlowMatchEulerDiscreteScheduler with a static shift "
                         "(no dynamic shifting, terminal stretch, inversion, karras / exponential / beta, stochastic)")
    shift, n = sched.get("shift", 1.0), sched.get("num_train_timesteps", 1000)

    def shifted(s):
        return shift * s / (1 + (shift - 1) * s)

    return [float(v) for v in shifted(np.linspace(shifted(1.0), shifted(1.0 / n), steps))] + [0.0]


def unipc_schedule(sched: dict, steps: int) -> tuple[list[float], list[float]]:
    """UniPCMultistepScheduler.set_timesteps(steps) with flow sigmas: (the update's sigmas, float32 as
    the scheduler holds them, then 0; the sigma each transformer call sees: its int64 timestep / 1000)."""
    bad = {k: sched.get(k) for k in ("use_dynamic_shifting", "shift_terminal", "thresholding", "use_karras_sigmas",
                                     "use_exponential_sigmas", "use_beta_sigmas", "solver_p") if sched.get(k)}
    if bad or sched.get("prediction_type") != "flow_prediction" or not sched.get("use_flow_sigmas") \
            or not sched.get("predict_x0", True) or sched.get("disable_corrector") or \
            sched.get("final_sigmas_type", "zero") != "zero":
        raise InputError(f"scheduler UniPCMultistepScheduler: the reference models its flow configuration (x0 "
                         f"prediction, final sigma 0, every step corrected), not {bad or sched}")
    n, shift = sched.get("num_train_timesteps", 1000), sched.get("flow_shift", 1.0)
    u = np.linspace(1.0, 1.0 / n, steps + 1)[:-1]
    sig = shift * u / (1 + (shift - 1) * u)
    if abs(sig[0] - 1) < 1e-6:
        sig[0] -= 1e-6
    return ([float(np.float32(v)) for v in sig] + [0.0], [float(np.trunc(v * n)) / 1000.0 for v in sig])


class UniPC:
    """The UniPC-bh multistep solver (Zhao et al. 2023, "UniPC", with x0 = x - sigma v): predictor
    x_{k+1} = (s_{k+1} / s_k) x_k - a_{k+1} (e^{-h} - 1) m_k - a_{k+1} B(h) sum_i rho_i D_i, D_i = (m_{k-i}
    - m_k) / r_i, r_i = (lambda_{k-i} - lambda_k) / h; the corrector redoes x_k with m_k's own difference
    (weight rho_p) once the model has seen x_k. lambda = log(a / s), a = 1 - s; rho from R rho = b, R_ij =
    r_j^i, b_i = i! phi_{i+1}(-h) / B(h) (the predictor of order 2 takes rho = 1/2; the corrector of order 1
    rho = 1/2); order min(solver_order, steps done + 1, steps left) (lower_order_final)."""

    def __init__(self, sched: dict, sigmas: list[float]):
        self.order, self.bh2 = sched.get("solver_order", 2), sched.get("solver_type", "bh2") == "bh2"
        self.low_final = sched.get("lower_order_final", True)
        self.s = np.asarray(sigmas, dtype=np.float64)
        with np.errstate(divide="ignore"):
            self.lam = np.log(1 - self.s) - np.log(self.s)
        self.m: list[np.ndarray] = []  # newest first
        self.prev_x, self.prev_p = None, 0

    def system(self, h: float, r: list[float], p: int):
        hh = -h
        phi = np.expm1(hh)
        B = np.expm1(hh) if self.bh2 else hh
        rr = np.array(r + [1.0])
        R = np.stack([rr ** i for i in range(p)])
        b, hk, fact = [], phi / hh - 1, 1.0
        for i in range(1, p + 1):
            b.append(hk * fact / B)
            fact *= i + 1
            hk = hk / hh - 1 / fact
        return R, np.array(b), phi, B

    def combine(self, x, k_from: int, k_to: int, m0, older, rho, extra=None):
        s0, st = self.s[k_from], self.s[k_to]
        h = self.lam[k_to] - self.lam[k_from]
        at = 1 - st
        _, _, phi, B = self.system(h, [], 1)
        out = (st / s0) * x - at * phi * m0
        res = sum(w * (mi - m0) / ri for w, (mi, ri) in zip(rho, older)) if older else 0.0
        if extra is not None:
            res = res + extra[0] * (extra[1] - m0)
        return out - at * B * res

    def step(self, k: int, x: np.ndarray, v: np.ndarray) -> np.ndarray:
        K = len(self.s) - 1
        m_new = x - self.s[k] * v
        if k > 0 and self.m:  # corrector of x_k (order of the last predictor)
            p = self.prev_p
            h = self.lam[k] - self.lam[k - 1]
            r = [(self.lam[k - 1 - i] - self.lam[k - 1]) / h for i in range(1, p)]
            R, b, _, _ = self.system(h, r, p)
            rho = np.array([0.5]) if p == 1 else np.linalg.solve(R, b)
            older = [(self.m[i], r[i - 1]) for i in range(1, p)]
            x = self.combine(self.prev_x, k - 1, k, self.m[0], older, rho[:-1], (rho[-1], m_new))
        self.m = [m_new] + self.m[:self.order - 1]
        p = min(self.order, K - k) if self.low_final else self.order
        p = min(p, len(self.m))
        self.prev_x, self.prev_p = x, p
        h = self.lam[k + 1] - self.lam[k]
        r = [(self.lam[k - i] - self.lam[k]) / h for i in range(1, p)]
        R, b, _, _ = self.system(h, r, p)
        rho = [] if p == 1 else [0.5] if p == 2 else list(np.linalg.solve(R[:-1, :-1], b[:-1]))
        older = [(self.m[i], r[i - 1]) for i in range(1, p)]
        return self.combine(x, k, k + 1, self.m[0], older, rho)


def load_folder(path: Path, header_only: bool = False) -> tuple[dict, dict[str, np.ndarray], dict | None]:
    a, w, sched = load_pipeline(path, read_config, weight_shapes, header_only)
    return a, w, json.loads(sched.read_text()) if sched else None


def cmd_make(a: argparse.Namespace) -> int:
    cfg = {"_class_name": CLASS, **DEFAULTS, "num_attention_heads": a.heads, "attention_head_dim": a.head_dim,
           "in_channels": a.channels + a.condition_channels, "out_channels": a.channels, "text_dim": a.text_dim,
           "ffn_dim": a.ffn, "num_layers": a.layers, "cross_attn_norm": not a.no_cross_attn_norm}
    if a.image_dim:
        cfg.update(image_dim=a.image_dim, added_kv_proj_dim=a.heads * a.head_dim,
                   pos_embed_seq_len=a.image_tokens if a.pos_embed else None)
    try:
        p = read_config(cfg, "the arguments")
        if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 \
                or min(a.text_tokens, a.neg_tokens, a.frames) <= 0:
            raise InputError("width / height must be positive multiples of 16; token and frame counts positive")
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 2
    tensors = random_tensors(weight_shapes(p), a.seed)
    out, dtype = Path(a.out), a.dtype.upper()
    sched = SCHEDULER if a.scheduler == "euler" else {**UNIPC, "solver_order": a.solver_order}
    try:
        write_pipeline(out, cfg, "WanPipeline", sched, tensors, dtype, a.shards, read_config, weight_shapes)
    except InputError as e:
        print(f"make: {e}", file=sys.stderr)
        return 1
    E = a.text_dim
    np.save(out / "txt.npy", rng(a.seed, "input.txt").standard_normal((a.text_tokens, E)).astype(np.float32))
    np.save(out / "neg.npy", rng(a.seed, "input.neg").standard_normal((a.neg_tokens, E)).astype(np.float32))
    np.save(out / "noise.npy", rng(a.seed, "input.noise").standard_normal(
        (1, a.channels, a.frames, a.height // 8, a.width // 8)).astype(np.float32))
    if a.image_dim:
        np.save(out / "image.npy", rng(a.seed, "input.image").standard_normal(
            (1, a.image_tokens, a.image_dim)).astype(np.float32))
    n = a.frames * (a.height // 16) * (a.width // 16)
    print(f"make: {len(tensors)} tensors ({dtype}, {a.shards} file(s)), {n} tokens -> {out}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    p, w, sched = load_folder(Path(a.weights))
    if sched is None:
        raise InputError(f"{a.weights}: a pipeline folder with scheduler/scheduler_config.json is needed")
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or a.steps <= 0 or a.frames <= 0:
        raise InputError(f"width {a.width} / height {a.height} must be multiples of 16, frames and steps > 0")
    if p["in_channels"] != p["out_channels"] or p["image_dim"] is not None:
        raise InputError(f"{a.weights}: an image-to-video transformer; `diffcp dit` (what this checks) runs text-to-video")
    E, C = p["text_dim"], p["in_channels"]
    txt = load_npy(Path(a.txt), [(None, E), (1, None, E)]).reshape(1, -1, E)
    cfg = a.neg is not None and a.guidance > 1
    if cfg:
        neg = load_npy(Path(a.neg), [(None, E), (1, None, E)]).reshape(1, -1, E)
    x = load_npy(Path(a.noise), [(None, C, a.frames, a.height // 8, a.width // 8)])
    B = x.shape[0]
    model = WanRef(p, w)

    def velocity(x, s):  # WanPipeline: uncond + g (cond - uncond)
        v = model.forward(x, np.repeat(txt, B, 0), s)
        if not cfg:
            return v
        vu = model.forward(x, np.repeat(neg, B, 0), s)
        return vu + a.guidance * (v - vu)
    label = f"CFG {a.guidance}" if cfg else "no CFG"
    final = Path(a.latent) if a.latent else None
    if sched.get("_class_name") == UNIPC["_class_name"]:
        sigmas, model_sigmas = unipc_schedule(sched, a.steps)
        solver = UniPC(sched, sigmas)
        return check_sampler_run(Path(a.dump), x, sigmas, velocity, a.tol, label + f", UniPC order {solver.order}",
                                 step=solver.step, model_sigmas=model_sigmas, final=final)
    return check_sampler_run(Path(a.dump), x, wan_sigmas(sched, a.steps), velocity, a.tol, label, final=final)


def cmd_header(a: argparse.Namespace) -> int:
    return write_header(a.config, Path(a.out), read_config, weight_shapes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random tiny Wan 2.1 pipeline folder and inputs")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    for name, default in (("shards", 1), ("layers", 2), ("heads", 4), ("head-dim", 12), ("ffn", 64), ("channels", 4),
                          ("text-dim", 32), ("text-tokens", 7), ("neg-tokens", 5), ("frames", 3), ("width", 64),
                          ("height", 48), ("seed", 0)):
        m.add_argument(f"--{name}", type=int, default=default)
    m.add_argument("--no-cross-attn-norm", action="store_true", help="cross_attn_norm false (norm2 the identity)")
    for name, default, what in (("condition-channels", 0, "I2V: the condition's channels after the latent's"),
                                ("image-dim", 0, "I2V: the image context's features (0: none)"),
                                ("image-tokens", 5, "I2V: the image context's tokens (image.npy)")):
        m.add_argument(f"--{name}", type=int, default=default, help=what)
    m.add_argument("--pos-embed", action="store_true", help="FLF2V: pos_embed_seq_len = --image-tokens")
    m.add_argument("--scheduler", choices=["euler", "unipc"], default="euler",
                   help="the folder's scheduler: FlowMatchEulerDiscreteScheduler, or UniPC as Wan's folders ship it")
    m.add_argument("--solver-order", type=int, default=2, help="UniPC's solver_order")
    c = sub.add_parser("check", help="compare diffcp's dumped sampler run with the reference")
    for name in ("weights", "txt", "noise", "dump"):
        c.add_argument(f"--{name}", required=True)
    c.add_argument("--neg")
    c.add_argument("--latent", help="diffcp's --save-latent: the final latent, checked too")
    for name in ("frames", "width", "height", "steps"):
        c.add_argument(f"--{name}", type=int, required=True)
    c.add_argument("--guidance", type=float, default=5.0)
    c.add_argument("--tol", type=float, default=2e-5)
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
