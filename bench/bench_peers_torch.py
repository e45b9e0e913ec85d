#!/usr/bin/env python3
"""diffcp's CPU kernels next to what a CPU user would pick instead (same run, same shape).

  attention: the DFlash block-sparse mask (bench_attention's, written by --dump-mask) on
             PyTorch's scaled_dot_product_attention (dense boolean mask, enable_gqa; forward +
             backward) and on torch.compile'd FlexAttention (block mask from a mask_mod; forward),
             in f32 and bf16 (--dtypes), against bench_attention's forward and backward in the same
             dtype and the same-run oneDNN GEMM rates; --amx-ab adds diffcp's bf16 with AMX off
             (DIFFCP_CPU_AMX=0: the tile path of a CPU without AMX); --rounds R interleaves them.
  dit:       one denoising step of the DiT: `diffcp dit` (step_ms, P = 1, f32 and bf16, with its
             per-op-family --profile) against Black Forest Labs' own FLUX model (flux.model.Flux from
             a checkout of github.com/black-forest-labs/flux, --flux-src; not part of diffcp) at the
             same FluxParams (from `diffcp dit --dry-run`), same image and text tokens, random
             weights, torch.inference_mode; with --openvino, that PyTorch model through OpenVINO as a
             CPU user runs it (openvino.convert_model, compiled for the CPU at f32 and at bf16, one
             stream, --threads threads, PERF_COUNT per op type), each output checked against
             PyTorch's. --shape small | flux: issue #54's two shapes (DIT_SHAPES); --p2 adds diffcp's
             sequence-parallel step at P = 2 (mpirun, one thread per rank); --rounds R interleaves
             every runtime once per round and reports medians over the rounds.

--isa avx2 runs both sides as on an AVX2-only CPU (DIFFCP_CPU_ISA=avx2, oneDNN capped at AVX2 for
diffcp; ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2 for
PyTorch and OpenVINO's oneDNN; the row's ov_*_exec_types say which kernels OpenVINO ran); --isa
native lets each pick what the CPU has. Threads: --threads for all (OMP and torch.set_num_threads,
OpenVINO's INFERENCE_NUM_THREADS). Medians of --reps after a warm-up. Prints one JSON object per run
and appends it to --csv when given.

PyTorch and OpenVINO are not diffcp dependencies: `--venv DIR --install` makes DIR a venv with
torch, numpy, einops and openvino from PyPI (about 3 GB: the PyPI torch wheel pulls the CUDA
libraries) and runs the peers in it; without --install, DIR must already have them (or omit --venv
to use this python3's). Not part of CI.

  bench/bench_peers_torch.py attention --venv /work/torch-venv --install --isa avx2
  bench/bench_peers_torch.py attention --venv /work/torch-venv --rounds 3 --amx-ab --csv bench/amx_attention.csv
  bench/bench_peers_torch.py dit --venv /work/torch-venv --flux-src /path/to/flux --openvino --shape small \
      --rounds 3 --p2 --csv bench/dit_cpu_peers.csv
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "release"


def isa_env(isa: str, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if isa == "avx2":
        env.update({"DIFFCP_CPU_ISA": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    elif isa == "avx512":
        env.update({"DIFFCP_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512"})
    return env


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_python(a: argparse.Namespace) -> str:
    if not a.venv:
        return sys.executable
    py = Path(a.venv) / "bin" / "python"
    if a.install:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch", "numpy", "einops", "openvino"], check=True)
    if not py.exists():
        sys.exit(f"bench_peers_torch: no venv at {a.venv} (add --install to make one)")
    return str(py)


# ----------------------------------------------------------------------------- PyTorch side
def median_ms(fn, reps: int) -> float:
    import time

    fn()  # warm-up (and torch.compile's compilation)
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    t.sort()
    return t[len(t) // 2]


def torch_attention(a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_num_threads(a.threads)
    m = json.loads(Path(a.mask).read_text())
    B, S, Lk, Q = m["block"], m["context_rows"], m["key_rows"], m["query_rows"]
    ctx = torch.tensor(m["ctx"], dtype=torch.int64)  # [N, 2]: block i sees context [b, e) and its own rows
    g = torch.Generator().manual_seed(1)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    q = torch.randn(1, a.n_q, Q, a.d_h, generator=g).to(dt)
    k = torch.randn(1, a.n_kv, Lk, a.d_h, generator=g).to(dt)
    v = torch.randn(1, a.n_kv, Lk, a.d_h, generator=g).to(dt)
    dout = torch.randn(1, a.n_q, Q, a.d_h, generator=g).to(dt)
    blk = torch.arange(Q) // B
    kv = torch.arange(Lk)
    own = S + blk * B
    dense = ((kv[None, :] >= ctx[blk, 0][:, None]) & (kv[None, :] < ctx[blk, 1][:, None])) | (
        (kv[None, :] >= own[:, None]) & (kv[None, :] < own[:, None] + B))
    visible = int(dense.sum())

    def mask_mod(b, h, q_idx, kv_idx):
        i = q_idx // B
        lo, hi, o = ctx[i, 0], ctx[i, 1], S + i * B
        return ((kv_idx >= lo) & (kv_idx < hi)) | ((kv_idx >= o) & (kv_idx < o + B))

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def sdpa_fwd_bwd():
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense, enable_gqa=True)
        out.backward(dout)
        qg.grad = kg.grad = vg.grad = None

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)

    block_mask = create_block_mask(mask_mod, None, None, Q, Lk, device="cpu")
    flex = torch.compile(flex_attention)

    def flex_fwd():
        with torch.no_grad():
            flex(q, k, v, block_mask=block_mask, enable_gqa=True)

    # The dense-mask SDPA's result equals the masked softmax: check one call against FlexAttention.
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        got = flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    err = float((ref.float() - got.float()).abs().max())
    return {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dtype": a.dtype, "visible_pairs_per_head": visible, "sdpa_fwd_ms": median_ms(sdpa_fwd, a.reps),
            "sdpa_fwd_bwd_ms": median_ms(sdpa_fwd_bwd, a.reps), "flex_compiled_fwd_ms": median_ms(flex_fwd, a.reps),
            "flex_vs_sdpa_max_abs_diff": err}


def torch_dit(a: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(Path(a.flux_src) / "src"))
    from flux.model import Flux, FluxParams  # Black Forest Labs' model (not diffcp code)

    torch.set_num_threads(a.threads)
    p = json.loads(Path(a.params).read_text())
    fp = p["flux_params"]
    params = FluxParams(**{k: fp[k] for k in FluxParams.__dataclass_fields__})
    torch.manual_seed(1)
    model = Flux(params).eval()
    n_img, n_txt = p["image_tokens"], p["text_tokens"]
    h, w = p["height"] // 16, p["width"] // 16
    img = torch.randn(1, n_img, params.in_channels)
    txt = torch.randn(1, n_txt, params.context_in_dim)
    y = torch.randn(1, params.vec_in_dim)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    img_ids = img_ids.reshape(1, h * w, 3)
    txt_ids = torch.zeros(1, n_txt, 3)
    t = torch.full((1,), 0.5)
    guid = torch.full((1,), 3.5) if params.guidance_embed else None

    def step():
        with torch.inference_mode():
            v = model(img=img, img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=t, y=y, guidance=guid)
            img.add_(v, alpha=-0.02)  # the Euler update, as a sampler step does

    n_par = sum(x.numel() for x in model.parameters())
    row = {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_parameters": n_par}
    if not a.no_torch:
        row["flux_step_ms"] = median_ms(step, a.reps)
    if a.openvino:
        row.update(openvino_dit(a, model, dict(img=img, img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=t, y=y,
                                               guidance=guid)))
    return row


def openvino_dit(a: argparse.Namespace, model, inputs: dict) -> dict:
    """The same model through OpenVINO as a CPU user runs it: convert_model on the PyTorch module,
    compiled for the CPU at each precision (f32 forced; bf16 = its default where the CPU has
    avx512_bf16 / AMX), one stream, --threads threads; the output checked against PyTorch's."""
    import numpy as np
    import openvino as ov
    import torch

    inputs = {k: v for k, v in inputs.items() if v is not None}
    with torch.inference_mode():
        ref = model(**inputs).numpy()
    ov_model = ov.convert_model(model, example_input=inputs)
    core = ov.Core()
    row = {"openvino": ov.__version__}
    names = [i.get_any_name() for i in ov_model.inputs]
    feed = [inputs[n].numpy() for n in names]
    # Capped at AVX2 (--isa avx2), OpenVINO's CPU plugin has no bf16 kernels (it refuses the model): f32 only.
    precisions = ("f32",) if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else ("f32", "bf16")
    for prec in precisions:
        cfg = {"INFERENCE_PRECISION_HINT": prec, "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": str(a.threads),
               "PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": "YES" if a.ov_profile else "NO"}
        compiled = core.compile_model(ov_model, "CPU", cfg)
        req = compiled.create_infer_request()
        img = feed[names.index("img")]

        def step():
            out = req.infer(feed)[0]
            np.subtract(img, 0.02 * out, out=img)  # the Euler update, as in the PyTorch step

        start = img.copy()
        got = req.infer(feed)[0]
        peak = float(np.abs(ref).max())
        row[f"ov_{prec}_max_err_over_peak"] = float(np.abs(got - ref).max()) / peak
        row[f"ov_{prec}_step_ms"] = median_ms(step, a.reps)
        img[...] = start
        if a.ov_profile:  # per op type: the sum of each node's real time in the last call
            fam: dict[str, float] = {}
            for n in req.profiling_info:
                fam[n.node_type] = fam.get(n.node_type, 0.0) + n.real_time.total_seconds() * 1e3
            row[f"ov_{prec}_profile_ms"] = {k: round(v, 3) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])}
            row[f"ov_{prec}_exec_types"] = sorted({n.exec_type for n in req.profiling_info if n.node_type in
                                                    ("FullyConnected", "MatMul", "ScaledDotProductAttention")})
    return row


# ----------------------------------------------------------------------------- driver
def record(a: argparse.Namespace, row: dict) -> None:
    print(json.dumps(row))
    if a.csv:  # rows of different runs may have different columns: the file keeps their union
        path = Path(a.csv)
        rows = list(csv.DictReader(path.open())) if path.exists() else []
        fields = list(rows[0].keys()) if rows else []
        fields += [k for k in row if k not in fields]
        with path.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=fields)
            wr.writeheader()
            wr.writerows(rows + [row])


# The two model shapes of the DiT comparison (issue #54): the default preset (FLUX architecture at
# hidden 768, 24 x 32 heads, 2 double + 4 single blocks, 512^2 image = 1024 tokens + 64 text), and
# FLUX.1's real width (3072, 24 x 128, MLP 12288) at reduced depth, 1024^2 image (4096 tokens) with
# FLUX's 512 text tokens.
DIT_SHAPES = {
    "small": ["--resolution", "512", "--text-tokens", "64"],
    "flux": ["--resolution", "1024", "--text-tokens", "512", "--heads", "24", "--head-dim", "128", "--mlp-hidden",
             "12288", "--double-blocks", "1", "--single-blocks", "2"],
}


def median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def cmd_attention(a: argparse.Namespace) -> None:
    """bench_attention (f32 and bf16; with --amx-ab also bf16 with DIFFCP_CPU_AMX=0, the tile path a
    CPU without AMX runs) and PyTorch's SDPA / compiled FlexAttention in each --dtypes, on the same
    mask, interleaved --rounds times (every runtime once per round); medians over the rounds, and
    the spread (min-max) of the same-run GEMM rates, as this kind's machines are noisy."""
    env = isa_env(a.isa, a.threads)
    dtypes = a.dtypes.split(",")
    runs: dict[str, list[float]] = {}
    keep: dict[str, object] = {}

    def add(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        mask = Path(tmp) / "mask.json"
        base = [str(a.bench), "--samples", str(a.samples), "--context", str(a.context), "--anchors", str(a.anchors),
                "--n-q", str(a.n_q), "--n-kv", str(a.n_kv), "--d-h", str(a.d_h), "--reps", str(a.reps), "--json"]
        for _ in range(a.rounds):
            ours = run_json(base + ["--dtype", "both", "--dump-mask", str(mask)], env)
            keep.update(kernels=ours["kernels"], bf16_path=ours["bf16_path"],
                        visible_pairs_per_head=ours["visible_pairs_per_head"])
            for k in ("fwd_ms", "bwd_ms", "bf16_fwd_ms", "bf16_bwd_ms", "gemm_f32_gflops", "gemm_bf16_gflops",
                      "fwd_over_f32_gemm", "bwd_over_f32_gemm", "bf16_fwd_over_bf16_gemm", "bf16_bwd_over_bf16_gemm"):
                if ours.get(k) is not None:
                    add(k, ours[k])
            if a.amx_ab:
                off = run_json(base + ["--dtype", "bf16"], dict(env, DIFFCP_CPU_AMX="0"))
                keep["bf16_path_amx_off"] = off["bf16_path"]
                add("amx_off_bf16_fwd_ms", off["bf16_fwd_ms"])
                add("amx_off_bf16_bwd_ms", off["bf16_bwd_ms"])
                add("amx_gain_fwd", off["bf16_fwd_ms"] / ours["bf16_fwd_ms"])
                add("amx_gain_bwd", off["bf16_bwd_ms"] / ours["bf16_bwd_ms"])
            for dt in dtypes:
                peer = run_json([torch_python(a), __file__, "_torch_attention", "--mask", str(mask), "--n-q",
                                 str(a.n_q), "--n-kv", str(a.n_kv), "--d-h", str(a.d_h), "--reps", str(a.reps),
                                 "--threads", str(a.threads), "--dtype", dt], env)
                assert peer["visible_pairs_per_head"] == ours["visible_pairs_per_head"], "the two masks differ"
                keep.update(torch=peer["torch"], torch_cpu_capability=peer["torch_cpu_capability"])
                pre = "" if dt == "f32" else "bf16_"
                fwd, fb = ours[f"{pre}fwd_ms"], ours[f"{pre}fwd_ms"] + ours[f"{pre}bwd_ms"]
                add(f"sdpa_{dt}_fwd_ms", peer["sdpa_fwd_ms"])
                add(f"sdpa_{dt}_fwd_bwd_ms", peer["sdpa_fwd_bwd_ms"])
                add(f"flex_{dt}_fwd_ms", peer["flex_compiled_fwd_ms"])
                add(f"speedup_{dt}_vs_flex_fwd", peer["flex_compiled_fwd_ms"] / fwd)
                add(f"speedup_{dt}_vs_sdpa_fwd", peer["sdpa_fwd_ms"] / fwd)
                add(f"speedup_{dt}_vs_sdpa_fwd_bwd", peer["sdpa_fwd_bwd_ms"] / fb)
    row = {"what": "attention_rounds", "isa": a.isa, "threads": a.threads, "rounds": a.rounds, "samples": a.samples,
           "context": a.context, "anchors": a.anchors, "n_q": a.n_q, "n_kv": a.n_kv, "d_h": a.d_h}
    row.update(keep)
    row.update({k: round(median(v), 3) for k, v in runs.items()})
    for k in ("gemm_bf16_gflops", "gemm_f32_gflops"):
        if k in runs:
            row[f"{k}_spread"] = f"{min(runs[k]):.0f}-{max(runs[k]):.0f}"
    record(a, row)


def cmd_dit(a: argparse.Namespace) -> None:
    if not a.flux_src or not (Path(a.flux_src) / "src" / "flux" / "model.py").exists():
        sys.exit("bench_peers_torch dit: --flux-src must be a checkout of github.com/black-forest-labs/flux")
    env = isa_env(a.isa, a.threads)
    shape = DIT_SHAPES[a.shape] if a.shape else ["--resolution", str(a.resolution)]
    base = [str(a.diffcp), "dit", *shape, "--out", "", "--json"]
    # P = 2: one thread per rank on the same cores (Open MPI binds each rank to a core at np <= 2)
    env_p2 = dict(env, OMP_NUM_THREADS=str(max(1, a.threads // 2)))
    mpi = ["mpirun", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS"]
    runs: dict[str, list[float]] = {}
    profiles: dict[str, dict] = {}
    keep: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp) / "params.json"
        dry = run_json(base + ["--dry-run"], env)
        params.write_text(json.dumps(dry))
        for _ in range(a.rounds):  # interleaved: every runtime once per round, medians over the rounds
            for dt in ("f32", "bf16"):
                ours = run_json(base + ["--steps", str(a.steps), "--dtype", dt, "--profile"], env)
                runs.setdefault(f"diffcp_{dt}_step_ms", []).append(ours["step_ms"])
                profiles[f"diffcp_{dt}"] = ours["profile_ms_per_step"]
                if a.p2:
                    two = run_json(mpi + base + ["--steps", str(a.steps), "--dtype", dt], env_p2)
                    runs.setdefault(f"diffcp_p2_{dt}_step_ms", []).append(two["step_ms"])
            if a.no_peers:
                continue
            peer = run_json([torch_python(a), __file__, "_torch_dit", "--params", str(params), "--flux-src", a.flux_src,
                             "--reps", str(a.reps), "--threads", str(a.threads)] +
                            (["--openvino", "--ov-profile"] if a.openvino else []) + (["--no-torch"] if a.no_torch else []),
                            env)
            for k, v in peer.items():
                if k.endswith("_step_ms"):
                    runs.setdefault(k, []).append(v)
                elif k.endswith("_profile_ms"):
                    profiles[k[:-len("_profile_ms")]] = v
                else:
                    keep[k] = v
    row = {"what": "dit_step", "shape": a.shape or f"resolution {a.resolution}", "isa": a.isa, "threads": a.threads,
           "rounds": a.rounds, "image_tokens": dry["image_tokens"] if "image_tokens" in dry else None,
           "diffcp_parameters": dry["parameters"]}
    row.update({k: v for k, v in keep.items() if not k.endswith("_exec_types")})
    row.update({k: round(median(v), 2) for k, v in runs.items()})
    for dt in ("f32", "bf16"):
        ours = row.get(f"diffcp_{dt}_step_ms")
        for peer in ("flux", "ov"):
            key = "flux_step_ms" if peer == "flux" else f"ov_{dt}_step_ms"
            if ours and row.get(key) and (peer == "ov" or dt == "f32"):
                row[f"speedup_{dt}_vs_{peer}"] = round(row[key] / ours, 3)
        if row.get(f"diffcp_p2_{dt}_step_ms"):
            row[f"p2_speedup_{dt}"] = round(ours / row[f"diffcp_p2_{dt}_step_ms"], 3)
    for k, v in keep.items():
        if k.endswith("_exec_types"):
            row[k] = " ".join(v)
    row["profiles"] = json.dumps(profiles, sort_keys=True)  # per op family, ms per step (the last round's)
    record(a, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("attention", "dit"):
        s = sub.add_parser(name)
        s.add_argument("--isa", choices=["avx2", "avx512", "native"], default="native")
        s.add_argument("--threads", type=int, default=2)
        s.add_argument("--reps", type=int, default=5)
        s.add_argument("--venv", help="venv with torch (see --install)")
        s.add_argument("--install", action="store_true", help="create --venv and pip install torch numpy einops")
        s.add_argument("--csv", help="append the result row to this CSV")
    at = sub.choices["attention"]
    at.add_argument("--bench", type=Path, default=BUILD / "bench" / "bench_attention")
    at.add_argument("--samples", type=int, default=2)
    at.add_argument("--context", type=int, default=4096)
    at.add_argument("--anchors", type=int, default=64)
    at.add_argument("--n-q", type=int, default=8)
    at.add_argument("--n-kv", type=int, default=2)
    at.add_argument("--d-h", type=int, default=64)
    at.add_argument("--dtypes", default="f32,bf16", help="the peers' dtypes (comma-separated)")
    at.add_argument("--rounds", type=int, default=1, help="interleaved rounds (every runtime once each); medians")
    at.add_argument("--amx-ab", action="store_true", help="bf16 with DIFFCP_CPU_AMX=0 too (same run)")
    dt = sub.choices["dit"]
    dt.add_argument("--diffcp", type=Path, default=BUILD / "src" / "diffcp")
    dt.add_argument("--flux-src", help="checkout of github.com/black-forest-labs/flux")
    dt.add_argument("--resolution", type=int, default=256)
    dt.add_argument("--shape", choices=sorted(DIT_SHAPES), help="a model shape of issue #54 (overrides --resolution)")
    dt.add_argument("--steps", type=int, default=10)
    dt.add_argument("--rounds", type=int, default=1, help="interleaved rounds (every runtime once each); medians")
    dt.add_argument("--openvino", action="store_true", help="OpenVINO too (the venv needs `openvino`; --install adds it)")
    dt.add_argument("--p2", action="store_true", help="diffcp's sequence-parallel step at P = 2 too (mpirun)")
    dt.add_argument("--no-torch", action="store_true", help="skip the PyTorch model's timing (it still builds the model)")
    dt.add_argument("--no-peers", action="store_true", help="diffcp only")
    # the PyTorch side, run in the venv's python with the ISA environment
    ta = sub.add_parser("_torch_attention")
    ta.add_argument("--mask", required=True)
    td = sub.add_parser("_torch_dit")
    td.add_argument("--params", required=True)
    td.add_argument("--flux-src", required=True)
    td.add_argument("--openvino", action="store_true")
    td.add_argument("--ov-profile", action="store_true")
    td.add_argument("--no-torch", action="store_true")
    for s in (ta, td):
        s.add_argument("--reps", type=int, default=5)
        s.add_argument("--threads", type=int, default=2)
    ta.add_argument("--n-q", type=int, required=True)
    ta.add_argument("--n-kv", type=int, required=True)
    ta.add_argument("--d-h", type=int, required=True)
    ta.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    if a.cmd == "_torch_attention":
        print(json.dumps(torch_attention(a)))
    elif a.cmd == "_torch_dit":
        print(json.dumps(torch_dit(a)))
    elif a.cmd == "attention":
        cmd_attention(a)
    else:
        cmd_dit(a)


if __name__ == "__main__":
    main()
