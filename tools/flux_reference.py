#!/usr/bin/env python3
"""Independent float64 NumPy reference of the FLUX.1 transformer and its Euler sampler.

Re-expressed from the published black-forest-labs/flux sources (src/flux/model.py,
src/flux/modules/layers.py, src/flux/math.py, src/flux/sampling.py); it shares no code with
diffcp's C++ DiT and parses safetensors / config.json itself. Shapes: B batch, T text tokens,
N image tokens = (H/16)*(W/16), L = T + N, D hidden, h heads, d = D/h head dim.

  vec = time_in(temb(t)) [+ guidance_in(temb(g))] + vector_in(y)          # [B, D]
  pe  = EmbedND(ids): per axis rope(pos, axes_dim[i], theta), adjacent pairs (2j, 2j+1)
  double blocks: separate img/txt weights, joint attention over [txt; img]
  single blocks: one stream over [txt; img], linear1 -> (qkv | mlp), linear2([attn | gelu(mlp)])
  final: drop txt, LastLayer (adaLN shift, scale) -> [B, N, out_channels]

  flux_reference.py make  --out DIR [--dtype f32|bf16|f16] [--shards N] [--guidance-embed 0|1] ...
                          [--format diffusers]
  flux_reference.py check --weights W --config C --txt T --pooled P --noise X --width W --height H
                          --steps K --schedule flux|linear|scheduler_config [--scheduler-config F]
                          [--guidance G] --dump DIR [--tol 1e-4]

--format diffusers writes the same model as a diffusers pipeline folder instead (model_index.json,
transformer/config.json of FluxTransformer2DModel and diffusion_pytorch_model safetensors with
diffusers' names, re-expressed from diffusers' transformer_flux.py: split q/k/v Linears, the
final modulation as (scale, shift); scheduler/scheduler_config.json FLUX.1-dev's); check --weights
takes such a folder as well, and --schedule scheduler_config computes FluxPipeline's sigmas from
a scheduler_config.json.
Exit codes: 0 pass, 1 mismatch, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

TIME_DIM = 256  # width of the sinusoidal timestep / guidance embedding (Flux.time_in in_dim)
EPS = 1e-6  # LayerNorm and RMSNorm epsilon


class InputError(Exception):
    """Bad input (missing file, malformed header, wrong shape): exit code 2."""


# ----------------------------------------------------------------------------- safetensors
_STORE = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 array -> little-endian storage array (BF16: round to nearest even, as uint16)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "BF16":
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return x.astype(_STORE[dtype])


def decode(raw: bytes | np.ndarray, dtype: str, shape: list[int]) -> np.ndarray:
    """Storage bytes -> float64 array of `shape` (exact for F32/F16/BF16)."""
    a = np.frombuffer(raw, dtype=_STORE[dtype]) if isinstance(raw, bytes) else raw
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64).reshape(shape)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> int:
    """Write {name: float32 array} as one safetensors file; returns the tensor byte count."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name, x in tensors.items():
        b = encode(x, dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
    return off


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read one safetensors file -> {name: float64 array}."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) < 8:
        raise InputError(f"{path}: too short for a safetensors file")
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{path}: bad safetensors header") from None
    body, out = data[8 + n:], {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in _STORE:
            raise InputError(f"{path}: tensor {name} has unsupported dtype {t['dtype']}")
        b, e = t["data_offsets"]
        need = math.prod(t["shape"]) * np.dtype(_STORE[t["dtype"]]).itemsize
        if e - b != need or e > len(body):
            raise InputError(f"{path}: tensor {name} offsets {b}..{e} do not fit shape {t['shape']}")
        out[name] = decode(body[b:e], t["dtype"], t["shape"])
    return out


def load_weights(path: Path) -> dict[str, np.ndarray]:
    """A .safetensors file, or a Hugging Face model.safetensors.index.json naming shards."""
    if path.suffix != ".json":
        return read_safetensors(path)
    try:
        weight_map: dict[str, str] = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        raise InputError(f"{path}: not a readable index with a weight_map") from None
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        for name, x in read_safetensors(path.parent / shard).items():
            if weight_map.get(name) == shard:
                out[name] = x
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise InputError(f"{path}: tensors listed but not found in their shard: {missing[:5]}")
    return out


# ----------------------------------------------------------------------------- parameters
@dataclass
class FluxParams:
    """FLUX's FluxParams (model.py), same field names as config.json."""
    in_channels: int
    out_channels: int
    vec_in_dim: int
    context_in_dim: int
    hidden_size: int
    mlp_ratio: float
    num_heads: int
    depth: int
    depth_single_blocks: int
    axes_dim: list[int]
    theta: int
    qkv_bias: bool
    guidance_embed: bool

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    def problems(self) -> list[str]:
        """Constraints FLUX asserts (Flux.__init__, rope) plus what this reference needs."""
        p, d = [], self.hidden_size // max(self.num_heads, 1)
        if min(self.in_channels, self.vec_in_dim, self.context_in_dim, self.hidden_size,
               self.num_heads, self.mlp_hidden) <= 0 or min(self.depth, self.depth_single_blocks) < 0:
            p.append("all sizes must be positive (depths >= 0)")
        if self.num_heads > 0 and self.hidden_size % self.num_heads:
            p.append(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if len(self.axes_dim) != 3 or any(a <= 0 or a % 2 for a in self.axes_dim):
            p.append(f"axes_dim {self.axes_dim} must be 3 positive even sizes (ids are (0, row, col))")
        if sum(self.axes_dim) != d:
            p.append(f"sum(axes_dim) = {sum(self.axes_dim)} != head dim hidden/heads = {d}")
        if self.out_channels != self.in_channels:
            p.append(f"out_channels {self.out_channels} != in_channels {self.in_channels}")
        return p


def load_config(path: Path) -> FluxParams:
    try:
        cfg = json.loads(path.read_text())
        p = FluxParams(**{f.name: cfg[f.name] for f in fields(FluxParams)})
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: not a FluxParams config ({e!r})") from None
    if p.problems():
        raise InputError(f"{path}: " + "; ".join(p.problems()))
    return p


def weight_shapes(p: FluxParams) -> dict[str, tuple[int, ...]]:
    """Every BFL state-dict tensor of a Flux model with params p; Linear weights are [out, in]."""
    D, M, d = p.hidden_size, p.mlp_hidden, p.hidden_size // p.num_heads
    s: dict[str, tuple[int, ...]] = {}

    def lin(name: str, n_in: int, n_out: int, bias: bool = True) -> None:
        s[name + ".weight"] = (n_out, n_in)
        if bias:
            s[name + ".bias"] = (n_out,)

    lin("img_in", p.in_channels, D)
    lin("time_in.in_layer", TIME_DIM, D)
    lin("time_in.out_layer", D, D)
    if p.guidance_embed:
        lin("guidance_in.in_layer", TIME_DIM, D)
        lin("guidance_in.out_layer", D, D)
    lin("vector_in.in_layer", p.vec_in_dim, D)
    lin("vector_in.out_layer", D, D)
    lin("txt_in", p.context_in_dim, D)
    for i in range(p.depth):
        for side in ("img", "txt"):
            b = f"double_blocks.{i}.{side}"
            lin(f"{b}_mod.lin", D, 6 * D)
            lin(f"{b}_attn.qkv", D, 3 * D, bias=p.qkv_bias)
            s[f"{b}_attn.norm.query_norm.scale"] = (d,)
            s[f"{b}_attn.norm.key_norm.scale"] = (d,)
            lin(f"{b}_attn.proj", D, D)
            lin(f"{b}_mlp.0", D, M)
            lin(f"{b}_mlp.2", M, D)
    for i in range(p.depth_single_blocks):
        b = f"single_blocks.{i}"
        lin(f"{b}.linear1", D, 3 * D + M)
        lin(f"{b}.linear2", D + M, D)
        s[f"{b}.norm.query_norm.scale"] = (d,)
        s[f"{b}.norm.key_norm.scale"] = (d,)
        lin(f"{b}.modulation.lin", D, 3 * D)
    lin("final_layer.adaLN_modulation.1", D, 2 * D)
    lin("final_layer.linear", D, p.out_channels)  # patch_size 1: tokens are already 2x2-packed
    return s


# ----------------------------------------------------------------------------- FLUX math
def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x: np.ndarray) -> np.ndarray:
    """LayerNorm over the last axis, no affine, biased variance, eps 1e-6."""
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS)


def rms_norm(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FLUX RMSNorm: x * rsqrt(mean(x^2) + 1e-6) * scale."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * scale


def timestep_embedding(t: np.ndarray, dim: int = TIME_DIM, max_period: float = 10000.0) -> np.ndarray:
    """t [B] (in [0,1], or the guidance value) -> [B, dim] = [cos(1000 t f_i), sin(1000 t f_i)],
    f_i = exp(-ln(max_period) i / (dim/2)), i < dim/2."""
    half = dim // 2
    freqs = np.exp(-math.log(max_period) * np.arange(half, dtype=np.float64) / half)
    args = (1000.0 * t)[:, None] * freqs[None, :]
    emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1)
    return np.concatenate([emb, np.zeros_like(emb[:, :1])], axis=-1) if dim % 2 else emb


def rope(pos: np.ndarray, dim: int, theta: float) -> np.ndarray:
    """pos [B, L] -> rotation matrices [B, L, dim/2, 2, 2] = [[cos, -sin], [sin, cos]] of angle
    pos * theta^(-2j/dim), j < dim/2."""
    omega = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    a = pos[..., None] * omega
    c, s = np.cos(a), np.sin(a)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)


def embed_nd(ids: np.ndarray, axes_dim: list[int], theta: float) -> np.ndarray:
    """ids [B, L, n_axes] -> pe [B, 1, L, d/2, 2, 2]: axis i owns the next axes_dim[i] head dims."""
    return np.concatenate([rope(ids[..., i], axes_dim[i], theta) for i in range(ids.shape[-1])],
                          axis=-3)[:, None]


def apply_rope(x: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """x [B, h, L, d]: rotate each adjacent pair (x[2j], x[2j+1]) by pe [B, 1, L, d/2, 2, 2]."""
    xp = x.reshape(*x.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * xp[..., 0] + pe[..., 1] * xp[..., 1]  # [B, h, L, d/2, 2]
    return out.reshape(x.shape)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """q, k, v [B, h, L, d] -> [B, L, h*d]: rope on q, k, then softmax(q k^T / sqrt(d)) v."""
    q, k = apply_rope(q, pe), apply_rope(k, pe)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    x = (w / w.sum(-1, keepdims=True)) @ v
    B, h, L, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, h * d)


class FluxReference:
    """Flux.forward (model.py) in float64 over a weight dict with BFL names."""

    def __init__(self, p: FluxParams, w: dict[str, np.ndarray]):
        self.p, self.w = p, w

    def lin(self, name: str, x: np.ndarray) -> np.ndarray:
        """PyTorch Linear: x [..., in] @ W[out, in]^T + b."""
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def mlp_embed(self, name: str, x: np.ndarray) -> np.ndarray:
        """MLPEmbedder: out_layer(silu(in_layer(x)))."""
        return self.lin(name + ".out_layer", silu(self.lin(name + ".in_layer", x)))

    def modulation(self, name: str, vec: np.ndarray, n: int) -> list[np.ndarray]:
        """Modulation: lin(silu(vec)) [B, n*D] -> n chunks [B, 1, D] (shift, scale, gate, ...)."""
        return np.split(self.lin(name, silu(vec))[:, None, :], n, axis=-1)

    def qkv_heads(self, qkv: np.ndarray, norm: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """qkv [B, L, 3D], layout "B L (K H D)" -> q, k, v [B, h, L, d]; q, k RMS-normed."""
        B, L, _ = qkv.shape
        q, k, v = qkv.reshape(B, L, 3, self.p.num_heads, -1).transpose(2, 0, 3, 1, 4)
        return (rms_norm(q, self.w[norm + ".query_norm.scale"]),
                rms_norm(k, self.w[norm + ".key_norm.scale"]), v)

    def double_block(self, i: int, img: np.ndarray, txt: np.ndarray, vec: np.ndarray,
                     pe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """DoubleStreamBlock: img [B, N, D], txt [B, T, D] -> same shapes."""
        b, T = f"double_blocks.{i}", txt.shape[1]
        mods, qkvs = {}, []
        for side, x in (("txt", txt), ("img", img)):  # text first in the joint sequence
            mods[side] = self.modulation(f"{b}.{side}_mod.lin", vec, 6)
            shift1, scale1 = mods[side][0], mods[side][1]
            xm = (1 + scale1) * layer_norm(x) + shift1
            qkvs.append(self.qkv_heads(self.lin(f"{b}.{side}_attn.qkv", xm), f"{b}.{side}_attn.norm"))
        q, k, v = (np.concatenate([t[j] for t in qkvs], axis=2) for j in range(3))
        attn = attention(q, k, v, pe)
        out = []
        for side, x, a in (("txt", txt, attn[:, :T]), ("img", img, attn[:, T:])):
            _, _, gate1, shift2, scale2, gate2 = mods[side]
            x = x + gate1 * self.lin(f"{b}.{side}_attn.proj", a)
            hdn = gelu_tanh(self.lin(f"{b}.{side}_mlp.0", (1 + scale2) * layer_norm(x) + shift2))
            out.append(x + gate2 * self.lin(f"{b}.{side}_mlp.2", hdn))
        return out[1], out[0]

    def single_block(self, i: int, x: np.ndarray, vec: np.ndarray, pe: np.ndarray) -> np.ndarray:
        """SingleStreamBlock: x [B, L, D] -> [B, L, D]."""
        b, D = f"single_blocks.{i}", self.p.hidden_size
        shift, scale, gate = self.modulation(f"{b}.modulation.lin", vec, 3)
        h = self.lin(f"{b}.linear1", (1 + scale) * layer_norm(x) + shift)
        q, k, v = self.qkv_heads(h[..., :3 * D], f"{b}.norm")
        attn = attention(q, k, v, pe)
        return x + gate * self.lin(f"{b}.linear2", np.concatenate([attn, gelu_tanh(h[..., 3 * D:])], -1))

    def forward(self, img: np.ndarray, img_ids: np.ndarray, txt: np.ndarray, txt_ids: np.ndarray,
                t: np.ndarray, y: np.ndarray, guidance: np.ndarray | None) -> np.ndarray:
        """img [B, N, in_ch], img_ids [B, N, 3], txt [B, T, ctx], txt_ids [B, T, 3], t [B],
        y [B, vec_in], guidance [B] -> velocity [B, N, out_ch]."""
        img = self.lin("img_in", img)
        vec = self.mlp_embed("time_in", timestep_embedding(t))
        if self.p.guidance_embed:
            vec = vec + self.mlp_embed("guidance_in", timestep_embedding(guidance))
        vec = vec + self.mlp_embed("vector_in", y)
        txt = self.lin("txt_in", txt)
        pe = embed_nd(np.concatenate([txt_ids, img_ids], 1), self.p.axes_dim, self.p.theta)
        for i in range(self.p.depth):
            img, txt = self.double_block(i, img, txt, vec, pe)
        x = np.concatenate([txt, img], 1)
        for i in range(self.p.depth_single_blocks):
            x = self.single_block(i, x, vec, pe)
        x = x[:, txt.shape[1]:]
        shift, scale = np.split(self.lin("final_layer.adaLN_modulation.1", silu(vec)), 2, axis=1)
        return self.lin("final_layer.linear", (1 + scale[:, None]) * layer_norm(x) + shift[:, None])


# ----------------------------------------------------------------------------- sampling
def make_ids(batch: int, n_txt: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """sampling.prepare: txt_ids zeros [B, T, 3]; img_ids (0, row, col) [B, (H/16)(W/16), 3]."""
    gh, gw = height // 16, width // 16
    img = np.zeros((gh, gw, 3))
    img[..., 1] = np.arange(gh)[:, None]
    img[..., 2] = np.arange(gw)[None, :]
    return np.repeat(img.reshape(1, gh * gw, 3), batch, 0), np.zeros((batch, n_txt, 3))


def get_schedule(steps: int, image_seq_len: int, shift: bool) -> list[float]:
    """t_k = 1 - k/K (k = 0..K); with shift, time_shift(mu, 1, t) = e^mu / (e^mu + (1/t - 1)),
    mu linear in image_seq_len through (256, 0.5) and (4096, 1.15); t = 0 stays 0."""
    ts = [1.0 - k / steps for k in range(steps + 1)]
    if not shift:
        return ts
    m = (1.15 - 0.5) / (4096 - 256)
    mu = m * image_seq_len + (0.5 - m * 256)
    return [0.0 if t == 0 else math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0)) for t in ts]


def diffusers_sigmas(path: Path, steps: int, image_seq_len: int) -> list[float]:
    """FluxPipeline's sigmas from a FlowMatchEulerDiscreteScheduler scheduler_config.json.

    Re-expressed from diffusers (pipeline_flux.py: sigmas = linspace(1, 1/N, N), mu =
    calculate_shift(image_seq_len, ...); scheduling_flow_match_euler_discrete.py set_timesteps:
    time_shift or the static shift, stretch_shift_to_terminal, a final 0), in float64."""
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read ({e!r})") from None
    if c.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise InputError(f"{path}: not a FlowMatchEulerDiscreteScheduler config")
    sig = np.linspace(1.0, 1.0 / steps, steps)
    bs = 0.5 if c.get("base_shift") is None else c["base_shift"]
    ms = 1.15 if c.get("max_shift") is None else c["max_shift"]
    bl, ml = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    m = (ms - bs) / (ml - bl)
    mu = image_seq_len * m + (bs - m * bl)
    if c.get("use_dynamic_shifting", False):
        if c.get("time_shift_type", "exponential") == "exponential":
            sig = math.exp(mu) / (math.exp(mu) + (1 / sig - 1))
        else:
            sig = mu / (mu + (1 / sig - 1))
    else:
        shift = c.get("shift", 1.0)
        sig = shift * sig / (1 + (shift - 1) * sig)
    if c.get("shift_terminal"):
        one_minus = 1 - sig
        sig = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
    return [float(x) for x in sig] + [0.0]


def load_npy(path: Path, shapes: list[tuple[int | None, ...]]) -> np.ndarray:
    """Load a .npy as float64, accepting any of `shapes` (None = any size); else InputError."""
    try:
        a = np.load(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot load ({e})") from None
    for s in shapes:
        if a.ndim == len(s) and all(w is None or w == g for w, g in zip(s, a.shape)):
            return a.astype(np.float64)
    want = " or ".join("(" + ", ".join("*" if w is None else str(w) for w in s) + ")" for s in shapes)
    raise InputError(f"{path}: shape {a.shape}, expected {want}")


# ----------------------------------------------------------------------------- diffusers layout
def diffusers_parts(p: FluxParams) -> dict[str, list[tuple[str, int, int, int]]]:
    """BFL name -> its rows as (diffusers name, lo, hi, rows of that diffusers tensor), in order.

    From diffusers' FluxTransformer2DModel (transformer_flux.py): FluxTransformerBlock has norm1 /
    norm1_context (AdaLayerNormZero: shift, scale, gate of attention and MLP, BFL's order),
    attn.to_q/to_k/to_v/to_out.0 for the image stream and add_q_proj/add_k_proj/add_v_proj/to_add_out
    for the text stream, norm_q/norm_k and norm_added_q/norm_added_k, ff and ff_context
    (net.0.proj, net.2); FluxSingleTransformerBlock has norm.linear, attn.to_q/to_k/to_v, proj_mlp
    and proj_out over [attention | GELU(MLP)]; norm_out (AdaLayerNormContinuous) emits (scale,
    shift), BFL's LastLayer (shift, scale)."""
    D, M = p.hidden_size, p.mlp_hidden
    out: dict[str, list[tuple[str, int, int, int]]] = {}
    shapes = weight_shapes(p)
    top = {"img_in": "x_embedder", "txt_in": "context_embedder",
           "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
           "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
           "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
           "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
           "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
           "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
           "final_layer.linear": "proj_out"}
    for name, s in shapes.items():
        base, _, leaf = name.rpartition(".")
        leaf_d = "weight" if leaf == "scale" else leaf
        n = s[0]
        whole = None
        if base in top:
            whole = top[base]
        elif base == "final_layer.adaLN_modulation.1":
            t = f"norm_out.linear.{leaf_d}"
            out[name] = [(t, D, 2 * D, 2 * D), (t, 0, D, 2 * D)]
            continue
        elif base.startswith("double_blocks."):
            _, i, rest = base.split(".", 2)
            side, part = rest[:3], rest[4:]
            b = f"transformer_blocks.{i}."
            img = side == "img"
            if part == "attn.qkv":
                qkv = ("attn.to_q", "attn.to_k", "attn.to_v") if img else \
                      ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
                out[name] = [(f"{b}{t}.{leaf_d}", 0, D, D) for t in qkv]
                continue
            whole = b + {"mod.lin": ("norm1.linear", "norm1_context.linear"),
                         "attn.norm.query_norm": ("attn.norm_q", "attn.norm_added_q"),
                         "attn.norm.key_norm": ("attn.norm_k", "attn.norm_added_k"),
                         "attn.proj": ("attn.to_out.0", "attn.to_add_out"),
                         "mlp.0": ("ff.net.0.proj", "ff_context.net.0.proj"),
                         "mlp.2": ("ff.net.2", "ff_context.net.2")}[part][0 if img else 1]
        elif base.startswith("single_blocks."):
            _, i, part = base.split(".", 2)
            b = f"single_transformer_blocks.{i}."
            if part == "linear1":
                out[name] = [(f"{b}attn.to_{t}.{leaf_d}", 0, D, D) for t in "qkv"] + \
                            [(f"{b}proj_mlp.{leaf_d}", 0, M, M)]
                continue
            whole = b + {"modulation.lin": "norm.linear", "linear2": "proj_out",
                         "norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}[part]
        if whole is None:
            raise InputError(f"no diffusers name for {name}")
        out[name] = [(f"{whole}.{leaf_d}", 0, n, n)]
    return out


def to_diffusers(w: dict[str, np.ndarray], p: FluxParams) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, parts in diffusers_parts(p).items():
        r = 0
        for t, lo, hi, rows in parts:
            if t not in out:
                out[t] = np.zeros((rows,) + w[name].shape[1:], w[name].dtype)
            out[t][lo:hi] = w[name][r:r + hi - lo]
            r += hi - lo
    return out


def from_diffusers(d: dict[str, np.ndarray], p: FluxParams, where: str) -> dict[str, np.ndarray]:
    parts = diffusers_parts(p)
    used = {t for ps in parts.values() for t, *_ in ps}
    extra, missing = sorted(set(d) - used), sorted(used - set(d))
    if extra or missing:
        raise InputError(f"{where}: diffusers tensors missing {missing[:5]}, not in the model {extra[:5]}")
    return {name: np.concatenate([d[t][lo:hi] for t, lo, hi, _ in ps]) for name, ps in parts.items()}


def diffusers_config(p: FluxParams) -> dict:
    """FluxTransformer2DModel's constructor arguments for p (diffusers fixes mlp_ratio, theta, qkv biases)."""
    if p.mlp_ratio != 4.0 or p.theta != 10000 or not p.qkv_bias:
        raise InputError("FluxTransformer2DModel has mlp_ratio 4, theta 10000 and qkv biases")
    return {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": p.in_channels,
            "out_channels": p.out_channels, "num_layers": p.depth, "num_single_layers": p.depth_single_blocks,
            "attention_head_dim": p.hidden_size // p.num_heads, "num_attention_heads": p.num_heads,
            "joint_attention_dim": p.context_in_dim, "pooled_projection_dim": p.vec_in_dim,
            "guidance_embeds": p.guidance_embed, "axes_dims_rope": p.axes_dim}


def load_diffusers_folder(path: Path, header_only: bool = False) -> tuple[FluxParams, dict[str, np.ndarray]]:
    """A diffusers pipeline folder (model_index.json) or transformer folder -> (params, BFL-named
    weights; none with header_only)."""
    t = path / "transformer" if (path / "model_index.json").exists() else path
    try:
        c = json.loads((t / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{t / 'config.json'}: cannot read ({e!r})") from None
    if c.get("_class_name") != "FluxTransformer2DModel" or c.get("patch_size", 1) != 1:
        raise InputError(f"{t / 'config.json'}: not a FluxTransformer2DModel with patch_size 1")
    hd, heads = c.get("attention_head_dim", 128), c.get("num_attention_heads", 24)
    p = FluxParams(c.get("in_channels", 64), c.get("out_channels") or c.get("in_channels", 64),
                   c.get("pooled_projection_dim", 768), c.get("joint_attention_dim", 4096), hd * heads, 4.0, heads,
                   c.get("num_layers", 19), c.get("num_single_layers", 38), list(c.get("axes_dims_rope", [16, 56, 56])),
                   10000, True, bool(c.get("guidance_embeds", False)))
    if p.problems():
        raise InputError(f"{t / 'config.json'}: " + "; ".join(p.problems()))
    if header_only:
        return p, {}
    index = t / "diffusion_pytorch_model.safetensors.index.json"
    w = load_weights(index if index.exists() else t / "diffusion_pytorch_model.safetensors")
    return p, from_diffusers(w, p, str(t))


# ----------------------------------------------------------------------------- commands
def cmd_make(a: argparse.Namespace) -> int:
    """Random tiny FLUX checkpoint (BFL names) + config.json + txt/pooled/noise .npy."""
    try:
        axes = [int(v) for v in a.axes_dim.split(",")]
    except ValueError:
        axes = []
    p = FluxParams(a.in_channels, a.in_channels, a.vec_in_dim, a.context_in_dim, a.hidden,
                   a.mlp_ratio, a.heads, a.depth, a.depth_single, axes, a.theta,
                   bool(a.qkv_bias), bool(a.guidance_embed))
    bad = p.problems()
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16:
        bad.append(f"width {a.width} / height {a.height} must be positive multiples of 16")
    if min(a.text_tokens, a.batch) <= 0:
        bad.append("text-tokens and batch must be positive")
    shapes = {} if bad else weight_shapes(p)
    if not bad and not 1 <= a.shards <= len(shapes):
        bad.append(f"shards {a.shards} must be in 1..{len(shapes)} (the tensor count)")
    if bad:
        print("make: " + "; ".join(bad), file=sys.stderr)
        return 2

    def rng(name: str) -> np.random.Generator:  # per-name stream: tensors don't shift each other
        return np.random.default_rng([a.seed, zlib.crc32(name.encode())])

    tensors: dict[str, np.ndarray] = {}
    for name, s in shapes.items():
        g = rng(name).standard_normal(s)
        if name.endswith(".scale"):
            g = 1.0 + 0.1 * g
        elif name.endswith(".bias"):
            g = 0.1 * g
        else:
            g = g / math.sqrt(s[1])
        tensors[name] = g.astype(np.float32)

    out, dtype = Path(a.out), a.dtype.upper()
    out.mkdir(parents=True, exist_ok=True)
    wdir, stem = out, "model"
    if a.format == "diffusers":  # the same model in diffusers' pipeline layout
        try:
            dcfg = diffusers_config(p)
        except InputError as e:
            print(f"make: --format diffusers: {e}", file=sys.stderr)
            return 2
        wdir, stem = out / "transformer", "diffusion_pytorch_model"
        wdir.mkdir(parents=True, exist_ok=True)
        (wdir / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")
        (out / "model_index.json").write_text(json.dumps(
            {"_class_name": "FluxPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "transformer": ["diffusers", "FluxTransformer2DModel"]}, indent=2) + "\n")
        (out / "scheduler").mkdir(exist_ok=True)  # FLUX.1-dev's scheduler_config.json
        (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(
            {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
             "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
             "use_dynamic_shifting": True}, indent=2) + "\n")
        tensors = to_diffusers(tensors, p)
    names = list(tensors)
    if a.shards == 1:
        write_safetensors(wdir / f"{stem}.safetensors", tensors, dtype)
        files = [wdir / f"{stem}.safetensors"]
    else:
        weight_map, total, files = {}, 0, []
        for k, chunk in enumerate(np.array_split(np.arange(len(names)), a.shards), 1):
            fname = f"{stem}-{k:05d}-of-{a.shards:05d}.safetensors"
            part = {names[j]: tensors[names[j]] for j in chunk}
            total += write_safetensors(wdir / fname, part, dtype)
            weight_map.update({n: fname for n in part})
            files.append(wdir / fname)
        idx = wdir / f"{stem}.safetensors.index.json"
        idx.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        files.append(idx)
    # read back what was written: exact against the quantized values, close to the float32 draw
    back = load_weights(files[-1])
    tol = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3}[dtype]
    for name, x in tensors.items():
        q = decode(encode(x, dtype), dtype, list(x.shape))
        if back[name].shape != x.shape or not np.array_equal(back[name], q) \
                or not np.allclose(q, x, rtol=tol, atol=tol):
            print(f"make: read-back mismatch for {name}", file=sys.stderr)
            return 1
    assert set(back) == set(tensors)

    cfg = {f.name: getattr(p, f.name) for f in fields(FluxParams)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    n_img, c = (a.height // 16) * (a.width // 16), a.in_channels
    np.save(out / "txt.npy", rng("input.txt").standard_normal((a.text_tokens, a.context_in_dim)).astype(np.float32))
    np.save(out / "pooled.npy", rng("input.pooled").standard_normal(a.vec_in_dim).astype(np.float32))
    if c % 4 == 0:  # get_noise draws a [B, C/4, H/8, W/8] latent; prepare packs 2x2 patches
        lat = rng("input.noise").standard_normal((a.batch, c // 4, a.height // 8, a.width // 8))
        gh, gw = a.height // 16, a.width // 16  # "b c (h ph) (w pw) -> b (h w) (c ph pw)"
        noise = lat.reshape(a.batch, c // 4, gh, 2, gw, 2).transpose(0, 2, 4, 1, 3, 5).reshape(a.batch, n_img, c)
    else:
        noise = rng("input.noise").standard_normal((a.batch, n_img, c))
    np.save(out / "noise.npy", noise.astype(np.float32))
    print(f"make: {len(tensors)} tensors ({dtype}, {a.shards} file(s)), {n_img} image tokens -> {out}")
    return 0


def cmd_check(a: argparse.Namespace) -> int:
    """Reference trajectory in float64 vs diffcp's dumped timesteps and per-step velocities."""
    p = load_config(Path(a.config))
    if Path(a.weights).is_dir():  # a diffusers folder: its own config must describe the same model
        p_d, w = load_diffusers_folder(Path(a.weights))
        if p_d != p:
            raise InputError(f"{a.weights}: its config.json is {p_d}, --config says {p}")
    else:
        w = load_weights(Path(a.weights))
    want = weight_shapes(p)
    extra = sorted(set(w) - set(want))
    if extra:  # e.g. guidance_in or qkv biases that the config says the model lacks
        raise InputError(f"{a.weights}: tensors the config does not describe: {extra[:5]}")
    for name, s in want.items():
        if name not in w:
            raise InputError(f"{a.weights}: missing tensor {name} (shape {s})")
        if w[name].shape != s:
            raise InputError(f"{a.weights}: tensor {name} has shape {w[name].shape}, expected {s}")
    if a.width <= 0 or a.height <= 0 or a.width % 16 or a.height % 16 or a.steps <= 0:
        raise InputError(f"width {a.width} / height {a.height} must be multiples of 16, steps > 0")
    n_img = (a.height // 16) * (a.width // 16)
    txt = load_npy(Path(a.txt), [(None, p.context_in_dim), (1, None, p.context_in_dim)])
    txt = txt.reshape(-1, p.context_in_dim)
    y = load_npy(Path(a.pooled), [(p.vec_in_dim,), (1, p.vec_in_dim)]).reshape(-1)
    x = load_npy(Path(a.noise), [(None, n_img, p.in_channels)])
    B = x.shape[0]
    if a.schedule == "scheduler_config":
        if not a.scheduler_config:
            raise InputError("--schedule scheduler_config needs --scheduler-config FILE")
        ts = diffusers_sigmas(Path(a.scheduler_config), a.steps, n_img)
    else:
        ts = get_schedule(a.steps, n_img, a.schedule == "flux")
    vel_shape = (B, n_img, p.out_channels)

    dump = Path(a.self_dump or a.dump)
    got_ts: list[float] = []
    if not a.self_dump:  # validate the whole dump before the (slow) reference run
        try:
            got_ts = [float(t) for t in json.loads((dump / "timesteps.json").read_text())["timesteps"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{dump / 'timesteps.json'}: no readable 'timesteps' list ({e!r})") from None
        for k in range(a.steps):
            f = dump / f"velocity_{k}.npy"
            if not f.exists():
                raise InputError(f"{f}: missing")
            load_npy(f, [vel_shape])

    model = FluxReference(p, w)
    img_ids, txt_ids = make_ids(B, txt.shape[0], a.height, a.width)
    txt_b, y_b = np.repeat(txt[None], B, 0), np.repeat(y[None], B, 0)
    g = np.full(B, a.guidance)
    ok = True
    if not a.self_dump:
        dt = max((abs(u - v) for u, v in zip(got_ts, ts)), default=0.0)
        ts_ok = len(got_ts) == len(ts) and dt <= 1e-9
        ok &= ts_ok
        print(f"timesteps: {len(got_ts)} given, {len(ts)} expected, max|diff| {dt:.3e} "
              f"{'ok' if ts_ok else 'MISMATCH'}")
    else:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "timesteps.json").write_text(json.dumps({"timesteps": ts, "source": "flux_reference"}))
    for k in range(a.steps):
        v = model.forward(x, img_ids, txt_b, txt_ids, np.full(B, ts[k]), y_b, g)
        if a.self_dump:
            np.save(dump / f"velocity_{k}.npy", v.astype(np.float32))
            print(f"step {k:3d}  t={ts[k]:.6f}  written")
        else:
            got = load_npy(dump / f"velocity_{k}.npy", [vel_shape])
            rel = float(np.abs(got - v).max() / max(np.abs(v).max(), 1e-30))
            ok &= rel <= a.tol
            print(f"step {k:3d}  t={ts[k]:.6f}  rel={rel:.3e}  {'ok' if rel <= a.tol else 'MISMATCH'}")
        x = x + (ts[k + 1] - ts[k]) * v
    if a.self_dump:
        print(f"self-dump written to {dump}")
        return 0
    print(f"{'PASS' if ok else 'FAIL'} ({a.steps} steps, schedule {a.schedule}, tol {a.tol:g})")
    return 0 if ok else 1


def cmd_header(a: argparse.Namespace) -> int:
    """A real-shape checkpoint without its data: the full header of every tensor of the config in
    BF16, the file extended (sparse, no disk blocks) to its true size, so a reader can open it and
    read the shape off it (`diffcp dit --dry-run`) without 24 GB of weights."""
    out = Path(a.out)
    try:
        if a.format == "diffusers":  # a diffusers transformer config.json -> a transformer folder
            c = json.loads(Path(a.config).read_text())
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
            p, _ = load_diffusers_folder(out, header_only=True)
            out = out / "diffusion_pytorch_model.safetensors"
            shapes = weight_shapes(p)
            tensors = {t: (rows,) + shapes[name][1:] for name, ps in diffusers_parts(p).items() for t, _, _, rows in ps}
        else:
            p = load_config(Path(a.config))
            tensors = weight_shapes(p)
    except (InputError, OSError, ValueError) as e:
        print(f"header: {e}", file=sys.stderr)
        return 2
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in tensors.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + off)
    print(f"header: {len(header) - 1} tensors, {off // 2} parameters, {8 + len(h) + off} bytes (sparse) -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random tiny FLUX checkpoint, config and inputs")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    for name, default in (("shards", 1), ("guidance-embed", 1), ("qkv-bias", 1), ("hidden", 64),
                          ("heads", 4), ("depth", 1), ("depth-single", 2), ("in-channels", 16),
                          ("context-in-dim", 32), ("vec-in-dim", 24), ("theta", 10000), ("width", 64),
                          ("height", 32), ("text-tokens", 8), ("batch", 1), ("seed", 0)):
        m.add_argument(f"--{name}", type=int, default=default)
    m.add_argument("--mlp-ratio", type=float, default=4.0)
    m.add_argument("--axes-dim", default="4,6,6")
    m.add_argument("--format", choices=["bfl", "diffusers"], default="bfl")
    c = sub.add_parser("check", help="compare diffcp's dumped sampler run with the reference")
    for name in ("weights", "config", "txt", "pooled", "noise"):
        c.add_argument(f"--{name}", required=True)
    for name in ("width", "height", "steps"):
        c.add_argument(f"--{name}", type=int, required=True)
    c.add_argument("--schedule", choices=["flux", "linear", "scheduler_config"], required=True)
    c.add_argument("--scheduler-config", help="a diffusers scheduler_config.json (with --schedule scheduler_config)")
    c.add_argument("--guidance", type=float, default=3.5)
    c.add_argument("--dump")
    c.add_argument("--tol", type=float, default=1e-4)
    c.add_argument("--self-dump", help=argparse.SUPPRESS)  # developer: write the reference's own dump
    hd = sub.add_parser("header", help="write a sparse, data-less BF16 checkpoint of a config's real shape")
    hd.add_argument("--config", required=True, help="FluxParams; with --format diffusers a transformer config.json")
    hd.add_argument("--out", required=True, help="the file; with --format diffusers the transformer folder")
    hd.add_argument("--format", choices=["bfl", "diffusers"], default="bfl")
    a = ap.parse_args(argv)
    if a.cmd == "make":
        return cmd_make(a)
    if a.cmd == "header":
        return cmd_header(a)
    if not (a.dump or a.self_dump):
        c.error("--dump is required")
    try:
        return cmd_check(a)
    except InputError as e:
        print(f"check: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
