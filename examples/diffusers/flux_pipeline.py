#!/usr/bin/env python3
"""A prompt to a PNG with a diffusers FluxPipeline whose transformer runs on diffcp across ranks.

  mpirun -np 2 python examples/diffusers/flux_pipeline.py --model PIPELINE_DIR --prompt "..." --out image.png

PIPELINE_DIR: a FluxPipeline folder (e.g. a download of black-forest-labs/FLUX.1-dev or -schnell,
or the tiny one tools/diffusers_pipeline_check.py --out DIR writes under DIR/pipe). Every rank runs
the text encoders and the VAE (replicated); diffcp runs the transformer: its weights stay in bf16
when the folder stores them so (--shard-weights: 1/P of every block's per rank; FLUX.1-dev at P = 2
then needs 12.65 GB of weights per rank, docs/dit.md).
"""
import argparse

import torch
from diffusers import FluxPipeline
from mpi4py import MPI

import diffcp.diffusers

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", required=True)
ap.add_argument("--prompt", default="a lighthouse on a rocky coast at dusk")
ap.add_argument("--height", type=int, default=1024)
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--steps", type=int, default=28)
ap.add_argument("--guidance", type=float, default=3.5)
ap.add_argument("--max-sequence-length", type=int, default=512)
ap.add_argument("--mode", default="cocodiff", choices=["flat", "tapa", "vfirst", "cocodiff"])
ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
ap.add_argument("--shard-weights", action="store_true")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--out", default="flux.png")
a = ap.parse_args()

pipe = FluxPipeline.from_pretrained(a.model, torch_dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32)
pipe = diffcp.diffusers.parallelize(pipe, mode=a.mode, dtype=a.dtype, shard_weights=a.shard_weights)
result = pipe(prompt=a.prompt, height=a.height, width=a.width, num_inference_steps=a.steps, guidance_scale=a.guidance,
              max_sequence_length=a.max_sequence_length, generator=torch.Generator().manual_seed(a.seed))
if MPI.COMM_WORLD.Get_rank() == 0:
    result.images[0].save(a.out)
    print(f"{a.out}: {a.width}x{a.height}, {a.steps} steps, P = {MPI.COMM_WORLD.Get_size()} ({a.mode}, "
          f"weights {pipe.core.config()['weights_dtype']}{', sharded' if a.shard_weights else ''})")
