#!/usr/bin/env python3
"""One DFlash draft block in numpy (float64), from a drafter directory in the Hugging Face format,
written from the reference implementation's published math (z-lab/dflash `DFlashDraftModel`):

  ctx = RMSNorm_hidden_norm(fc(target_hidden))                      # [ctx, H]
  per layer:  a = RMSNorm_input_layernorm(h)
              q = RoPE(q_norm(q_proj(a)))          at positions ctx .. ctx+B-1
              k = RoPE(k_norm(k_proj([ctx; a])))  at positions 0 .. ctx+B-1
              v = v_proj([ctx; a])
              h = h + o_proj(softmax(q k^T / sqrt(d) + mask) v)
                  full_attention layers: no mask (the block sees all);
                  sliding_attention layers (config.layer_types), as DFlashDraftModel's
                  _attention_mask: query at position i sees key position j only if
                  j <= i (causal: the default for sliding layers, or config.is_causal) and
                  i - j < sliding_window (and j - i < sliding_window when not causal)
              h = h + down_proj(silu(gate_proj(m)) * up_proj(m)),  m = RMSNorm_post(h)
  out = RMSNorm_norm(h)                                               # [B, H]

DFlash2 (architectures ["DFlash2DraftModel"], z-lab's GroupedDynamicCausalConv): each sublayer f
becomes conv_1(f(conv_0(x))), x its normed input, with dyn = x kernel_projection^T viewed
[B, 2, K, G] (G = H / conv_group_size) and
  conv_s(y)[t, c] = sum over o < K of (base_kernel[s, o, c] + dyn[t, s, o, c // gs]) y[t - o, c]
(zero for t - o < 0: the block's rows only). The candidate selector does not enter the hidden states.

RoPE is rotate-half (pairs i, i + d/2) with inv_freq = theta^(-2i/d); GQA maps query head h to
kv head h // (n_q / n_kv). The layer types resolve as transformers' Qwen3Config does:
sliding_window (default 4096) only with use_sliding_window, layer_types (default: sliding from
max_window_layers, default 28, on when there is a window). Independent of diffcp's code: it parses config.json and the
safetensors file itself (F32, BF16, F16).

  tools/dflash_reference.py DIR H.npy E.npy OUT.npy [--check GOT.npy --rtol R]
"""
import argparse
import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = data[b:e]
        if t["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif t["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        elif t["dtype"] == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        else:
            sys.exit(f"{path}: tensor {name} has dtype {t['dtype']}")
        out[name] = a.reshape(t["shape"])
    return out


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):  # x [n, heads, d]
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def layer_masks(cfg, ctx_len, B):
    """Per layer, the [B, ctx_len + B] visibility (True = attend) or None (no mask)."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types")
    if types is None:
        start = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n)]
    qp = np.arange(ctx_len, ctx_len + B)[:, None]  # queries are the last B key positions
    kp = np.arange(ctx_len + B)[None, :]
    out = []
    for t in types:
        sliding = t == "sliding_attention"
        causal = cfg["is_causal"] if cfg.get("is_causal") is not None else sliding
        w = window if sliding else None
        if not causal and w is None:
            out.append(None)
            continue
        vis = np.ones((B, ctx_len + B), dtype=bool)
        if causal:
            vis &= kp <= qp
        if w is not None:
            vis &= qp - kp < w
            if not causal:
                vis &= kp - qp < w
        out.append(vis)
    return out


def grouped_conv(y, dyn, base, gs):
    """y [B, H], dyn [B, K, G], base [K, H] -> [B, H]: the causal taps over the block's rows."""
    out = np.zeros_like(y)
    for o in range(base.shape[0]):
        shifted = np.zeros_like(y)
        shifted[o:] = y[: y.shape[0] - o]
        out += (base[o][None, :] + np.repeat(dyn[:, o, :], gs, axis=1)) * shifted
    return out


def draft(model_dir, hidden, noise):
    cfg = json.load(open(f"{model_dir}/config.json"))
    w = read_safetensors(f"{model_dir}/model.safetensors")
    eps = cfg["rms_norm_eps"]
    theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]  # transformers 5's place
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nq
    ctx_len, B = hidden.shape[0], noise.shape[0]
    c = rms(hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = noise.astype(np.float64)
    qpos = np.arange(ctx_len, ctx_len + B, dtype=np.float64)
    kpos = np.arange(0, ctx_len + B, dtype=np.float64)
    masks = layer_masks(cfg, ctx_len, B)
    v2 = "DFlash2DraftModel" in cfg.get("architectures", [])
    dc = cfg.get("dflash_config", {})
    K, gs = dc.get("conv_kernel_size"), dc.get("conv_group_size")

    def prepare(x, name):  # DFlash2: x convolved with the first taps; the second taps kept
        if not v2:
            return x, None
        dyn = (x @ w[name + ".kernel_projection.weight"].T).reshape(B, 2, K, -1)
        return grouped_conv(x, dyn[:, 0], w[name + ".base_kernel"][0], gs), dyn[:, 1]

    def finish(y, dyn, name):
        return y if dyn is None else grouped_conv(y, dyn, w[name + ".base_kernel"][1], gs)

    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a, a_dyn = prepare(rms(h, w[p + "input_layernorm.weight"], eps), p + "attention_conv")
        kv_in = np.concatenate([c, a], axis=0)
        q = rms((a @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nq, d), w[p + "self_attn.q_norm.weight"], eps)
        k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(-1, nkv, d), w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(-1, nkv, d)
        q, k = rope(q, qpos, theta), rope(k, kpos, theta)
        k, v = np.repeat(k, nq // nkv, axis=1), np.repeat(v, nq // nkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        if masks[i] is not None:
            s = np.where(masks[i][None], s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(B, nq * d)
        h = h + finish(o @ w[p + "self_attn.o_proj.weight"].T, a_dyn, p + "attention_conv")
        m, m_dyn = prepare(rms(h, w[p + "post_attention_layernorm.weight"], eps), p + "mlp_conv")
        g, u = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        h = h + finish((g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T, m_dyn, p + "mlp_conv")
    return rms(h, w["norm.weight"], eps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("hidden")
    ap.add_argument("noise")
    ap.add_argument("out")
    ap.add_argument("--check", help="compare with this .npy (e.g. diffcp draft's output)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max |got - ref| / max |ref| allowed")
    args = ap.parse_args()
    ref = draft(args.model, np.load(args.hidden).astype(np.float64), np.load(args.noise).astype(np.float64))
    np.save(args.out, ref)
    if args.check:
        got = np.load(args.check).astype(np.float64)
        if got.shape != ref.shape:
            sys.exit(f"dflash_reference: shape {got.shape} vs reference {ref.shape}")
        err = np.abs(got - ref).max() / np.abs(ref).max()
        print(f"dflash_reference: max |got - ref| / max |ref| = {err:.3e} (limit {args.rtol:g})")
        if not err <= args.rtol:
            sys.exit("dflash_reference: MISMATCH")
        print("dflash_reference: match")


if __name__ == "__main__":
    main()
