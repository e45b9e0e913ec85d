#!/usr/bin/env python3
"""diffusers' WanTransformer3DModel forward on the CPU, beside diffcp's step (bench/bench_wan.sh diffusers).

Loads FOLDER/transformer (a folder tools/wan_reference.py make wrote) in float32, runs one forward on
FOLDER's noise.npy [1, C, F, H/8, W/8] and txt.npy [T, E] at the first step's timestep (1000, sigma 1)
REPS times with `--threads` torch threads, and prints one CSV row for bench/wan_step.csv:
PREFIX,1,diffusers,1,yes,<median ms>,0,0,0,0,<load1>. diffcp's velocity from the same inputs
(DUMP/velocity_0.npy: `diffcp dit --dump-velocity` at P = 1, guidance 1) must agree (relative error
max|a - b| / max|b| < 1e-4, printed on stderr); exit 1 otherwise.

Needs torch and diffusers (PyPI): python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch diffusers
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import WanTransformer3DModel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--row-prefix", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    folder = Path(a.folder)
    model = WanTransformer3DModel.from_pretrained(str(folder / "transformer"), torch_dtype=torch.float32).eval()
    x = torch.from_numpy(np.load(folder / "noise.npy").astype(np.float32))
    txt = torch.from_numpy(np.load(folder / "txt.npy").astype(np.float32))[None]
    t = torch.tensor([1000.0], dtype=torch.float32)
    times, v = [], None
    with torch.no_grad():
        for _ in range(a.reps):
            t0 = time.perf_counter()
            v = model(hidden_states=x, timestep=t, encoder_hidden_states=txt, return_dict=False)[0]
            times.append((time.perf_counter() - t0) * 1e3)
    ours = np.load(Path(a.dump) / "velocity_0.npy").astype(np.float64)
    ref = v.double().numpy()
    rel = float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))
    print(f"bench_wan_diffusers: diffusers {statistics.median(times):.0f} ms (runs {[round(s) for s in times]}), "
          f"diffcp's P = 1 velocity vs diffusers': relative error {rel:.2e}", file=sys.stderr)
    load1 = Path("/proc/loadavg").read_text().split()[0]
    print(f"{a.row_prefix},1,diffusers,1,yes,{statistics.median(times):.1f},0,0,0,0,{load1}")
    return 0 if rel < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
