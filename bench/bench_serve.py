#!/usr/bin/env python3
"""The image server's throughput and latency (issue #68): `python -m diffcp.serve` at P = 1 and 2,
batching on (--max-batch 4, --batch-wait-ms 20: one transformer batch with per-image text) and off
(--max-batch 1), 1, 2 and 4 concurrent clients each sending --requests requests of one image.

The pipeline is the stand-in FLUX.1 pipeline (python/tests_mpi/standin_pipeline.py: a hashed
"text encoder" of 64 tokens and a latent -> RGB map instead of the VAE), so the figures are the
transformer's and the server's: a FLUX.1-architecture transformer of hidden 768 (24 heads x 32,
2 double + 4 single blocks, seeded random weights; `diffcp dit`'s default model), 256 x 256 images
(256 image tokens), --steps steps, bf16, mode cocodiff. Ranks are bound one per core
(mpirun --bind-to core) with OMP_NUM_THREADS=1: P = 1 uses one core, P = 2 both.

Also the time the server adds over the in-process call: one request's latency at one client (P = 1,
batching off) against parallelize(pipe)(...) timed in process at P = 1 (the same pipeline, the same
request), interleaved in each round.

Rounds: every (P, batching) server started afresh in each of --rounds rounds; medians over rounds
are reported (and the spread). Writes --out (CSV, one row per round and point). Not run by CI.
Usage: bench/bench_serve.py [--rounds 3] [--requests 4] [--steps 8] [--out bench/serve.csv]
"""
import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = os.environ.get("DIFFCP_PYTHON", "/usr/bin/python3")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
           DIFFCP_STANDIN_TEXT_TOKENS="64",
           PYTHONPATH=f"{ROOT}/build/release/python:{ROOT}/python/tests_mpi")
SIZE = 256


def start(folder, P, batching, steps):
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "core", "-np", str(P), PY, "-m", "diffcp.serve",
           "--pipeline", folder, "--pipeline-factory", "standin_pipeline:make", "--port", "0", "--mode", "cocodiff",
           "--dtype", "bf16", "--size", f"{SIZE}x{SIZE}", "--steps", str(steps), "--max-queue", "64"]
    cmd += ["--max-batch", "4", "--batch-wait-ms", "20"] if batching else ["--max-batch", "1", "--batch-wait-ms", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    port = None
    for line in proc.stdout:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "diffcp.serve: ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, port
    raise SystemExit("the server did not start")


def request(port, prompt, seed):
    body = json.dumps({"prompt": prompt, "seed": seed, "size": f"{SIZE}x{SIZE}"}).encode()
    t = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/images/generations",
                                                       data=body), timeout=600) as r:
        assert r.status == 200
        r.read()
    return time.perf_counter() - t


def clients(port, n, requests):
    lat = []
    lock = threading.Lock()

    def client(c):
        for k in range(requests):
            s = request(port, f"client {c} request {k}", 1000 * c + k)
            with lock:
                lat.append(s)

    t = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t, sorted(lat)


IN_PROCESS = r"""
import sys, time, torch
from pathlib import Path
import diffcp.diffusers
from standin_pipeline import FluxPipeline
par = diffcp.diffusers.parallelize(FluxPipeline(Path(sys.argv[1])), mode="cocodiff", dtype="bf16")
times = []
for k in range(int(sys.argv[3]) + 1):
    t = time.perf_counter()
    par(prompt=f"in process {k}", height=%d, width=%d, num_inference_steps=int(sys.argv[2]),
        generator=[torch.Generator("cpu").manual_seed(k)], output_type="np")
    times.append(time.perf_counter() - t)
print(" ".join(str(t) for t in times[1:]))
""" % (SIZE, SIZE)


def in_process(folder, steps, reps):
    out = subprocess.run(["mpirun", "--bind-to", "core", "-np", "1", PY, "-c", IN_PROCESS, folder, str(steps), str(reps)],
                         env=ENV, check=True, capture_output=True, text=True).stdout
    return [float(v) for v in out.split()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "serve.csv"))
    a = ap.parse_args()
    folder = tempfile.mkdtemp()
    subprocess.run([PY, str(ROOT / "tools" / "flux_reference.py"), "make", "--out", folder, "--format", "diffusers",
                    "--heads", "24", "--hidden", "768", "--depth", "2", "--depth-single", "4", "--axes-dim", "4,14,14",
                    "--context-in-dim", "256", "--vec-in-dim", "256"], check=True,
                   stdout=subprocess.DEVNULL)
    rows = []
    for rnd in range(a.rounds):
        for P in (1, 2):
            for batching in (True, False):
                proc, port = start(folder, P, batching, a.steps)
                request(port, "warm-up", 0)  # primitives made, weights packed
                for n in (1, 2, 4):
                    wall, lat = clients(port, n, a.requests)
                    rows.append({"round": rnd, "P": P, "batching": int(batching), "clients": n,
                                 "images": len(lat), "wall_s": round(wall, 4),
                                 "images_per_s": round(len(lat) / wall, 4),
                                 "latency_ms_median": round(1e3 * statistics.median(lat), 1),
                                 "latency_ms_max": round(1e3 * lat[-1], 1)})
                    print(rows[-1], flush=True)
                proc.send_signal(10)  # SIGUSR1: a graceful stop
                proc.wait(120)
        t = in_process(folder, a.steps, a.requests)
        rows.append({"round": rnd, "P": 1, "batching": -1, "clients": 1, "images": len(t), "wall_s": round(sum(t), 4),
                     "images_per_s": round(len(t) / sum(t), 4),
                     "latency_ms_median": round(1e3 * statistics.median(t), 1), "latency_ms_max": round(1e3 * max(t), 1)})
        print(rows[-1], flush=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
