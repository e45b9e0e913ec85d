#!/usr/bin/env python3
"""The Wan 2.1 VAE's decode (diffusers' AutoencoderKLWan at its real shape: base 96, z 16, dim_mult
1 2 4 4, 2 residual blocks; random weights) one process vs diffcp.vae's patch-parallel decode at
P = 1, 2, 4 (issue #70): time, each rank's memory above the loaded model, bytes, and the largest
difference to diffusers' decode.

  PYTHONPATH=build/release/python /tmp/zvenv/bin/python bench/bench_wan_vae.py \\
      [--height 240] [--width 416] [--frames 5] [--runs 2] [--csv bench/wan_vae.csv]

Needs torch + diffusers (PyPI, in a venv that also sees Debian's mpi4py) and the built package.
Rows (interleaved, --runs times each): diffusers (one process, 2 threads), diffusers tiled
(enable_tiling(): its own memory saver, blending 256-pixel tiles: not equal), diffcp patch at P = 1
(2 threads), 2 (one rank a core, 1 thread each) and 4 (oversubscribed: 2 ranks a core; its time is
not comparable, its bytes and memory are). Memory: the largest (over ranks) peak resident set of
the decode minus the rank's resident set just before it (the model and the latent loaded).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(a) -> int:
    import numpy as np
    import torch
    from mpi4py import MPI
    from diffusers import AutoencoderKLWan
    comm = MPI.COMM_WORLD
    P, p = comm.Get_size(), comm.Get_rank()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    vae = AutoencoderKLWan().eval()  # the Wan 2.1 VAE's shape (its diffusers defaults)
    T = (a.frames - 1) // 4 + 1
    z = torch.randn(1, 16, T, a.height // 8, a.width // 8, generator=torch.Generator().manual_seed(1))
    dec = None
    if a.method == "patch":
        from diffcp.vae import PatchParallelDecoder
        dec = PatchParallelDecoder(vae, comm)
    elif a.method == "tiled":
        vae.enable_tiling()
    comm.Barrier()
    before = rss_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = (dec.decode(z, return_dict=False) if dec else vae.decode(z, return_dict=False))[0]
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    dt = comm.allreduce(dt, op=MPI.MAX)
    peak = comm.allreduce(peak, op=MPI.MAX)
    if p == 0:
        o = out.float().numpy()
        ref = Path(a.ref)
        if a.method == "diffusers":
            np.save(ref, o)
        diff = float(np.abs(o - np.load(ref)).max()) if ref.exists() else float("nan")
        sent = sum(dec.stats.values()) if dec else 0
        print(json.dumps({"decode_s": round(dt, 3), "peak_mb": round(peak, 1), "bytes_rank0": sent,
                          "max_abs_diff": diff, "shape": list(out.shape)}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--height", type=int, default=240)
    ap.add_argument("--width", type=int, default=416)
    ap.add_argument("--frames", type=int, default=5)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--csv", default=str(ROOT / "bench" / "wan_vae.csv"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ref", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    isa = "avx512" if "avx512f" in open("/proc/cpuinfo").read() else "avx2"
    tmp = tempfile.TemporaryDirectory()
    ref = Path(tmp.name) / "ref.npy"
    configs = [("diffusers", 1, 2), ("tiled", 1, 2), ("patch", 1, 2), ("patch", 2, 1), ("patch", 4, 1)]
    rows = []
    for run in range(a.runs):
        for method, P, threads in configs:
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(P), sys.executable, __file__, "--worker",
                   "--method", method, "--threads", str(threads), "--ref", str(ref), "--height", str(a.height),
                   "--width", str(a.width), "--frames", str(a.frames)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{method} P = {P}: failed\n{r.stderr[-3000:]}")
                return 2
            res = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
            row = {"cpu": cpu, "isa": isa, "date": time.strftime("%Y-%m-%d"), "height": a.height, "width": a.width,
                   "frames": a.frames, "method": method, "P": P, "threads_per_rank": threads,
                   "oversubscribed": P * threads > os.cpu_count(), "run": run, **{k: res[k] for k in
                                                                                 ("decode_s", "peak_mb", "bytes_rank0",
                                                                                  "max_abs_diff")}}
            rows.append(row)
            print(f"run {run} {method:9s} P = {P}: {row['decode_s']:8.2f} s, peak {row['peak_mb']:8.1f} MB above the "
                  f"model, rank 0 sent {row['bytes_rank0'] / 1e6:7.2f} MB, max |diff| {row['max_abs_diff']:.1e}",
                  flush=True)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
