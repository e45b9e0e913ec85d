"""Shared by the example scripts beside it: a diffusers pipeline from a folder, its transformer run
on diffcp across the `mpirun` ranks, one image from a prompt written as a PNG by rank 0.

Every rank runs the script; the text encoders and the VAE run on every rank (replicated), diffcp
runs the transformer (docs/python.md, "A diffusers pipeline, sequence-parallel").
"""
import argparse

import torch
from mpi4py import MPI

import diffcp.diffusers


def main(pipeline_class: str, guidance: dict, negative: bool, side: int, steps: int, doc: str) -> None:
    """pipeline_class: the diffusers class; guidance: its guidance argument and default value;
    negative: whether it takes a negative prompt (classifier-free guidance)."""
    import diffusers
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", required=True, help=f"a {pipeline_class} folder (from_pretrained)")
    ap.add_argument("--prompt", default="a lighthouse on a rocky coast at dusk")
    if negative:
        ap.add_argument("--negative-prompt", default="")
    ap.add_argument("--height", type=int, default=side)
    ap.add_argument("--width", type=int, default=side)
    ap.add_argument("--steps", type=int, default=steps)
    (name, value), = guidance.items()
    ap.add_argument("--guidance", type=float, default=value, help=f"the pipeline's {name}")
    ap.add_argument("--max-sequence-length", type=int, default=None, help="the T5 / text encoder's tokens")
    ap.add_argument("--mode", default="cocodiff", choices=["flat", "tapa", "vfirst", "cocodiff"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--shard-weights", action="store_true", help="1/P of every block's weights per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="image.png")
    a = ap.parse_args()

    torch_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    pipe = getattr(diffusers, pipeline_class).from_pretrained(a.model, torch_dtype=torch_dtype)
    pipe = diffcp.diffusers.parallelize(pipe, mode=a.mode, dtype=a.dtype, shard_weights=a.shard_weights)
    kwargs = {name: a.guidance, "height": a.height, "width": a.width, "num_inference_steps": a.steps,
              "generator": torch.Generator().manual_seed(a.seed)}
    if negative:
        kwargs["negative_prompt"] = a.negative_prompt
    if a.max_sequence_length is not None:
        kwargs["max_sequence_length"] = a.max_sequence_length
    result = pipe(prompt=a.prompt, **kwargs)
    if MPI.COMM_WORLD.Get_rank() == 0:
        result.images[0].save(a.out)
        c = pipe.core.config()
        print(f"{a.out}: {a.width}x{a.height}, {a.steps} steps, P = {MPI.COMM_WORLD.Get_size()} ({a.mode}, "
              f"weights {c['weights_dtype']}{', sharded' if c['shard_weights'] else ''}: "
              f"{c['weights_bytes_per_rank'] / 1e6:.1f} MB per rank)")
