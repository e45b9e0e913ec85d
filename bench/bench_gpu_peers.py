#!/usr/bin/env python3
"""The DFlash block-sparse attention on the device's PyTorch, next to diffcp's (issue #55).

Runs on a lent GPU from scripts/gpu_check.sh (the device image's python3 holds PyTorch; nothing
here runs in CI). Reads the mask that `bench_device_attention --dump-mask FILE` wrote (the same
workload, key rows [0, S) the packed context and [S + i B, S + (i + 1) B) block i's own rows) and
times, in bf16 with GQA:
  * FlexAttention, compiled, with that block mask (create_block_mask over the DFlash rule);
  * SDPA with the dense boolean mask;
  * a bf16 GEMM of --gemm-n cubed (the same-run rate the goals are stated against).
Forward and forward + backward, medians of --reps after warm-ups (wall clock, synchronised). One
JSON line.

Usage: python3 bench/bench_gpu_peers.py --mask mask.json --n-q 32 --n-kv 8 --d-h 128 [--reps 10]
"""
import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mask", required=True, help="bench_device_attention --dump-mask's JSON")
    ap.add_argument("--n-q", type=int, default=32)
    ap.add_argument("--n-kv", type=int, default=8)
    ap.add_argument("--d-h", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--no-sdpa", action="store_true", help="skip SDPA (its dense mask is Q x L_k bytes)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to rehearse the script (FlexAttention on CPU)")
    a = ap.parse_args()

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    m = json.load(open(a.mask))
    B, S, Lk, Q = m["block"], m["context_rows"], m["key_rows"], m["query_rows"]
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    ctx = torch.tensor(m["ctx"], dtype=torch.int64, device=dev)  # [N, 2]: block i sees context [begin, end)
    ctx_begin, ctx_end = ctx[:, 0].contiguous(), ctx[:, 1].contiguous()

    def visible(q_idx, kv_idx):
        i = q_idx // B
        in_ctx = (kv_idx < S) & (kv_idx >= ctx_begin[i]) & (kv_idx < ctx_end[i])
        own = (kv_idx >= S) & ((kv_idx - S) // B == i)
        return in_ctx | own

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_idx, kv_idx)

    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=Q, KV_LEN=Lk, device=dev)
    flex = torch.compile(flex_attention)
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, a.n_q, Q, a.d_h, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=cuda)
    k = torch.randn(1, a.n_kv, Lk, a.d_h, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=cuda)
    v = torch.randn(1, a.n_kv, Lk, a.d_h, device=dev, dtype=torch.bfloat16, generator=gen, requires_grad=cuda)
    do = torch.randn(1, a.n_q, Q, a.d_h, device=dev, dtype=torch.bfloat16, generator=gen)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, warm=3):  # ms, median of --reps after `warm` runs
        for _ in range(warm):
            fn()
        sync()
        t = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            t.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(t)

    def fwd_bwd(attn):
        def run():
            q.grad = k.grad = v.grad = None
            attn().backward(do)
        return run

    r = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu", "query_rows": Q, "key_rows": Lk,
         "n_q": a.n_q, "n_kv": a.n_kv, "d_h": a.d_h, "reps": a.reps,
         "flex_sparsity": float(block_mask.sparsity())}
    flex_call = lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    with torch.no_grad():
        r["flex_fwd_ms"] = timed(flex_call)
    if cuda:  # (FlexAttention has no backward on the CPU)
        r["flex_fwd_bwd_ms"] = timed(fwd_bwd(flex_call))
    if not a.no_sdpa:
        qi = torch.arange(Q, device=dev)[:, None]
        ki = torch.arange(Lk, device=dev)[None, :]
        dense = visible(qi, ki)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        with torch.no_grad():
            r["sdpa_fwd_ms"] = timed(sdpa)
            # the two masks agree (rows that see nothing: SDPA gives NaN, FlexAttention 0)
            diff = (flex_call().float() - sdpa().float()).nan_to_num(0.0).abs().max().item()
            r["flex_vs_sdpa_max_abs"] = diff
        if cuda:
            r["sdpa_fwd_bwd_ms"] = timed(fwd_bwd(sdpa))
    n = a.gemm_n
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=gen)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=gen)
    r["torch_gemm_bf16_gflops"] = 2 * n ** 3 / (timed(lambda: x @ y) * 1e6)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
